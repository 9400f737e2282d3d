"""A linear layer's product on a single row: the matmuls of batch-1 decode.

Each weight element is used once, so the product is a stream of the weight from memory. On the
GPU a Triton kernel streams it faster than cuBLAS's kernels for the Llama-3.1-8B decode shapes
(benchmarks/bench_gemv.py); ``ops_cuda.linear.linear`` sends single float16/bfloat16 rows here
and everything else to ``F.linear``. With ``out_dtype=torch.float32`` the product is the float32
one of the widened operands (a router's logits, as HF takes them) without a float32 copy of the weight.

A gated MLP's gate_up product on a single row is ``zoo::gated_gemv``: its kernel computes
act(gate x) * up x straight from the weight's gate and up rows, so the activation takes no launch
of its own and the [2I] product is never written.

An RMSNorm between two single-row products can be split between them, so that it takes no launch of
its own either. The product before it, ``zoo::gemv_into_norm``, adds the residual to its output,
writes the sum (the new residual) and the sum times the norm's weight (``weighted``, in the
activations' dtype: a float32 row would double the bytes every program of the next product reads),
and adds the sum's squares into the norm's ``stats``: NORM_SLOTS float64 values, zeroed before the
step, each program adding its rows' into one of them by an atomic add. The product after it,
``zoo::normed_gemv`` or ``zoo::normed_gated_gemv``, multiplies ``weighted`` by its weight and scales
the sums by the norm's 1 / rms from the slots' total. In float64 the order the adds arrive in does
not show in the float32 statistics but where their exact total sits within 2^-43 of a float32
rounding boundary. The normalised row is never rounded to bf16 as HF's RMSNorm rounds it: the
products agree with HF's to about the rounding of their output.
"""

import torch
import torch.nn.functional as F

from ops_cuda.activation import act_and_mul_reference
from ops_cuda.dispatch import cuda_implementation, public_op

GEMV_DTYPES = (torch.float16, torch.bfloat16)


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x W^T + b for x [..., K] holding one row and W [N, K], in ``out_dtype`` (default: x's)."""
    if out_dtype is None or out_dtype == x.dtype:
        return F.linear(x, weight, bias)
    return F.linear(x.to(out_dtype), weight.to(out_dtype), None if bias is None else bias.to(out_dtype))


gemv_op = torch.library.custom_op("zoo::gemv", gemv_reference, mutates_args=())


@gemv_op.register_fake
def _(x, weight, bias, out_dtype=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=out_dtype or x.dtype)


@cuda_implementation(gemv_op)
def _(x, weight, bias, out_dtype=None):
    from ops_cuda.triton_kernels import gemv_triton  # triton is imported only where a kernel runs

    return gemv_triton(x, weight, bias, out_dtype)


gemv = public_op(gemv_op, gemv_reference)


def gated_gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         activation: str) -> torch.Tensor:
    """act(gate) * up of x W^T + b for x [..., K] holding one row and W [2I, K] holding I gate rows then I up
    rows (b [2I] likewise): h [..., I]; ``activation`` is a key of ``ops_cuda.GATED_ACTIVATIONS``."""
    return act_and_mul_reference(gemv_reference(x, weight, bias), activation)


gated_gemv_op = torch.library.custom_op("zoo::gated_gemv", gated_gemv_reference, mutates_args=())


@gated_gemv_op.register_fake
def _(x, weight, bias, activation):
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2)


@cuda_implementation(gated_gemv_op)
def _(x, weight, bias, activation):
    from ops_cuda.triton_kernels import gated_gemv_triton  # triton is imported only where a kernel runs

    return gated_gemv_triton(x, weight, bias, activation)


gated_gemv = public_op(gated_gemv_op, gated_gemv_reference)


def gemv_into_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                             norm_weight: torch.Tensor, stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The product before a split RMSNorm: for x [..., K] holding one row, y = x W^T + b and the norm's
    input summed = y + residual (each rounded to x's dtype, as HF adds them). Returns (summed, weighted
    = summed * norm_weight rounded to x's dtype) and adds summed's sum of squares into ``stats``
    [NORM_SLOTS] (float64, zeroed before the step)."""
    return into_norm_reference(gemv_reference(x, weight, bias), residual, norm_weight, stats)


def into_norm_reference(out: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                        stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first half of a split RMSNorm after a product's one row ``out``: (summed = out + residual,
    weighted = summed * norm_weight), each rounded to the row's dtype, with summed's sum of squares
    added into ``stats``."""
    summed = residual + out.view(residual.shape)
    stats[0] += summed.double().square().sum()
    return summed, (summed.float() * norm_weight.float()).to(summed.dtype)


gemv_into_norm_op = torch.library.custom_op("zoo::gemv_into_norm", gemv_into_norm_reference, mutates_args=("stats",))


@gemv_into_norm_op.register_fake
def _(x, weight, bias, residual, norm_weight, stats):
    return torch.empty_like(residual), torch.empty_like(residual)


@cuda_implementation(gemv_into_norm_op)
def _(x, weight, bias, residual, norm_weight, stats):
    from ops_cuda.triton_kernels import gemv_into_norm_triton  # triton is imported only where a kernel runs

    return gemv_into_norm_triton(x, weight, bias, residual, norm_weight, stats)


gemv_into_norm = public_op(gemv_into_norm_op, gemv_into_norm_reference)


def split_norm_inverse_rms(weighted: torch.Tensor, stats: torch.Tensor, eps: float) -> torch.Tensor:
    """A split RMSNorm's 1 / rms in float32, from the slots' total over the row's K values."""
    return torch.rsqrt(stats.sum().float() / weighted.shape[-1] + eps)


def _normed_products(weighted: torch.Tensor, stats: torch.Tensor, eps: float, weight: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    # float32: the products of the weighted row, times the norm's 1 / rms, plus the bias.
    products = F.linear(weighted.float(), weight.float()) * split_norm_inverse_rms(weighted, stats, eps)
    return products if bias is None else products + bias.float()


def normed_gemv_reference(weighted: torch.Tensor, stats: torch.Tensor, eps: float, weight: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """The product after a split RMSNorm: (weighted W^T) / rms + b in W's dtype, for ``weighted`` [..., K] and
    ``stats`` as ``gemv_into_norm`` leaves them, rms = sqrt(sum(stats) / K + eps)."""
    return _normed_products(weighted, stats, eps, weight, bias).to(weight.dtype)


normed_gemv_op = torch.library.custom_op("zoo::normed_gemv", normed_gemv_reference, mutates_args=())


@normed_gemv_op.register_fake
def _(weighted, stats, eps, weight, bias):
    return weight.new_empty(*weighted.shape[:-1], weight.shape[0])


@cuda_implementation(normed_gemv_op)
def _(weighted, stats, eps, weight, bias):
    from ops_cuda.triton_kernels import normed_gemv_triton  # triton is imported only where a kernel runs

    return normed_gemv_triton(weighted, stats, eps, weight, bias)


normed_gemv = public_op(normed_gemv_op, normed_gemv_reference)


def normed_gated_gemv_reference(weighted: torch.Tensor, stats: torch.Tensor, eps: float, weight: torch.Tensor,
                                bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """``gated_gemv`` after a split RMSNorm: act(gate) * up of ``normed_gemv``'s products (each rounded
    to W's dtype), W [2I, K] as ``gated_gemv`` takes it."""
    products = _normed_products(weighted, stats, eps, weight, bias).to(weight.dtype)
    return act_and_mul_reference(products, activation)


normed_gated_gemv_op = torch.library.custom_op("zoo::normed_gated_gemv", normed_gated_gemv_reference, mutates_args=())


@normed_gated_gemv_op.register_fake
def _(weighted, stats, eps, weight, bias, activation):
    return weight.new_empty(*weighted.shape[:-1], weight.shape[0] // 2)


@cuda_implementation(normed_gated_gemv_op)
def _(weighted, stats, eps, weight, bias, activation):
    from ops_cuda.triton_kernels import normed_gated_gemv_triton  # triton is imported only where a kernel runs

    return normed_gated_gemv_triton(weighted, stats, eps, weight, bias, activation)


normed_gated_gemv = public_op(normed_gated_gemv_op, normed_gated_gemv_reference)
