"""The runtime: LLM + SamplingParams over a paged KV cache with continuous batching, its options
(EngineConfig), the CLI, and the OpenAI-compatible server (``runtime.server``, imported apart)."""

from runtime.config import EngineConfig
from runtime.engine import RequestOutput
from runtime.llm import LLM, StreamDelta
from runtime.sampling_params import SamplingParams

__all__ = ["EngineConfig", "LLM", "RequestOutput", "SamplingParams", "StreamDelta"]
