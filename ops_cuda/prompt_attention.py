"""Causal attention over prompts whose keys are all new: sequences laid one after another in the
token stream, each attending only its own tokens, with no cache to read.

This is attention without a KV cache (a model called on whole sequences), and the prompts of a
step none of whose tokens are cached yet when the cache holds the new keys and values exactly (the
model's dtype, scale 1.0): there the cache would hand back the k/v the op already has.

Shapes: q [tokens, Hq, D]; k/v [tokens, Hkv, D]; ``query_start_loc`` [sequences + 1] int32, where
each sequence's tokens start; ``max_query_len`` the longest sequence. ``sliding_window`` and
``softcap`` and ``sinks`` are ``ops_cuda/paged_attention.py``'s. The CUDA kernel is PyTorch's flash
attention in its variable-length form (one launch for every sequence, grouped KV heads read as they
are), for the inputs it takes: 16-bit dtypes, head dims up to 256 in multiples of 8, no softcap, sm80 or
newer; other inputs run the reference. Sinks scale its output: a sink s_h leaves a row of log-sum-exp
L (which flash attention returns) the share 1 / (1 + exp(s_h - L)) = sigmoid(L - s_h) of its mass. Not SDPA on prompts of one length, though cuDNN's kernel
behind it is 1.8x faster on the H200: cuDNN builds a plan for each new prompt length, 42-46 ms
each, which a server meeting a new length with most requests would pay again and again
(docs/performance.md).
"""

import torch

from ops_cuda.dispatch import cuda_implementation, public_op
from ops_cuda.paged_attention import attention_mask, sdpa


def _prompts_of_one_length(q, k, v, scale, sliding_window, softcap, sinks):
    # q: [B, T, Hq, D], k/v: [B, T, Hkv, D]: one SDPA call.
    length = q.shape[1]
    mask = None
    if sliding_window and sliding_window < length:
        mask = attention_mask(torch.arange(length, device=q.device), length, sliding_window)
    return sdpa(q, k, v, mask, scale, softcap, sinks=sinks)


def prompt_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
    scale: float, sliding_window: int, softcap: float = 0.0, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each sequence's tokens attend their own earlier tokens (and themselves), within the window."""
    # q: [N, Hq, D], k/v: [N, Hkv, D] -> [N, Hq, D]
    lengths = query_start_loc.diff().tolist()
    if len(set(lengths)) == 1:
        batch = (t.view(len(lengths), lengths[0], *t.shape[1:]) for t in (q, k, v))
        return _prompts_of_one_length(*batch, scale, sliding_window, softcap, sinks).reshape(q.shape)
    return torch.cat([_prompts_of_one_length(*(t[None] for t in seq), scale, sliding_window, softcap, sinks)[0]
                      for seq in zip(q.split(lengths), k.split(lengths), v.split(lengths))])


prompt_attention_op = torch.library.custom_op("zoo::prompt_attention", prompt_attention_reference, mutates_args=())


@prompt_attention_op.register_fake
def _(q, k, v, query_start_loc, max_query_len, scale, sliding_window, softcap=0.0, sinks=None):
    return torch.empty_like(q)


def takes_flash(q: torch.Tensor, softcap: float) -> bool:
    """Whether the CUDA kernel runs flash attention on these inputs (the module's docstring)."""
    head_dim = q.shape[-1]
    return (q.dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256 and not softcap
            and torch.cuda.get_device_capability(q.device)[0] >= 8 and torch.backends.cuda.flash_sdp_enabled())


@cuda_implementation(prompt_attention_op)
def _(q, k, v, query_start_loc, max_query_len, scale, sliding_window, softcap=0.0, sinks=None):
    if not takes_flash(q, softcap):
        return prompt_attention_reference(q, k, v, query_start_loc, max_query_len, scale, sliding_window, softcap,
                                          sinks)
    # Flash's window counts the keys before the query's own: sliding_window - 1 of them.
    left = sliding_window - 1 if sliding_window else -1
    out, log_sum_exp, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, query_start_loc, query_start_loc, max_query_len, max_query_len, 0.0, True, False, scale=scale,
        window_size_left=left, window_size_right=0 if sliding_window else -1,
    )
    if sinks is None:
        return out
    # log_sum_exp: [Hq, N] float32, each row's over its keys (the variable-length form's layout).
    kept = torch.sigmoid(log_sum_exp - sinks.to(torch.float32)[:, None]).T[:, :, None]
    return (out * kept).to(q.dtype)


# The reference reads the sequences' lengths on the host.
prompt_attention = public_op(prompt_attention_op, prompt_attention_reference, reads_host=True)
