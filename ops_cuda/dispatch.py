"""How a call of an op reaches its implementation, the dtypes the Triton kernels take, and the slots
of a split norm's sums of squares, which its kernels and the model that allocates them share.

Each op file defines the op's PyTorch reference (``<name>_reference``, which carries the op's
docstring), its ``torch.library`` custom op (``<name>_op = torch.library.custom_op("zoo::<name>",
<name>_reference, ...)``, ``torch.ops.zoo.<name>``), whose default kernel is that reference and whose
CUDA kernel (``cuda_implementation``) is Triton (or a torch built-in where one does better: flash
attention, the grouped GEMM, ``torch._scaled_mm``), and the op under its own name: ``<name> =
public_op(<name>_op, <name>_reference)``.
"""

import functools

import torch

# The dtypes every Triton kernel of the package computes in (one dtype for all of a call's inputs).
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# A split RMSNorm's sums of squares (ops_cuda.gemv): as many float64 slots as the atomic adds of the
# product before it are spread over.
NORM_SLOTS = 32

# Each op's CUDA kernel, as ``cuda_implementation`` registered it.
_CUDA_KERNELS = {}


def cuda_implementation(op):
    """Decorator: registers the function as ``op``'s CUDA kernel, which ``public_op`` also calls directly."""

    def register(kernel):
        op.register_kernel("cuda")(kernel)
        _CUDA_KERNELS[op] = kernel
        return kernel

    return register


def public_op(op, reference, *, reads_host: bool = False):
    """The op as layers call it: on CPU tensors ``reference``, on CUDA tensors the op's CUDA kernel,
    each called directly; the registered op itself while torch.compile traces, and on any other
    device (the meta tensors of fake kernels).

    What a direct call skips is the custom op's Python dispatch, tens of µs a call: it made SmolLM2's
    CPU decode step (16 sequences) 6% slower, measured by alternating the two ways within one
    process. On CUDA the ops called eagerly are attention between the pieces of a replayed step's
    graphs, and every op of a step the graphs do not hold (past their tokens, or with images).

    When torch.compile traces a CPU model (``LLM(..., compile_decode=True)``), the reference is traced
    too, so that inductor fuses its ops, unless it ``reads_host`` (a value read on the host, as MoE's
    group sizes are): then the op stays opaque in the graph, and its CPU kernel runs the reference.
    """

    def call(*args, **kwargs):
        device, compiling = args[0].device.type, torch.compiler.is_compiling()
        if device == "cpu" and not (reads_host and compiling):
            return reference(*args, **kwargs)
        kernel = _CUDA_KERNELS.get(op) if device == "cuda" and not compiling else None
        return (op if kernel is None else kernel)(*args, **kwargs)

    functools.update_wrapper(call, reference)  # the reference's docstring and signature
    call.__name__ = call.__qualname__ = reference.__name__.removesuffix("_reference")
    return call
