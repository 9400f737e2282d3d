"""The runtime: LLM + SamplingParams over a paged KV cache with continuous batching, and the CLI."""

from runtime.engine import RequestOutput
from runtime.llm import LLM, StreamDelta
from runtime.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StreamDelta"]
