"""Linear layers' products: ``F.linear``, except where zoo has a faster way.

On the CPU, rows multiply by a weight packed once by oneDNN (``PackedWeight``, which
``layers.linear.pack_cpu_weights`` makes; in a graph torch.compile traces, through
zoo::packed_linear), but for one or two float32 rows, and up to 16 float32 rows without a pack,
which multiply the other way round, as W x^T (``transposed_linear``). On the GPU a single
float16/bfloat16 row goes to zoo::gemv (and a gated MLP's gate_up product on it to
zoo::gated_gemv, ``takes_gemv``).
"""

import itertools
import weakref

import torch
import torch.nn.functional as F

from ops_cuda.gemv import GEMV_DTYPES, gemv, gemv_reference

FEW_ROWS = 16  # the rows a pack is laid out for, and the most W x^T takes
TRANSPOSED_ROWS = 2  # float32 rows W x^T multiplies faster than a pack
MKL = torch.backends.mkl.is_available()  # read once: a graph torch.compile traces cannot ask


class PackedWeight:
    """A float32 or bfloat16 CPU weight [out, in] packed once by oneDNN (for batches of 16 rows).

    ``F.linear`` has the library lay out the weight anew on every call; a weight packed once is read
    as it is. SmolLM2's float32 products run 1.3-4x faster so than with ``F.linear`` from 1 to 256
    rows, bfloat16 ones 1.2-1.5x up to 64 rows (``benchmarks/bench_cpu_linear.py``); one or two
    float32 rows are faster still as W x^T, which the pack leaves to ``transposed_linear``. The pack
    stands for the weight only while that is unchanged, and it costs the weight's memory again.
    """

    by_number: "weakref.WeakValueDictionary[int, PackedWeight]" = weakref.WeakValueDictionary()
    _numbers = itertools.count()

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, FEW_ROWS)
        self.source = self._identity(weight)
        # A graph torch.compile traces cannot hold oneDNN's opaque pack: it holds this number, which
        # zoo::packed_linear looks the pack up by.
        self.number = next(self._numbers)
        PackedWeight.by_number[self.number] = self

    @staticmethod
    def _identity(weight: torch.Tensor) -> tuple:
        # Storage and version counter: writing into the weight in place bumps the version. (A
        # tensor made under inference_mode keeps no version; only its storage is checked.)
        return weight.data_ptr(), None if weight.is_inference() else weight._version

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return False
        return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16
                                                 and torch.ops.mkldnn._is_mkldnn_bf16_supported())

    def serves(self, x: torch.Tensor) -> bool:
        fewest = TRANSPOSED_ROWS + 1 if x.dtype == torch.float32 else 0
        return x.numel() >= fewest * x.shape[-1]

    def stands_for(self, weight: torch.Tensor) -> bool:
        return self._identity(weight) == self.source

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self.packed, bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])

    def __reduce__(self):
        # A copy or a pickle of the model leaves the pack behind (oneDNN's layout can be neither
        # copied nor saved): the copy multiplies by its own weights unpacked.
        return _no_pack, ()


def _no_pack() -> None:
    return None


@torch.library.custom_op("zoo::packed_linear", mutates_args=())
def packed_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pack: int) -> torch.Tensor:
    """x W^T + b by the ``PackedWeight`` numbered ``pack``, the form a compiled graph calls it in;
    by ``F.linear`` where that pack is gone or no longer stands for ``weight``."""
    packed = PackedWeight.by_number.get(pack)
    if packed is not None and packed.stands_for(weight):
        return packed.linear(x, bias)
    return F.linear(x, weight, bias)


@packed_linear_op.register_fake
def _(x, weight, bias, pack):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def takes_transposed(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` multiplies x by weight as W x^T (``transposed_linear``), where no pack
    serves x: float32 on the CPU with MKL, up to 16 rows, outside a graph torch.compile traces (whose
    row count is dynamic: the bound would tie it to 16 rows)."""
    return (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and MKL
            and not torch.compiler.is_compiling() and x.numel() <= FEW_ROWS * x.shape[-1])


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b computed as (W x^T)^T. ``F.linear`` on a few float32 rows has MKL pack the whole
    weight on every call; the other way round MKL keeps the few rows and streams the weight once,
    near the memory's speed. Some widths MKL streams slower: one column (its matrix-vector product)
    and 9 to 15 (up to 1.8x the time of 16), so a single row is padded with zeros to two and 9 to
    15 rows to 16. SmolLM2's products of 1 to 16 rows run 1.2-4x faster so than with
    ``F.linear``, 2.5x and more at one or two rows, where this is faster than a ``PackedWeight``
    too; past 16 rows the two ways are about as fast. The sums run in another order than
    ``F.linear``'s."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    width = 2 if n == 1 else FEW_ROWS if n > 8 else n
    columns = F.pad(rows, (0, 0, 0, width - n)).t()
    product = torch.mm(weight, columns) if bias is None else torch.addmm(bias[:, None], weight, columns)
    return product.t()[:n].contiguous().view(*x.shape[:-1], weight.shape[0])


def linear(x, weight, bias=None, packed: PackedWeight | None = None, out_dtype: torch.dtype | None = None):
    """``F.linear``, faster where zoo knows how. On the CPU: by ``packed`` (the weight's
    ``PackedWeight``, if the runtime made one) where it serves x and stands for the weight, in a
    graph torch.compile traces through zoo::packed_linear; else float32 up to 16 rows as W x^T
    (``transposed_linear``). On the GPU: a single float16/bfloat16 row by zoo::gemv, when the
    weight's rows are contiguous. ``out_dtype`` float32: the product of the operands widened to
    float32 (zoo::gemv widens them as it reads)."""
    if out_dtype in (None, x.dtype) and x.device.type == "cpu":
        if packed is not None and packed.serves(x):
            if torch.compiler.is_compiling():
                return packed_linear_op(x, weight, bias, packed.number)
            if packed.stands_for(weight):
                return packed.linear(x, bias)
        if takes_transposed(x, weight):
            return transposed_linear(x, weight, bias)
    if takes_gemv(x, weight):
        return gemv(x, weight, bias, out_dtype)
    return gemv_reference(x, weight, bias, out_dtype)


def takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` multiplies x by weight with zoo::gemv (and a gated MLP its gate_up product
    with zoo::gated_gemv): a single float16/bfloat16 row on the GPU, a weight of its dtype (not ERNIE 4.5's
    float32 router) with contiguous rows."""
    return (x.device.type == "cuda" and x.numel() == x.shape[-1] and x.dtype in GEMV_DTYPES and weight.dtype == x.dtype
            and weight.stride(-1) == 1)
