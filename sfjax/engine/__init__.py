from sfjax.engine.engine import Engine, EngineConfig

__all__ = ["Engine", "EngineConfig"]
