"""Turns each sequence's next-token logits into a token: penalties, temperature, top-k, top-p,
min-p, then greedy argmax or a draw from the request's own generator."""

import torch

from runtime.sequence import Sequence


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    params = seq.params
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), device=logits.device)
        scores = logits[seen]
        logits[seen] = torch.where(scores > 0, scores / params.repetition_penalty, scores * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and seq.output_token_ids:
        counts = torch.bincount(torch.tensor(seq.output_token_ids, device=logits.device), minlength=logits.shape[-1])
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens that top-k, then top-p (nucleus), then min-p exclude."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it included).
        drop_sorted = cumulative - sorted_logits.softmax(-1) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


def top_logprobs(logprobs: torch.Tensor, token: int, k: int) -> dict[int, float]:
    entry = {token: logprobs[token].item()}
    if k:
        values, ids = torch.topk(logprobs, k)
        entry.update(zip(ids.tolist(), values.tolist()))
    return entry


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row of ``logits`` [len(seqs), vocab] (float32); records logprobs where asked."""
    plain_greedy = [i for i, s in enumerate(seqs) if s.params.greedy and not s.params.penalised]
    batched = set(plain_greedy)
    tokens = [0] * len(seqs)
    if plain_greedy:
        for i, token in zip(plain_greedy, logits[plain_greedy].argmax(-1).tolist()):
            tokens[i] = token
    for i, seq in enumerate(seqs):
        params = seq.params
        if i not in batched:
            row = apply_penalties(logits[i].clone(), seq)
            if params.greedy:
                tokens[i] = int(row.argmax())
            else:
                row = filter_logits(row / params.temperature, params.top_k, params.top_p, params.min_p)
                tokens[i] = int(torch.multinomial(row.softmax(-1).cpu(), 1, generator=seq.generator))
        if seq.logprobs is not None:
            seq.logprobs.append(top_logprobs(logits[i].log_softmax(-1), tokens[i], params.logprobs))
    return tokens
