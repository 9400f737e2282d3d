"""The programmatic-dependent-launch contract of zoo's Triton kernels (``ops_cuda/triton_helpers.py``),
checked on their source: the GPU tests run the kernels chained, but a race between them shows only
now and then.

Under PDL a kernel starts while the kernels before it still run (each lets the next one start before
its own wait). That is sound when every kernel waits before its programs can return, so that a
finished kernel implies finished predecessors, and when what a kernel reads before its wait is written
by no kernel of the step: weights, the step's attention metadata, which the runtime writes before
the step's first kernel, and the KV cache's entries of earlier steps (decode attention reads its
first key tile early, all but the step's own key). The one exception, one token's MoE down kernel
(bf16 or MXFP4), reads the router's ids early, behind a kernel that lets it start only after its own wait.
"""

import ast
import importlib
import inspect
import textwrap

import pytest

pytest.importorskip("triton")

KERNEL_MODULES = (
    "ops_cuda.triton_kernels", "ops_cuda.paged_attention_triton", "ops_cuda.router_triton",
    "ops_cuda.mla_attention_triton", "ops_cuda.fp8_triton", "ops_cuda.moe_decode", "ops_cuda.moe_triton",
)
WAITS = ("begin_after_previous", "begin_after_previous_holding_next")
# Pointer parameters, by name, that no kernel of a step writes: weights, scales and biases, the norms'
# weights, and the attention metadata.
NEVER_WRITTEN_IN_A_STEP = {
    "w_ptr", "bias_ptr", "scale_ptr", "weight_ptr", "q_weight_ptr", "k_weight_ptr", "v_weight_ptr", "norm_weight_ptr",
    "down_ptr",
    "words_ptr", "scales_ptr", "seq_lens_ptr", "slot_ptr", "block_tables_ptr",
}
# kernel -> the KV cache it reads before its wait: entries of earlier steps, its loads masked to the keys
# before the step's own (at seq_len - 1), which the kernel before it writes and it reads after its wait.
READ_EARLY_FROM_EARLIER_STEPS = {"_decode_split_kernel": {"k_cache_ptr", "v_cache_ptr"}}
# kernel -> (what it reads before its wait that an earlier kernel of the step wrote, the kernel launched
# just before it, which must let it start only after its own wait).
READ_EARLY_BEHIND_A_HOLD = {"_token_down_combine_kernel": ({"ids_ptr"}, "_token_gate_up_kernel"),
                            "_mxfp4_token_down_combine_kernel": ({"ids_ptr"}, "_mxfp4_token_gate_up_kernel")}


def _pdl_kernels() -> dict:
    kernels = {}
    for module_name in KERNEL_MODULES:
        for obj in vars(importlib.import_module(module_name)).values():
            if hasattr(obj, "fn") and "PDL" in getattr(obj, "arg_names", ()) and obj.fn.__name__ not in WAITS:
                kernels[obj.fn.__name__] = obj
    return kernels


KERNELS = _pdl_kernels()


def _body(name: str) -> list[ast.stmt]:
    return ast.parse(textwrap.dedent(inspect.getsource(KERNELS[name].fn))).body[0].body


def _wait_call(stmt: ast.stmt) -> str | None:
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Name):
        return stmt.value.func.id if stmt.value.func.id in WAITS else None
    return None


def _wait(name: str) -> tuple[int, str]:
    """(index in the body, helper) of the kernel's one wait."""
    waits = [(i, _wait_call(stmt)) for i, stmt in enumerate(_body(name)) if _wait_call(stmt)]
    assert len(waits) == 1, f"{name} must call one of {WAITS} once, as a statement of its body (under no branch)"
    return waits[0]


def _pointers_read_before_wait(name: str) -> set[str]:
    index, _ = _wait(name)
    early = ast.Module(body=_body(name)[:index], type_ignores=[])
    # `x_ptr.dtype` is the pointer's type, not a read.
    typed = {id(node.value) for node in ast.walk(early) if isinstance(node, ast.Attribute) and node.attr == "dtype"}
    return {node.id for node in ast.walk(early)
            if isinstance(node, ast.Name) and node.id.endswith("_ptr") and id(node) not in typed}


def test_the_chain_kernels_are_found():
    assert {"gemv_kernel", "gated_gemv_kernel", "gemv_into_norm_kernel", "_rms_norm_kernel", "_rotary_write_kv_kernel",
            "_decode_split_kernel", "_decode_reduce_kernel", "_route_topk_kernel", "_token_gate_up_kernel", "_token_down_combine_kernel",
            "_mla_decode_split_kernel", "_fp8_block_gemv_kernel", "_argmax_chunks_kernel", "_mxfp4_token_gate_up_kernel",
            "_mxfp4_token_down_combine_kernel"} <= set(KERNELS)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_program_waits_before_it_can_return(name):
    index, _ = _wait(name)
    early_returns = [node for stmt in _body(name)[:index] for node in ast.walk(stmt) if isinstance(node, ast.Return)]
    assert not early_returns, f"{name} may return before its wait: the kernel could finish before its predecessors"


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_reads_before_the_wait_are_never_written_in_the_step(name):
    allowed, _ = READ_EARLY_BEHIND_A_HOLD.get(name, (set(), None))
    allowed = allowed | READ_EARLY_FROM_EARLIER_STEPS.get(name, set())
    assert _pointers_read_before_wait(name) - NEVER_WRITTEN_IN_A_STEP <= allowed


@pytest.mark.parametrize("name", sorted(READ_EARLY_FROM_EARLIER_STEPS))
def test_the_early_cache_reads_are_still_made(name):
    assert READ_EARLY_FROM_EARLIER_STEPS[name] <= _pointers_read_before_wait(name), "no longer read early: remove it"


@pytest.mark.parametrize("name", sorted(READ_EARLY_BEHIND_A_HOLD))
def test_an_early_read_of_a_step_output_sits_behind_a_hold(name):
    reads, predecessor = READ_EARLY_BEHIND_A_HOLD[name]
    assert reads <= _pointers_read_before_wait(name), "the exception no longer applies: remove it"
    assert _wait(predecessor)[1] == "begin_after_previous_holding_next", (
        f"{name} reads {sorted(reads)} before its wait: {predecessor}, launched just before it, must let it start "
        "only after its own wait"
    )
