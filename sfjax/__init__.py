"""sfjax: exact, reproducible speculative decoding for Llama-family models in JAX."""

from sfjax.async_llm import AsyncLLM
from sfjax.config import ModelConfig
from sfjax.engine import Engine, EngineConfig
from sfjax.llm import LLM
from sfjax.outputs import CompletionOutput, RequestOutput
from sfjax.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Engine", "EngineConfig",
           "ModelConfig"]
__version__ = "0.1.0"
