"""What an attention layer does to its new tokens' q, k and v before attending, as one op:
per-head RMSNorm of q and k (Qwen3's q_norm/k_norm, optional) and of v (latent attention's
kv_a_layernorm over the latent it caches, optional), rotary, and the write of the rotated keys and
the values into the paged KV cache. On CUDA it is one kernel launch where the separate ops take
three or four."""

import torch

from ops_cuda.dispatch import cuda_implementation, public_op
from ops_cuda.kv_cache import write_kv_cache_reference
from ops_cuda.norm import rms_norm_reference
from ops_cuda.rotary import apply_rotary_reference, check_rotary_shapes


def check_rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_norm_weight, k_norm_weight,
                          v_norm_weight) -> None:
    check_rotary_shapes(q, k, cos, sin)
    n, kv_heads, head_dim = k.shape
    if q.shape[-1] != head_dim or v.dim() != 3 or v.shape[:2] != (n, kv_heads):
        raise ValueError(
            f"rotary_write_kv takes q [N, Hq, D], k [N, Hkv, D] and v [N, Hkv, Dv], got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k_cache.shape[2:] != k.shape[1:] or v_cache.shape[2:] != v.shape[1:] or k_cache.shape[:2] != v_cache.shape[:2]:
        raise ValueError(
            f"rotary_write_kv needs caches [blocks, block_size, Hkv, D] matching k and v, got k_cache "
            f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)} for k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"rotary_write_kv needs one dtype for both caches, got {k_cache.dtype} and {v_cache.dtype}")
    if slot_mapping.shape != (n,):
        raise ValueError(f"rotary_write_kv needs slot_mapping [N] = [{n}], got {tuple(slot_mapping.shape)}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("rotary_write_kv normalises q and k both or neither: pass q_norm_weight and k_norm_weight")
    if q_norm_weight is not None and (q_norm_weight.shape != (head_dim,) or k_norm_weight.shape != (head_dim,)):
        raise ValueError(
            f"rotary_write_kv's per-head norm weights are [head_dim] = [{head_dim}], got q_norm_weight "
            f"{tuple(q_norm_weight.shape)}, k_norm_weight {tuple(k_norm_weight.shape)}"
        )
    if v_norm_weight is not None and v_norm_weight.shape != v.shape[-1:]:
        raise ValueError(f"rotary_write_kv's v_norm_weight is [Dv] = [{v.shape[-1]}], got {tuple(v_norm_weight.shape)}")


def rotary_write_kv_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
    interleaved: bool = False, q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 0.0, weight_offset: float = 0.0, multiply_in_float32: bool = False,
    v_norm_weight: torch.Tensor | None = None, rotate_in_float32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns q [N, Hq, D] and k [N, Hkv, D] rotated, and writes the rotated k and v [N, Hkv, Dv]
    into the paged caches at ``slot_mapping`` (in place; slots < 0 skipped).

    With ``q_norm_weight``/``k_norm_weight`` ([D] each), q and k are first RMS-normalised per head,
    and with ``v_norm_weight`` ([Dv]) v (``rms_norm_reference`` with ``norm_eps``, ``weight_offset``,
    ``multiply_in_float32``, the options of every norm given). Then
    ``apply_rotary_reference`` (``interleaved``, partial rotary where cos/sin are narrower than D,
    ``rotate_in_float32``), then ``write_kv_cache_reference`` (``k_scale``/``v_scale``, FP8 caches): the composition of
    those references, operation for operation.
    """
    check_rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_norm_weight, k_norm_weight,
                          v_norm_weight)
    if q_norm_weight is not None:
        q = rms_norm_reference(q, q_norm_weight, norm_eps, weight_offset, multiply_in_float32)
        k = rms_norm_reference(k, k_norm_weight, norm_eps, weight_offset, multiply_in_float32)
    if v_norm_weight is not None:
        v = rms_norm_reference(v, v_norm_weight, norm_eps, weight_offset, multiply_in_float32)
    q, k = apply_rotary_reference(q, k, cos, sin, interleaved, rotate_in_float32)
    write_kv_cache_reference(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q, k


rotary_write_kv_op = torch.library.custom_op("zoo::rotary_write_kv", rotary_write_kv_reference,
                                             mutates_args=("k_cache", "v_cache"))


@rotary_write_kv_op.register_fake
def _(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0, interleaved=False,
      q_norm_weight=None, k_norm_weight=None, norm_eps=0.0, weight_offset=0.0, multiply_in_float32=False,
      v_norm_weight=None, rotate_in_float32=False):
    return torch.empty_like(q), torch.empty_like(k)


@cuda_implementation(rotary_write_kv_op)
def _(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0, interleaved=False,
      q_norm_weight=None, k_norm_weight=None, norm_eps=0.0, weight_offset=0.0, multiply_in_float32=False,
      v_norm_weight=None, rotate_in_float32=False):
    from ops_cuda.triton_kernels import rotary_write_kv_triton  # triton is imported only where a kernel runs

    check_rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q_norm_weight, k_norm_weight,
                          v_norm_weight)
    return rotary_write_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale, interleaved,
                                  q_norm_weight, k_norm_weight, norm_eps, weight_offset, multiply_in_float32,
                                  v_norm_weight, rotate_in_float32)


rotary_write_kv = public_op(rotary_write_kv_op, rotary_write_kv_reference)
