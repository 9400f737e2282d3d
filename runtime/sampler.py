"""Turns each sequence's next-token logits into a token, for the whole batch at once:
penalties, temperature, top-k, top-p, min-p, then greedy argmax or a draw.

Draws use the exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` picks token i with
probability p_i, needs no cumulative sum, and stays on the logits' device: the host syncs only to
read the chosen ids, which ``sample_tokens`` leaves to its caller, and a request's logprobs. A seeded request
draws its noise from its own generator, so its tokens do not depend on what else is in the batch.
"""

import torch

from ops_cuda import argmax
from runtime.sequence import Sequence


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """Repetition (over prompt and output, HF style), presence and frequency (over the output) penalties on one row."""
    params = seq.params
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), device=logits.device)
        scores = logits[seen]
        penalised = torch.where(scores > 0, scores / params.repetition_penalty, scores * params.repetition_penalty)
        # Clamped to the dtype's finite range: an extreme penalty (1e-300, 1e300) would overflow to
        # +-inf, and a row of infinities has no softmax.
        finite = torch.finfo(logits.dtype)
        logits[seen] = penalised.clamp(finite.min, finite.max)
    if (params.presence_penalty or params.frequency_penalty) and seq.output_token_ids:
        counts = torch.bincount(torch.tensor(seq.output_token_ids, device=logits.device), minlength=logits.shape[-1])
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf what top-k, then top-p (nucleus), then min-p exclude; one setting per row
    ([B, V] logits, [B] settings; top_k 0, top_p 1 and min_p 0 are off)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    vocab = logits.shape[-1]
    # Top-k keeps the tokens tied with the k-th, as HF does.
    kth = torch.where(top_k > 0, top_k, vocab) - 1
    drop = sorted_logits < sorted_logits.gather(-1, kth[:, None])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(-1)
    # Keep the smallest prefix whose mass reaches top_p (the token that crosses it included).
    drop |= ((probs.cumsum(-1) - probs) >= top_p[:, None]) & (top_p < 1)[:, None]  # a float sum reaches 1 early
    drop |= probs < min_p[:, None] * probs[:, :1]
    return logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


def _exponential_noise(seqs: list[Sequence], vocab: int, device) -> torch.Tensor:
    noise = torch.empty(len(seqs), vocab, device=device)
    for row, seq in zip(noise, seqs):
        row.exponential_(generator=seq.generator)
    return noise


def sample_tokens(logits: torch.Tensor, seqs: list[Sequence], greedy: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``logits`` [len(seqs), vocab], left on the logits' device (reading them
    waits for the device); records logprobs where asked. ``greedy``: each row's argmax where the
    step computed it already."""
    if all(seq.params.argmax_only for seq in seqs):
        # Straight on the model's dtype: a float32 copy would change no value and no order.
        return argmax(logits) if greedy is None else greedy
    penalised = [i for i, seq in enumerate(seqs) if seq.params.penalised]
    drawn = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
    wants_logprobs = [i for i, seq in enumerate(seqs) if seq.logprobs is not None]
    raw = logits = logits.float()
    if penalised:
        logits = logits.clone()
        for i in penalised:
            apply_penalties(logits[i], seqs[i])
    tokens = argmax(logits)

    if drawn:
        def setting(values, dtype):
            return torch.tensor(values, dtype=dtype, device=logits.device)

        params = [seqs[i].params for i in drawn]
        # A top_k at or above the vocabulary keeps every token: clamped to it, no top_k overflows a long.
        top_k = setting([min(p.top_k, logits.shape[-1]) for p in params], torch.long)
        # A tiny temperature would overflow a positive logit to inf, whose softmax is NaN. A row less
        # its maximum is <= 0 with 0 at its top: divided, the others only fall towards -inf
        # (near-greedy). A temperature below float32's smallest normal is taken as it, not rounded to 0.
        temperature = setting([max(p.temperature, torch.finfo(torch.float32).tiny) for p in params], torch.float32)
        rows = logits[drawn]
        scaled = (rows - rows.amax(-1, keepdim=True)) / temperature[:, None]
        probs = filter_logits(scaled, top_k, setting([p.top_p for p in params], torch.float32),
                              setting([p.min_p for p in params], torch.float32)).softmax(-1)
        noise = _exponential_noise([seqs[i] for i in drawn], logits.shape[-1], logits.device)
        tokens[drawn] = argmax(probs / noise)

    if wants_logprobs:
        _record_logprobs(raw[wants_logprobs].log_softmax(-1), tokens[wants_logprobs], [seqs[i] for i in wants_logprobs])
    return tokens


def _record_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence]) -> None:
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0].tolist()
    k = max(seq.params.logprobs for seq in seqs)
    top_values, top_ids = (logprobs.topk(k) if k else (logprobs[:, :0], logprobs[:, :0].long()))
    for seq, token, value, values, ids in zip(seqs, tokens.tolist(), chosen, top_values.tolist(), top_ids.tolist()):
        entry = {token: value}
        entry.update(zip(ids[: seq.params.logprobs], values[: seq.params.logprobs]))
        seq.logprobs.append(entry)
