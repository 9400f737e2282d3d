"""What a request asks of generation."""

import math
import numbers
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Sampling settings of one request.

    ``temperature`` 0 is greedy. ``top_k`` 0 (or at least the vocabulary size), ``top_p`` 1 and
    ``min_p`` 0 are off. Penalties: ``repetition_penalty`` (HF/CTRL style, over prompt and output,
    1 is off), ``presence_penalty`` and ``frequency_penalty`` (OpenAI style, over the output, 0 is
    off). ``seed`` makes the
    request's samples reproducible whatever else is in the batch. Generation stops at
    ``max_tokens``, the model's EOS (unless ``ignore_eos``), any of ``stop_token_ids`` (kept in
    the output) or any ``stop`` string (cut from the text). ``logprobs`` = k returns, per
    generated token, the log-probability of the sampled token and of the k most likely ones
    under the model's raw distribution.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def argmax_only(self) -> bool:
        """Greedy, unpenalised, no logprobs: the token is the logits' argmax and nothing more (most requests)."""
        return self.greedy and not self.penalised and self.logprobs is None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first invalid field; ``stop_token_ids`` are checked against
        ``vocab_size`` when it is given. The real-valued fields are then held as floats: an int past
        a tensor's range (10**20) or a Fraction is what the sampler's tensor arithmetic cannot take."""
        numeric = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
        for name in numeric:
            value = getattr(self, name)
            if not is_finite_number(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            setattr(self, name, float(value))
        checks = [
            (is_integer(self.max_tokens) and self.max_tokens > 0, f"max_tokens must be a positive integer, got {self.max_tokens!r}"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (is_integer(self.top_k) and self.top_k >= 0, f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            # The range torch.Generator.manual_seed takes.
            (self.seed is None or (is_integer(self.seed) and -(2**63) <= self.seed < 2**64), f"seed must be None or an integer in [-2**63, 2**64), got {self.seed!r}"),
            (isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s for s in self.stop), f"stop strings must be non-empty strings, got {self.stop!r}"),
            (isinstance(self.stop_token_ids, (list, tuple)) and all(is_integer(t) and 0 <= t < (vocab_size or math.inf) for t in self.stop_token_ids), f"stop_token_ids must be integers in [0, {vocab_size or 'the vocabulary size'}), got {self.stop_token_ids!r}"),
            (self.logprobs is None or (is_integer(self.logprobs) and 0 <= self.logprobs <= 20), f"logprobs must be an integer in [0, 20], got {self.logprobs!r}"),
            (isinstance(self.ignore_eos, bool), f"ignore_eos must be True or False, got {self.ignore_eos!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def is_integer(value) -> bool:
    """An integer, Python's or numpy's, and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A real number, Python's or numpy's, and not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_finite_number(value) -> bool:
    """A real number a float holds: not inf or NaN, nor an integer past a float's range."""
    try:
        return is_number(value) and math.isfinite(value)
    except OverflowError:
        return False
