"""The runtime: LLM + SamplingParams over a paged KV cache with continuous batching, and the CLI."""

from runtime.config import EngineConfig
from runtime.engine import RequestOutput
from runtime.llm import LLM, StreamDelta
from runtime.sampling_params import SamplingParams

__all__ = ["EngineConfig", "LLM", "RequestOutput", "SamplingParams", "StreamDelta"]
