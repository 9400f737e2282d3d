"""How a call of an op reaches its implementation, and the dtypes the Triton kernels take.

Each op file defines the op's PyTorch reference (``<name>_reference``, which carries the op's
docstring), its ``torch.library`` custom op (``<name>_op``, registered as ``torch.ops.zoo.<name>``),
whose default kernel is that reference and whose ``cuda`` kernel is Triton (or a torch built-in
where one does better: flash attention, the grouped GEMM, ``torch._scaled_mm``), and the op under its own
name: ``<name> = reference_on_cpu(<name>_op, <name>_reference)``.
"""

import functools

import torch

# The dtypes every Triton kernel of the package computes in (one dtype for all of a call's inputs).
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def reference_on_cpu(op, reference, *, reads_host: bool = False):
    """The op as layers call it: ``reference`` on CPU tensors, ``op`` on any other device (CUDA, and
    the fake tensors of tracing).

    The op's default kernel is that same reference, so CPU results are unchanged: what the CPU skips
    is the custom op's Python dispatch, tens of µs a call, which made SmolLM2's CPU decode step (16
    sequences) 6% slower, measured by alternating the two ways within one process.

    When torch.compile traces a CPU model (``LLM(..., compile_decode=True)``), the reference is traced
    too, so that inductor fuses its ops, unless it ``reads_host`` (a value read on the host, as MoE's
    group sizes are): then the op stays opaque in the graph, and its CPU kernel runs the reference.
    """

    def call(*args, **kwargs):
        direct = args[0].device.type == "cpu" and not (reads_host and torch.compiler.is_compiling())
        return (reference if direct else op)(*args, **kwargs)

    functools.update_wrapper(call, reference)  # the reference's docstring and signature
    call.__name__ = call.__qualname__ = reference.__name__.removesuffix("_reference")
    return call
