"""sfjax: exact, reproducible speculative decoding for Llama-family models in JAX.

The public names load on first use, so that a submodule (``sfjax.rows``, which the kernels in
``pallas_kernels`` use) imports without the whole engine.
"""

import importlib

_PUBLIC = {"LLM": "sfjax.llm", "AsyncLLM": "sfjax.async_llm", "SamplingParams": "sfjax.sampling_params",
           "RequestOutput": "sfjax.outputs", "CompletionOutput": "sfjax.outputs",
           "Engine": "sfjax.engine", "EngineConfig": "sfjax.engine", "ModelConfig": "sfjax.config"}

__all__ = list(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sfjax' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
