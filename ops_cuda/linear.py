"""Linear layers' products: ``F.linear``, except where zoo has a faster way.

On the CPU, the few rows of a decode step multiply by a weight laid out once (``PackedWeight``); on
the GPU a single float16/bfloat16 row goes to zoo::gemv (and a gated MLP's gate_up product on it to
zoo::gated_gemv, ``takes_gemv``). ``layers.linear.pack_for_cpu_decode`` packs a model's weights.
"""

import torch

from ops_cuda.gemv import GEMV_DTYPES, gemv, gemv_reference


class PackedWeight:
    """A CPU weight [out, in] laid out once for the few rows of a decode step: float32 as a
    row-major copy, bfloat16 packed by oneDNN.

    ``F.linear`` on a few rows has the library pack the whole weight anew on every call. A
    bfloat16 weight packed once is read as it is. A float32 one is multiplied the other way round,
    as W x^T: MKL then keeps the few rows and streams the weight once, near the memory's speed (a
    single row is doubled, since MKL's matrix-vector product reads the weight at half that speed).
    SmolLM2's float32 products of 1 to 16 rows run 1.4-2.6x faster this way than with
    ``F.linear`` (``benchmarks/bench_cpu_linear.py``). Steps of more rows (prompt chunks, wide
    batches) keep ``F.linear``. Up to 16 rows the bfloat16 products equal ``F.linear``'s bit for
    bit. The layout stands for the weight only while that is unchanged, and it costs the weight's
    memory again (but for a float32 weight already row-major, an LM head's, which it takes as is).
    """

    ROWS = 16

    def __init__(self, weight: torch.Tensor):
        if weight.dtype == torch.float32:
            self.packed = weight.contiguous()
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, self.ROWS)
        self.source = self._identity(weight)

    @staticmethod
    def _identity(weight: torch.Tensor) -> tuple:
        # Storage and version counter: writing into the weight in place bumps the version. (A
        # tensor made under inference_mode keeps no version; only its storage is checked.)
        return weight.data_ptr(), None if weight.is_inference() else weight._version

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        if weight.device.type != "cpu":
            return False
        if weight.dtype == torch.float32:
            return torch.backends.mkl.is_available()
        return (weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())

    def serves(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return x.numel() <= self.ROWS * x.shape[-1] and self._identity(weight) == self.source

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if weight.dtype == torch.float32:
            columns = rows.expand(2, -1).contiguous() if rows.shape[0] == 1 else rows
            out = torch.mm(self.packed, columns.t()).t()[: rows.shape[0]]
            out = out + bias if bias is not None else out.contiguous()
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])

    def __reduce__(self):
        # A copy or a pickle of the model leaves the pack behind (oneDNN's layout can be neither
        # copied nor saved, and a float32 copy would only double the weights' memory): the copy
        # multiplies by its own weights unpacked.
        return _no_pack, ()


def _no_pack() -> None:
    return None


def linear(x, weight, bias=None, packed: PackedWeight | None = None, out_dtype: torch.dtype | None = None):
    """``F.linear``; on the GPU a single float16/bfloat16 row goes to zoo::gemv, when the weight's
    rows are contiguous (a CPU-loaded model moved to the GPU keeps its column-major weights). On
    the CPU, ``packed`` (the weight's ``PackedWeight``, if the runtime made one) serves few rows,
    except in a graph torch.compile traces, where inductor packs the weights itself. ``out_dtype``
    float32: the product of the operands widened to float32 (zoo::gemv widens them as it reads)."""
    if packed is not None and out_dtype in (None, x.dtype) and x.device.type == "cpu" \
            and not torch.compiler.is_compiling() and packed.serves(x, weight):
        return packed.linear(x, weight, bias)
    if takes_gemv(x, weight):
        return gemv(x, weight, bias, out_dtype)
    return gemv_reference(x, weight, bias, out_dtype)


def takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` multiplies x by weight with zoo::gemv (and a gated MLP its gate_up product
    with zoo::gated_gemv): a single float16/bfloat16 row on the GPU, a weight with contiguous rows."""
    return x.device.type == "cuda" and x.numel() == x.shape[-1] and x.dtype in GEMV_DTYPES and weight.stride(-1) == 1
