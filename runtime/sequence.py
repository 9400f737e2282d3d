"""One request's state while it is generated."""

import enum

import torch

from runtime.detokenizer import IncrementalDetokenizer
from runtime.multimodal import ImageInputs
from runtime.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Prompt and generated tokens, how many of them are in the KV cache, and the cache blocks.

    A sampled token enters ``token_ids`` before the host has it: ``runtime.run_ahead`` marks it
    pending there, and fills it in and adds it to the output once it arrives.

    A request with images holds their inputs (``images``), and their features from the step that
    computes its first image token until the step that computes its last (``image_features``).
    """

    def __init__(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams,
                 images: ImageInputs | None = None):
        self.request_id = request_id
        self.params = params
        self.images = images
        self.image_features: torch.Tensor | None = None  # [images.num_tokens, hidden] while needed
        self.token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []  # the resolved generated ids; the request's output shares this list
        self.num_pending = 0  # trailing entries of token_ids still on their way from the device
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose keys and values are in the cache
        # Of its prompt, how many tokens the prefix cache supplied at its first admission (None before it):
        # re-admitted after a preemption, it finds its own blocks.
        self.num_cached_tokens: int | None = None
        self.block_table: list[int] = []
        self.table_row: int | None = None  # its row of the block manager's block_tables while it holds blocks
        self.block_hashes: list[int] = []  # prefix-cache keys of the leading full blocks
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.generator: torch.Generator | None = None  # a seeded request's own, on the model's device
        self.detokenizer: IncrementalDetokenizer | None = None  # its text while it runs, where asked for

    def seed_generator(self, device: torch.device) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(int(self.params.seed))  # numpy ints too

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_resolved_tokens(self) -> int:
        return len(self.token_ids) - self.num_pending

    def reaches_length_limit(self, max_model_len: int, count_pending: bool) -> bool:
        """Whether its tokens reach its length limit: ``max_tokens`` generated, or ``max_model_len``
        tokens in all; its pending tokens counted or not."""
        pending = self.num_pending if count_pending else 0
        return (len(self.output_token_ids) + pending >= self.params.max_tokens
                or self.num_resolved_tokens + pending >= max_model_len)

    def ends_with_pending_token(self, max_model_len: int) -> bool:
        """Whether a pending token is its last by length: it ends with that token whatever its value,
        so it is not scheduled again."""
        return self.num_pending > 0 and self.reaches_length_limit(max_model_len, count_pending=True)

    def finish(self, reason: str, error: str | None = None) -> None:
        if self.num_pending:  # sampled ahead, after the token that ended it
            del self.token_ids[-self.num_pending :]
            self.num_pending = 0
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.error = error
