"""zoo::rotary_write_kv (per-head q/k RMSNorm, rotary and the KV-cache write in one kernel) against
the composition of the references it replaces, and against the separate kernels.

The interpreter rounds float32 to bfloat16 by truncation, so CPU tests run float32 and float16;
the ``gpu`` tests check bfloat16 bit for bit.
"""

import pytest
import torch

from ops_cuda import rotary_write_kv
from ops_cuda.kv_cache import write_kv_cache_reference
from ops_cuda.kv_layout import is_key_minor, new_kv_cache
from ops_cuda.norm import rms_norm_reference
from ops_cuda.rotary import apply_rotary_reference
from ops_cuda.rotary_kv import rotary_write_kv_reference
from tests.conftest import every_pair
from tests.ops.test_triton_ops import (
    EPS,
    GPU_TOL,
    assert_close,
    qkv_views,
    replay_in_graph,
    rope_table,
    run_poisoned,
)

# q/k-norm options: (weight_offset, multiply_in_float32) of Llama-style (Qwen3), Gemma-style and OLMo 2-style RMSNorm.
NORMS = {"no_norm": None, "llama": (0.0, False), "gemma": (1.0, True), "offset_cast_first": (1.0, False),
         "float32_multiply": (0.0, True)}
# How many of a head's 24 channels rotate: all, the first 16 or 8 (partial rotary), none (NoPE).
ROTATIONS = {"full": 24, "partial16": 16, "partial8": 8, "nope": 0}
SLOTS = [0, 5, -1, 11, 2, -1, 7]  # 7 tokens over 3 blocks of 4 slots; two padding tokens (slot -1)


def make_inputs(dtype, norm, cache_dtype=None, n=len(SLOTS), q_heads=4, kv_heads=2, head_dim=24, rotary_dim=24,
                num_blocks=3, block_size=4, device="cpu", seed=0):
    """(q, k, v, cos, sin, k_cache, v_cache, slot_mapping) and the norm's keyword arguments. ``n`` other
    than len(SLOTS) takes random positions and distinct random slots (``seed`` draws every value)."""
    torch.manual_seed(seed)
    q, k, v = qkv_views(n, q_heads, kv_heads, head_dim, dtype, device)
    q.mul_(3)  # norms far from 1, so that a missing or doubled norm shows
    if n == len(SLOTS):
        positions, slots = torch.tensor([0, 1, 7, 30, 1000, 5, 31999]), torch.tensor(SLOTS)
    else:
        positions, slots = torch.randint(0, 32768, (n,)), torch.randperm(num_blocks * block_size)[:n]
    cos, sin = rope_table(positions.to(device), rotary_dim)
    # Poisoned caches (NaN; 0x7f in e4m3), laid out as the runtime's (an FP8 V key-minor): a slot
    # the kernel misses, or a padding token it writes, shows.
    k_cache, v_cache = new_kv_cache(num_blocks, block_size, kv_heads, head_dim, cache_dtype or dtype, device)
    for cache in (k_cache, v_cache):
        cache.view(torch.uint8).fill_(0x7F) if cache.element_size() == 1 else cache.fill_(float("nan"))
    norm_args = {}
    if NORMS[norm] is not None:
        weight_offset, multiply_in_float32 = NORMS[norm]
        weights = (torch.randn(2, head_dim, device=device) * (0.2 if weight_offset else 1.0)).to(dtype)
        norm_args = dict(q_norm_weight=weights[0], k_norm_weight=weights[1], norm_eps=EPS,
                         weight_offset=weight_offset, multiply_in_float32=multiply_in_float32)
    return (q, k, v, cos, sin, k_cache, v_cache, slots.to(device)), norm_args


def poisoned(cache: torch.Tensor) -> torch.Tensor:
    """Where ``cache`` still holds make_inputs' poison."""
    return cache.view(torch.uint8) == 0x7F if cache.element_size() == 1 else cache.isnan()


def latent_inputs(dtype, cache_dtype=None, n=len(SLOTS), heads=8, rank=40, rope=16, nope=24, num_blocks=3,
                  block_size=4, device="cpu", seed=0):
    """Latent attention's arguments, as ``layers.mla.MLAttention`` passes them: q's rope part, one
    rope key and one latent per token, strided views of the projections' outputs; the caches the two
    column ranges of one poisoned pool [blocks, block_size, rank + rope]; kv_a_layernorm's weight as
    v's norm. -> (args, norm keyword arguments, the pool). ``seed`` draws every value."""
    torch.manual_seed(seed)
    q = torch.randn(n, heads, nope + rope, device=device).to(dtype)[..., nope:]
    latent_and_rope = (torch.randn(n, rank + rope, device=device) * 3).to(dtype)
    latent, k_rope = latent_and_rope[:, None, :rank], latent_and_rope[:, None, rank:]
    if n == len(SLOTS):
        positions, slots = torch.tensor([0, 1, 7, 30, 1000, 5, 31999]), torch.tensor(SLOTS)
    else:
        positions, slots = torch.randint(0, 32768, (n,)), torch.randperm(num_blocks * block_size)[:n]
    cos, sin = rope_table(positions.to(device), rope)
    pool = torch.empty(num_blocks, block_size, rank + rope, dtype=cache_dtype or dtype, device=device)
    pool.view(torch.uint8).fill_(0x7F) if pool.element_size() == 1 else pool.fill_(float("nan"))
    args = (q, k_rope, latent, cos, sin, pool[:, :, None, rank:], pool[:, :, None, :rank], slots.to(device))
    weight = (torch.randn(rank, device=device) * 0.5 + 1).to(dtype)
    return args, dict(norm_eps=EPS, v_norm_weight=weight), pool


def expected(args, scales, interleaved, norm_args):
    q, k, v, cos, sin, k_cache, v_cache, slots = args
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    out = rotary_write_kv_reference(q, k, v, cos, sin, k_expected, v_expected, slots, *scales, interleaved, **norm_args)
    return out, k_expected, v_expected


def assert_same_bits(ours: torch.Tensor, theirs: torch.Tensor):
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[ours.element_size()]
    assert torch.equal(ours.view(bits), theirs.view(bits))


def test_reference_composes_the_references():
    torch.manual_seed(0)
    args, norm_args = make_inputs(torch.float32, "gemma", rotary_dim=16)
    q, k, v, cos, sin, k_cache, v_cache, slots = args
    (q_rot, k_rot), k_expected, v_expected = expected(args, (0.5, 2.0), True, norm_args)
    options = (EPS, norm_args["weight_offset"], norm_args["multiply_in_float32"])
    q_normed = rms_norm_reference(q, norm_args["q_norm_weight"], *options)
    k_normed = rms_norm_reference(k, norm_args["k_norm_weight"], *options)
    q_ref, k_ref = apply_rotary_reference(q_normed, k_normed, cos, sin, True)
    write_kv_cache_reference(k_ref, v, k_cache, v_cache, slots, 0.5, 2.0)
    assert torch.equal(q_rot, q_ref) and torch.equal(k_rot, k_ref)
    torch.testing.assert_close(k_cache, k_expected, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_expected, rtol=0, atol=0, equal_nan=True)


def test_reference_normalises_v_before_its_write():
    args, norm_args, pool = latent_inputs(torch.float32)
    q, k, v, cos, sin, k_cache, v_cache, slots = args
    written = pool.clone()
    q_rot, k_rot = rotary_write_kv_reference(*args, 0.5, 0.5, True, **norm_args)
    v_normed = rms_norm_reference(v, norm_args["v_norm_weight"], EPS)
    q_ref, k_ref = apply_rotary_reference(q, k, cos, sin, True)
    write_kv_cache_reference(k_ref, v_normed, written[:, :, None, 40:], written[:, :, None, :40], slots, 0.5, 0.5)
    assert torch.equal(q_rot, q_ref) and torch.equal(k_rot, k_ref)
    torch.testing.assert_close(pool, written, rtol=0, atol=0, equal_nan=True)
    assert not torch.equal(v_normed, v)


def test_reference_of_zero_channels_writes_k_as_it_came():
    # A NoPE layer's zero-width cos/sin: q and k leave unrotated, and the cache holds k and v themselves.
    args, _ = make_inputs(torch.float32, "no_norm", rotary_dim=0)
    q, k, v, cos, sin, k_cache, v_cache, slots = args
    assert cos.shape == (len(SLOTS), 0)
    q_out, k_out = rotary_write_kv_reference(*args)
    assert torch.equal(q_out, q) and torch.equal(k_out, k)
    written = slots >= 0
    for cache, values in ((k_cache, k), (v_cache, v)):
        assert torch.equal(cache.view(-1, *values.shape[1:])[slots[written]], values[written])


def test_bad_inputs_name_the_culprit():
    args, norm_args = make_inputs(torch.float32, "llama")
    q, k, v, cos, sin, k_cache, v_cache, slots = args
    with pytest.raises(ValueError, match="both or neither"):
        rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots, q_norm_weight=norm_args["q_norm_weight"])
    with pytest.raises(ValueError, match="norm weights are"):
        rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots, q_norm_weight=torch.ones(12),
                        k_norm_weight=torch.ones(12))
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots[:3])
    with pytest.raises(ValueError, match="caches"):
        rotary_write_kv(q, k, v, cos, sin, k_cache[:, :, :1], v_cache, slots)
    with pytest.raises(TypeError, match="one dtype"):
        rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache.half(), slots)
    with pytest.raises(ValueError, match=r"v_norm_weight is \[Dv\] = \[24\], got \(12,\)"):
        rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots, v_norm_weight=torch.ones(12))


# ---------------------------------------------------------------------------------------------
# CPU: the launcher under Triton's interpreter
# ---------------------------------------------------------------------------------------------


def run_interpreted(args, scales, interleaved, norm_args):
    from ops_cuda.triton_kernels import rotary_write_kv_triton

    return rotary_write_kv_triton(*args, *scales, interleaved, **norm_args)


@pytest.mark.interpreter
@pytest.mark.parametrize("fp8", [False, True], ids=["cache", "fp8_cache"])
@pytest.mark.parametrize(("rotation", "norm", "pairs"), every_pair(ROTATIONS, NORMS, ("neox", "interleaved")), ids=str)
def test_rotary_write_kv_fp16_is_bit_equal_interpreted(rotation, norm, pairs, fp8):
    # Every pair of rotation, norm and pair layout, each with both caches.
    interleaved = pairs == "interleaved"
    args, norm_args = make_inputs(torch.float16, norm, torch.float8_e4m3fn if fp8 else None,
                                  rotary_dim=ROTATIONS[rotation])
    assert is_key_minor(args[6]) == fp8
    scales = (0.5, 2.0) if fp8 else (1.0, 1.0)
    (q_ref, k_ref), k_expected, v_expected = expected(args, scales, interleaved, norm_args)
    q_out, k_out = run_interpreted(args, scales, interleaved, norm_args)
    assert_same_bits(q_out, q_ref)
    assert_same_bits(k_out, k_ref)
    assert_same_bits(args[5], k_expected)
    assert_same_bits(args[6], v_expected)


@pytest.mark.interpreter
@pytest.mark.parametrize("fp8", [False, True], ids=["cache", "fp8_cache"])
@pytest.mark.parametrize("norm", ["no_norm", "llama"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [24, 16], ids=["full", "partial16"])
def test_rotary_write_kv_in_float32_fp16_is_bit_equal_interpreted(rotary_dim, interleaved, norm, fp8):
    # OLMo 2's and OLMo 3's rotation (their q/k norms run before the op), and ERNIE 4.5's of interleaved
    # pairs: the float32 cos and sin, each output rounded once, into the cache.
    args, norm_args = make_inputs(torch.float16, norm, torch.float8_e4m3fn if fp8 else None, rotary_dim=rotary_dim)
    scales = (0.5, 2.0) if fp8 else (1.0, 1.0)
    options = {**norm_args, "rotate_in_float32": True}
    (q_ref, k_ref), k_expected, v_expected = expected(args, scales, interleaved, options)
    (q_rounded_angles, _), _, _ = expected(args, scales, interleaved, norm_args)
    q_out, k_out = run_interpreted(args, scales, interleaved, options)
    for ours, theirs in ((q_out, q_ref), (k_out, k_ref), (args[5], k_expected), (args[6], v_expected)):
        assert_same_bits(ours, theirs)
    assert not torch.equal(q_out, q_rounded_angles)


@pytest.mark.interpreter
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
def test_rotary_write_kv_fp32_interpreted(interleaved, norm):
    # Without a norm, bit-equal; with one, float32's sums of squares differ from torch's in order only.
    args, norm_args = make_inputs(torch.float32, norm, rotary_dim=16)
    (q_ref, k_ref), k_expected, v_expected = expected(args, (1.0, 1.0), interleaved, norm_args)
    q_out, k_out = run_interpreted(args, (1.0, 1.0), interleaved, norm_args)
    tol = 0.0 if norm == "no_norm" else 1e-6
    assert_close(q_out, q_ref, tol)
    assert_close(k_out, k_ref, tol)
    written = torch.tensor([s for s in SLOTS if s >= 0])
    assert_close(args[5].view(-1, *k_ref.shape[1:])[written], k_expected.view(-1, *k_ref.shape[1:])[written], tol)
    assert_same_bits(args[6], v_expected)
    assert torch.equal(poisoned(args[5]), poisoned(k_expected))  # the same slots untouched


@pytest.mark.interpreter
@pytest.mark.parametrize("q_heads, kv_heads, head_dim", [(8, 1, 16), (6, 2, 40), (2, 2, 64), (40, 8, 16)])
def test_rotary_write_kv_head_shapes_interpreted(q_heads, kv_heads, head_dim):
    # GQA ratios, a head_dim that is not a power of two, several programs per token (40 heads of 16).
    args, norm_args = make_inputs(torch.float16, "llama", q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                                  rotary_dim=head_dim)
    (q_ref, k_ref), k_expected, v_expected = expected(args, (1.0, 1.0), False, norm_args)
    q_out, k_out = run_interpreted(args, (1.0, 1.0), False, norm_args)
    for ours, theirs in ((q_out, q_ref), (k_out, k_ref), (args[5], k_expected), (args[6], v_expected)):
        assert_same_bits(ours, theirs)


@pytest.mark.interpreter
@pytest.mark.parametrize("fp8", [False, True], ids=["pool", "fp8_pool"])
@pytest.mark.parametrize("norm", ["llama", "gemma"])
def test_latent_norm_rotary_and_write_fp16_is_bit_equal_interpreted(norm, fp8):
    # Latent attention's use: one rope key and one normalised latent per token into one pool's columns.
    args, norm_args, pool = latent_inputs(torch.float16, torch.float8_e4m3fn if fp8 else None)
    norm_args.update(zip(("weight_offset", "multiply_in_float32"), NORMS[norm]))
    scales = (0.5, 0.5) if fp8 else (1.0, 1.0)
    expected_pool = pool.clone()
    q_ref, k_ref = rotary_write_kv_reference(*args[:5], expected_pool[:, :, None, 40:], expected_pool[:, :, None, :40],
                                             args[7], *scales, True, **norm_args)
    q_out, k_out = run_interpreted(args, scales, True, norm_args)
    for ours, theirs in ((q_out, q_ref), (k_out, k_ref), (pool, expected_pool)):
        assert_same_bits(ours, theirs)
    assert poisoned(pool).sum() == (3 * 4 - 5) * 56  # the five real slots written, every column of them


@pytest.mark.interpreter
def test_rotary_write_kv_matches_the_separate_kernels_interpreted():
    # float32, where nothing rounds the norm's statistics away: the fused kernel computes the
    # per-head RMSNorm as zoo::rms_norm's kernel does, then rotates and writes as theirs do.
    from ops_cuda import triton_kernels as kernels

    args, norm_args = make_inputs(torch.float32, "llama", rotary_dim=16)
    q, k, v, cos, sin, k_cache, v_cache, slots = args
    k_separate, v_separate = k_cache.clone(), v_cache.clone()
    q_normed = kernels.rms_norm_triton(q, norm_args["q_norm_weight"], EPS)
    k_normed = kernels.rms_norm_triton(k, norm_args["k_norm_weight"], EPS)
    q_ref, k_ref = kernels.apply_rotary_triton(q_normed, k_normed, cos, sin)
    kernels.write_kv_cache_triton(k_ref, v, k_separate, v_separate, slots)
    q_out, k_out = run_interpreted(args, (1.0, 1.0), False, norm_args)
    for ours, theirs in ((q_out, q_ref), (k_out, k_ref), (k_cache, k_separate), (v_cache, v_separate)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------------------------
# GPU: the registered op on CUDA tensors, eager and under CUDA-graph capture
# ---------------------------------------------------------------------------------------------

GPU_SHAPES = {  # n, q_heads, kv_heads, head_dim, rotary_dim
    "decode_llama8b": (1, 32, 8, 128, 128), "decode_qwen3_30b": (1, 32, 4, 128, 128),
    "batch_256": (256, 32, 8, 128, 128), "prefill_4097": (4097, 16, 8, 128, 128),
    "partial_rotary": (37, 28, 4, 128, 64), "odd_head_dim": (9, 6, 2, 80, 32),
    "nope": (37, 16, 4, 128, 0),  # SmolLM3's NoPE layers: the norm and the write, no channel rotated
}


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["cache", "fp8_cache"])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_rotary_write_kv_gpu(shape, interleaved, norm, fp8):
    n, q_heads, kv_heads, head_dim, rotary_dim = GPU_SHAPES[shape]
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 caches need compute capability 8.9")
    block_size = 16
    args, norm_args = make_inputs(torch.bfloat16, norm, torch.float8_e4m3fn if fp8 else None, n, q_heads, kv_heads,
                                  head_dim, rotary_dim, -(-2 * n // block_size), block_size, "cuda")
    slots = args[-1]
    slots[3::7] = -1  # padding tokens
    scales = (0.5, 2.0) if fp8 else (1.0, 1.0)
    (q_ref, k_ref), k_expected, v_expected = expected(args, scales, interleaved, norm_args)
    q_out, k_out = run_poisoned(rotary_write_kv, *args, *scales, interleaved, *norm_args.values())
    k_cache, v_cache = args[5], args[6]
    assert_same_bits(v_cache, v_expected)
    assert torch.equal(poisoned(k_cache), poisoned(k_expected))
    if norm == "no_norm":  # rotary and the write bit for bit, as the separate kernels
        for ours, theirs in ((q_out, q_ref), (k_out, k_ref), (k_cache, k_expected)):
            assert_same_bits(ours, theirs)
        return
    # The norm's float32 statistics are summed in another order than torch's: a unit of bf16 at most,
    # which can move an e4m3 entry by one of its units.
    assert_close(q_out, q_ref, GPU_TOL[torch.bfloat16])
    assert_close(k_out, k_ref, GPU_TOL[torch.bfloat16])
    written = slots[slots >= 0]
    ours, theirs = (cache.view(-1, kv_heads, head_dim)[written].float() for cache in (k_cache, k_expected))
    tol = 2**-3 if fp8 else GPU_TOL[torch.bfloat16]
    torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol * theirs.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["cache", "fp8_cache"])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_rotary_write_kv_in_float32_gpu(shape, fp8):
    """OLMo 2's and OLMo 3's rotation (``rotate_in_float32``), bf16 and written, bit for bit."""
    n, q_heads, kv_heads, head_dim, rotary_dim = GPU_SHAPES[shape]
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 caches need compute capability 8.9")
    block_size = 16
    args, _ = make_inputs(torch.bfloat16, "no_norm", torch.float8_e4m3fn if fp8 else None, n, q_heads, kv_heads,
                          head_dim, rotary_dim, -(-2 * n // block_size), block_size, "cuda")
    args[-1][3::7] = -1  # padding tokens
    scales = (0.5, 2.0) if fp8 else (1.0, 1.0)
    options = {"rotate_in_float32": True}
    (q_ref, k_ref), k_expected, v_expected = expected(args, scales, False, options)
    # no norms (q_norm_weight, k_norm_weight, norm_eps, weight_offset, multiply_in_float32, v_norm_weight)
    q_out, k_out = run_poisoned(rotary_write_kv, *args, *scales, False, None, None, 0.0, 0.0, False, None, True)
    for ours, theirs in ((q_out, q_ref), (k_out, k_ref), (args[5], k_expected), (args[6], v_expected)):
        assert_same_bits(ours, theirs)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["no_norm", "llama"])
def test_rotary_write_kv_in_cuda_graph(norm):
    """Captured once, replayed over its inputs and over new ones written into them (other q/k/v,
    positions, slots and norm weights; ``replay_in_graph``): each replay rotates and writes as the
    reference does on the values it read, at that replay's slots only."""
    def op_args(seed):
        args, norm_args = make_inputs(torch.bfloat16, norm, None, 33, 32, 8, 128, 128, 8, 16, "cuda", seed=seed)
        args[-1][-3:] = -1  # padding rows of a captured batch
        return (*args, 1.0, 1.0, False, *norm_args.values())

    args = op_args(seed=0)
    tol = 0.0 if norm == "no_norm" else GPU_TOL[torch.bfloat16]

    def check(outputs, inputs):
        q_ref, k_ref = rotary_write_kv_reference(*inputs)  # writes the snapshot's caches
        k_expected, v_expected, slots = inputs[5:8]
        assert_close(outputs[0], q_ref, tol)
        assert_close(outputs[1], k_ref, tol)
        written = slots[slots >= 0]
        assert_close(args[5].view(-1, 8, 128)[written], k_expected.view(-1, 8, 128)[written], tol)
        assert torch.equal(poisoned(args[5]), poisoned(k_expected))
        torch.testing.assert_close(args[6], v_expected, rtol=0, atol=0, equal_nan=True)

    replay_in_graph(rotary_write_kv, args, op_args(seed=1), check)


@pytest.mark.gpu
def test_rotary_write_kv_fake_kernel_matches_cuda_kernel():
    # torch.compile traces with the fake kernel: it must give the CUDA kernel's shapes, dtypes and strides.
    args, norm_args = make_inputs(torch.bfloat16, "llama", None, 33, 32, 8, 128, 128, 8, 16, "cuda")
    torch.library.opcheck(torch.ops.zoo.rotary_write_kv, (*args, 1.0, 1.0, False, *norm_args.values()),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["pool", "fp8_pool"])
@pytest.mark.parametrize("n", [1, 37, 4097])
def test_latent_norm_rotary_and_write_deepseek_v3_gpu(n, fp8):
    # DeepSeek-V3's 128 heads, latent 512 and rope 64 over 16-slot blocks, with padding tokens.
    args, norm_args, pool = latent_inputs(torch.bfloat16, torch.float8_e4m3fn if fp8 else None, n, 128, 512, 64, 128,
                                          -(-2 * n // 16), 16, "cuda")
    args[-1][3::7] = -1
    scales = (0.5, 0.5) if fp8 else (1.0, 1.0)
    expected_pool = pool.clone()
    q_ref, k_ref = rotary_write_kv_reference(*args[:5], expected_pool[:, :, None, 512:],
                                             expected_pool[:, :, None, :512], args[7], *scales, True, **norm_args)
    q_out, k_out = run_poisoned(rotary_write_kv, *args, *scales, True, None, None, EPS, 0.0, False,
                                norm_args["v_norm_weight"])
    assert_same_bits(q_out, q_ref)  # rotary alone: bit for bit
    assert_same_bits(k_out, k_ref)
    assert torch.equal(poisoned(pool), poisoned(expected_pool))
    written = args[-1][args[-1] >= 0]
    ours, theirs = (p.view(-1, 576)[written].float() for p in (pool, expected_pool))
    assert torch.equal(ours[:, 512:], theirs[:, 512:])
    # The latent's norm sums its float32 squares in another order than torch: a unit of bf16 at
    # most, which can move an e4m3 entry by one of its units.
    tol = 2**-3 if fp8 else GPU_TOL[torch.bfloat16]
    torch.testing.assert_close(ours[:, :512], theirs[:, :512], rtol=tol, atol=tol * theirs.abs().max().item())


@pytest.mark.gpu
def test_latent_norm_rotary_and_write_in_cuda_graph_and_fake_kernel():
    """Captured once, replayed over its inputs and over new ones written into them (other q, latents,
    rope keys, positions, slots and v norm weight; ``replay_in_graph``): each replay matches the
    reference on the values it read, in the pool's two column ranges at that replay's slots only."""
    def op_args(seed):
        args, norm_args, pool = latent_inputs(torch.bfloat16, None, 4, 128, 512, 64, 128, 2, 16, "cuda", seed=seed)
        return (*args, 1.0, 1.0, True, None, None, EPS, 0.0, False, norm_args["v_norm_weight"]), pool

    args, pool = op_args(seed=0)

    def check(outputs, inputs):
        q_ref, k_ref = rotary_write_kv_reference(*inputs)  # writes the snapshot's column ranges
        assert_same_bits(outputs[0], q_ref)  # rotary alone: bit for bit
        assert_same_bits(outputs[1], k_ref)
        expected_pool = torch.cat((inputs[6], inputs[5]), dim=-1).view(pool.shape)  # latent, then rope key
        assert torch.equal(poisoned(pool), poisoned(expected_pool))
        written = inputs[7]
        assert_close(pool.view(-1, 576)[written], expected_pool.view(-1, 576)[written], GPU_TOL[torch.bfloat16])

    replay_in_graph(rotary_write_kv, args, op_args(seed=1)[0], check)
    torch.library.opcheck(torch.ops.zoo.rotary_write_kv, args, test_utils=("test_schema", "test_faketensor"))
