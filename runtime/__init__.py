"""The runtime: LLM + SamplingParams over a paged KV cache with continuous batching, its options
(EngineConfig), and the CLI."""

from runtime.config import EngineConfig
from runtime.engine import RequestOutput
from runtime.llm import LLM, StreamDelta
from runtime.sampling_params import SamplingParams

__all__ = ["EngineConfig", "LLM", "RequestOutput", "SamplingParams", "StreamDelta"]
