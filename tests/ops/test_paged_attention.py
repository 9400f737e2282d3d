"""The paged attention ops' Triton kernels against their PyTorch references, and the triton
attention backend against the torch one.

Without a GPU the launchers run on CPU tensors in Triton's interpreter (tiny shapes, float32 and
float16: the interpreter's bfloat16 tl.dot is wrong). On a GPU the ``gpu`` tests run the ops on
CUDA in every kernel dtype over model-sized shapes, inside a captured CUDA graph, and through the
runtime end to end.

Every case keeps the cache's unused slots NaN, so a kernel that reads past a sequence's length,
or into a padding row's table, poisons its output.
"""

import re
import types

import pytest
import torch

pytest.importorskip("triton")

from layers import (  # noqa: E402
    Attention,
    AttentionMetadata,
    ScoreModifiers,
    TorchAttentionBackend,
    TritonAttentionBackend,
    select_backend,
)
from ops_cuda import paged_attention_triton  # noqa: E402
from ops_cuda.kv_cache import dequantize, quantize, write_kv_cache_reference  # noqa: E402
from ops_cuda.kv_layout import is_key_minor, new_kv_cache  # noqa: E402
from ops_cuda.paged_attention import (  # noqa: E402
    attention_mask,
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_prefill_attention,
    paged_prefill_attention_reference,
    sdpa,
)
from ops_cuda.paged_attention_triton import (  # noqa: E402
    decode_num_splits,
    paged_decode_attention_triton,
    paged_prefill_attention_triton,
)
from ops_cuda.prompt_attention import prompt_attention, prompt_attention_reference, takes_flash  # noqa: E402
from tests.conftest import every_pair  # noqa: E402


# Largest difference allowed relative to the float32 reference's largest magnitude: float32 is
# exact math up to summation order; half types round p before the P @ V product and the output.
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def assert_close(ours: torch.Tensor, reference: torch.Tensor, tol: float):
    assert ours.shape == reference.shape and torch.isfinite(ours).all()
    error = (ours.float() - reference.float()).abs().max().item()
    assert error <= tol * reference.abs().max().item(), error


class PagedBatch:
    """Sequences with ``context_lens`` cached tokens and ``query_lens`` new ones, their keys and
    values (new tokens' included) in a cache of randomly permuted blocks, unused slots NaN. A
    sequence of length 0 is a padding row: its table points at never-written blocks. With
    ``fp8_scales`` (k_scale, v_scale) the cache is float8_e4m3fn, written with those scales, its V
    key-minor as the runtime allocates it (``new_kv_cache``)."""

    def __init__(self, context_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                 device="cpu", seed=0, fp8_scales=None):
        gen = torch.Generator().manual_seed(seed)

        def randn(*shape):
            return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        width = max(-(-n // block_size) for n in seq_lens) + 1  # wider than any sequence needs
        num_blocks = len(seq_lens) * width + 2
        self.block_tables = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * width]
        self.block_tables = self.block_tables.view(len(seq_lens), width).to(torch.int32).to(device)
        cache_dtype = dtype if fp8_scales is None else torch.float8_e4m3fn
        self.scales = (1.0, 1.0) if fp8_scales is None else fp8_scales
        self.k_cache, self.v_cache = new_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, device)
        self.k_cache.fill_(float("nan"))
        self.v_cache.fill_(float("nan"))
        ks, vs = [], []
        for i, n in enumerate(seq_lens):
            k, v = randn(n, num_kv_heads, head_dim), randn(n, num_kv_heads, head_dim)
            positions = torch.arange(n, device=device)
            slots = self.block_tables[i, positions // block_size].long() * block_size + positions % block_size
            write_kv_cache_reference(k, v, self.k_cache, self.v_cache, slots, *self.scales)
            ks.append(k[context_lens[i]:])
            vs.append(v[context_lens[i]:])
        self.k, self.v = torch.cat(ks), torch.cat(vs)  # the new tokens'
        self.q = randn(sum(query_lens), num_heads, head_dim)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        starts = torch.tensor([0] + query_lens).cumsum(0)
        self.query_start_loc = starts.to(torch.int32).to(device)
        self.query_lens, self.context_lens = query_lens, context_lens
        self.scale = head_dim**-0.5

    def decode_args(self, sliding_window):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                self.scale, sliding_window)

    def prefill_args(self, sliding_window):
        return (self.q, self.k, self.v, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, max(self.query_lens), self.scale, sliding_window)

    def reference_decode(self, sliding_window, softcap=0.0, sinks=None):  # in float32, from the same (rounded) inputs
        return paged_decode_attention_reference(*_float32(self.decode_args(sliding_window)), softcap, *self.scales,
                                                sinks)

    def reference_prefill(self, sliding_window, softcap=0.0, sinks=None):
        return paged_prefill_attention_reference(*_float32(self.prefill_args(sliding_window)), softcap, *self.scales,
                                                 sinks)


def _float32(args):  # an FP8 cache stays one: the reference reads it with its scales
    return [t.float() if torch.is_tensor(t) and t.is_floating_point() and t.element_size() > 1 else t for t in args]


def decode_batch(seq_lens, *shape, **kwargs):
    # A padding row (length 0) has no query token of its own in the cache: context 0, query 0,
    # but the op still gets a query row for it.
    batch = PagedBatch([max(n - 1, 0) for n in seq_lens], [min(n, 1) for n in seq_lens], *shape, **kwargs)
    gen = torch.Generator().manual_seed(1)
    batch.q = torch.randn(len(seq_lens), *batch.q.shape[1:], generator=gen).to(batch.q)
    return batch


def run_decode(batch, sliding_window, num_splits=None, softcap=0.0, sinks=None):
    out = torch.full_like(batch.q, float("nan"))
    paged_decode_attention_triton(*batch.decode_args(sliding_window), out, softcap=softcap, num_splits=num_splits,
                                  k_scale=batch.scales[0], v_scale=batch.scales[1], sinks=sinks)
    return out


def run_prefill(batch, sliding_window, softcap=0.0, sinks=None):
    q, _, _, *rest = batch.prefill_args(sliding_window)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention_triton(q, *rest, out, softcap=softcap, k_scale=batch.scales[0], v_scale=batch.scales[1],
                                   sinks=sinks)
    return out


def sink_logits(num_heads: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    # Logits about as large as the scores of q, k ~ N(0, 1) at head dim 16: each sink takes a share
    # of its head's mass from a few percent to most of it.
    return (torch.randn(num_heads, generator=torch.Generator().manual_seed(3)) * 2).to(dtype=dtype, device=device)


# --- CPU: the Triton kernels in the interpreter --------------------------------------------------

GEOMETRIES = {"d8-block4": (8, 4), "d12-block4": (12, 4), "d16-block4": (16, 4), "d32-block16": (32, 16)}


def allocate_as_nan(monkeypatch):
    """Float tensors from torch.empty hold NaN until the test ends: a decode kernel's partial
    outputs that no split wrote then poison any output that reads them."""
    empty = torch.empty

    def empty_as_nan(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty_as_nan)


@pytest.mark.interpreter
@pytest.mark.parametrize("sliding_window", [0, 5])
def test_decode_reduce_reads_only_the_splits_that_hold_keys(sliding_window, monkeypatch):
    # 8 splits of whole 16-key tiles over lengths that fill 3, 1, none (a padding row) and 1 of them:
    # the others write nothing.
    batch = decode_batch([2 * 16 + 3, 1, 0, 16], 4, 2, 16, 4, torch.float32)
    reference = batch.reference_decode(sliding_window)
    allocate_as_nan(monkeypatch)
    assert_close(run_decode(batch, sliding_window, num_splits=8), reference, TOL[torch.float32])


@pytest.mark.interpreter
@pytest.mark.parametrize(("geometry", "sliding_window", "dtype"),
                         every_pair(GEOMETRIES, (0, 5), (torch.float32, torch.float16)), ids=str)
def test_decode_kernel_interpreted(dtype, geometry, sliding_window):
    head_dim, block_size = GEOMETRIES[geometry]
    # Lengths: past a block boundary, one token, a padding row, exactly two blocks.
    batch = decode_batch([2 * block_size + 3, 1, 0, 2 * block_size], 4, 2, head_dim, block_size, dtype)
    reference = batch.reference_decode(sliding_window)
    assert reference[2].eq(0).all()
    for num_splits in (1, 3):  # 3 splits leave short sequences' later splits empty
        assert_close(run_decode(batch, sliding_window, num_splits), reference, TOL[dtype])


@pytest.mark.interpreter
@pytest.mark.parametrize(("geometry", "sliding_window", "dtype"),
                         every_pair(GEOMETRIES, (0, 5, 40), (torch.float32, torch.float16)), ids=str)
def test_prefill_kernel_interpreted(dtype, geometry, sliding_window):
    head_dim, block_size = GEOMETRIES[geometry]
    # A fresh prompt over two query tiles, a chunk after an unaligned context, a single query, and
    # a chunk long enough that under the 40-key window a query tile sees key tiles across the
    # window's start, whole and across the diagonal.
    batch = PagedBatch([0, 6, 21, 50], [19, 7, 1, 80], 4, 2, head_dim, block_size, dtype)
    assert_close(run_prefill(batch, sliding_window), batch.reference_prefill(sliding_window), TOL[dtype])


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("sliding_window", [0, 5])
def test_fp8_cache_kernels_interpreted(dtype, sliding_window):
    # An e4m3 cache with scales other than 1 (V key-minor): the kernels widen its entries and apply
    # the scales as the references do (the new tokens of a prefill read back from the cache too).
    # Lengths: two whole 16-key tiles and a partial one, a short one, a padding row, whole tiles only.
    decode = decode_batch([2 * 16 + 3, 1, 0, 32, 8], 4, 2, 16, 4, dtype, fp8_scales=(0.25, 3.0))
    assert is_key_minor(decode.v_cache) and not is_key_minor(decode.k_cache)
    assert decode.v_cache.view(torch.uint8).eq(0x7F).any()  # unused slots NaN
    reference = decode.reference_decode(sliding_window)
    for num_splits in (1, 3):
        assert_close(run_decode(decode, sliding_window, num_splits), reference, TOL[dtype])
    prefill = PagedBatch([0, 6, 21, 17], [19, 7, 1, 15], 4, 2, 16, 4, dtype, fp8_scales=(0.25, 3.0))
    assert_close(run_prefill(prefill, sliding_window), prefill.reference_prefill(sliding_window), TOL[dtype])


@pytest.mark.interpreter
@pytest.mark.parametrize("block_size", [4, 32], ids=["whole-blocks", "strided"])
@pytest.mark.parametrize("sliding_window", [0, 5])
def test_kernels_read_a_key_minor_v_cache_interpreted(block_size, sliding_window):
    # The FP8 runtime's V layout in float16, whose unused NaN slots the interpreter keeps NaN (it
    # widens e4m3's NaN to a finite value): the partial tile's whole-block loads must not leak them.
    # Blocks of 4 lie whole in the interpreter's 16-key tiles and load as blocks; blocks of 32 do not,
    # and V is read through its strides.
    decode = decode_batch([2 * 16 + 3, 1, 0, 32, 8], 4, 2, 16, block_size, torch.float16)
    reference = decode.reference_decode(sliding_window)
    decode.v_cache = _key_minor(decode.v_cache)
    assert decode.v_cache.isnan().any()
    for tile_rows in (paged_attention_triton._decode_tiles(decode.q)[0],
                      paged_attention_triton._prefill_tiles(decode.q)[1]):
        assert paged_attention_triton._v_blocks(decode.v_cache, tile_rows) == (block_size == 4)
    torch.testing.assert_close(decode.reference_decode(sliding_window), reference, rtol=0, atol=0)
    for num_splits in (1, 3):
        assert_close(run_decode(decode, sliding_window, num_splits), reference, TOL[torch.float16])
    prefill = PagedBatch([0, 6, 21, 17], [19, 7, 1, 15], 4, 2, 16, block_size, torch.float16)
    reference = prefill.reference_prefill(sliding_window)
    prefill.v_cache = _key_minor(prefill.v_cache)
    assert_close(run_prefill(prefill, sliding_window), reference, TOL[torch.float16])


@pytest.mark.interpreter
@pytest.mark.parametrize("cache", ["e4m3", "float16"])
@pytest.mark.parametrize("sliding_window", [0, 5])
def test_decode_keys_as_rows_interpreted(cache, sliding_window, monkeypatch):
    # The decode kernel's keys-as-rows form over a key-minor V: the runtime's e4m3 cache, and a
    # float16 one whose unused NaN slots the interpreter keeps NaN. Its V loads whole cache blocks:
    # the partial tile must not leak them.
    monkeypatch.setattr(paged_attention_triton, "_keys_as_rows", lambda *args: True)
    fp8_scales = (0.25, 3.0) if cache == "e4m3" else None
    decode = decode_batch([2 * 16 + 3, 1, 0, 32, 8], 4, 2, 16, 4, torch.float16, fp8_scales=fp8_scales)
    reference = decode.reference_decode(sliding_window)
    if fp8_scales is None:
        decode.v_cache = _key_minor(decode.v_cache)
        assert decode.v_cache.isnan().any()
    for num_splits in (1, 3):
        assert_close(run_decode(decode, sliding_window, num_splits), reference, TOL[torch.float16])


def test_kernels_reject_a_strided_cache_other_than_a_key_minor_v():
    batch = decode_batch([5, 9], 4, 2, 16, 4, torch.float32)
    dims_first = torch.zeros(batch.v_cache.shape[0], 16, 4, 2).permute(0, 2, 3, 1)  # unit stride on heads
    out = torch.empty_like(batch.q)
    for k_cache, v_cache, culprit in ((_key_minor(batch.k_cache), batch.v_cache, "k_cache"),
                                      (batch.k_cache, dims_first, "v_cache")):
        strides = re.escape(str((k_cache if culprit == "k_cache" else v_cache).stride()))
        args = (batch.q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.scale, 0, out)
        with pytest.raises(ValueError, match=rf"zoo::paged_decode_attention needs {culprit} .* got strides {strides}"):
            paged_decode_attention_triton(*args)
        with pytest.raises(ValueError, match=rf"zoo::paged_prefill_attention needs {culprit} .* strides {strides}"):
            paged_prefill_attention_triton(*args[:5], batch.query_start_loc, 1, *args[5:])


def _key_minor(cache):
    blocks, block_size, heads, head_dim = cache.shape
    rows = torch.empty(blocks, heads, head_dim, block_size, dtype=cache.dtype, device=cache.device)
    return rows.permute(0, 3, 1, 2).copy_(cache)


def test_fp8_cache_references_are_attention_over_the_rounded_cache():
    # With an e4m3 cache, both references are plain attention over its entries times the scales (a
    # prompt's new keys and values read back rounded too), within e4m3's rounding (2**-4 relative)
    # of attention over unrounded keys.
    exact = decode_batch([7, 3, 12], 4, 2, 16, 4, torch.float32)
    fp8 = decode_batch([7, 3, 12], 4, 2, 16, 4, torch.float32, fp8_scales=(0.5, 2.0))
    assert fp8.k_cache.dtype == torch.float8_e4m3fn
    dequantized = decode_batch([7, 3, 12], 4, 2, 16, 4, torch.float32)
    dequantized.k_cache = fp8.k_cache.float() * 0.5
    dequantized.v_cache = fp8.v_cache.float() * 2.0
    torch.testing.assert_close(fp8.reference_decode(0), dequantized.reference_decode(0), rtol=0, atol=1e-6)
    torch.testing.assert_close(fp8.reference_decode(0), exact.reference_decode(0), rtol=0.1, atol=0.1)
    exact = PagedBatch([5, 0], [3, 6], 4, 2, 16, 4, torch.float32)
    fp8 = PagedBatch([5, 0], [3, 6], 4, 2, 16, 4, torch.float32, fp8_scales=(0.5, 2.0))
    dequantized = PagedBatch([5, 0], [3, 6], 4, 2, 16, 4, torch.float32)
    dequantized.k_cache = fp8.k_cache.float() * 0.5
    dequantized.v_cache = fp8.v_cache.float() * 2.0
    dequantized.k = dequantize(quantize(fp8.k, 0.5, torch.float8_e4m3fn), 0.5, torch.float32)
    dequantized.v = dequantize(quantize(fp8.v, 2.0, torch.float8_e4m3fn), 2.0, torch.float32)
    torch.testing.assert_close(fp8.reference_prefill(0), dequantized.reference_prefill(0), rtol=0, atol=1e-6)
    torch.testing.assert_close(fp8.reference_prefill(0), exact.reference_prefill(0), rtol=0.1, atol=0.1)


@pytest.mark.interpreter
@pytest.mark.parametrize("head_dim", [8, 12, 16])
def test_heads_narrower_than_a_dot_tile_are_padded(head_dim, monkeypatch):
    """On a GPU tl.dot takes operands of at least 16 along each dimension (the interpreter does not
    check): every kernel's head-dim block is at least 16, and the padded dims change nothing."""
    import ops_cuda.paged_attention_triton as kernels

    blocks = []
    for name in ("_decode_split_kernel", "_prefill_kernel"):
        kernel = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, _Recording(kernel, blocks))
    batch = decode_batch([9, 1, 0, 8], 4, 2, head_dim, 4, torch.float32)
    assert_close(run_decode(batch, 0, 2), batch.reference_decode(0), TOL[torch.float32])
    batch = PagedBatch([0, 6, 21], [19, 7, 1], 4, 2, head_dim, 4, torch.float32)
    assert_close(run_prefill(batch, 0), batch.reference_prefill(0), TOL[torch.float32])
    assert blocks == [16, 16]


class _Recording:
    """A Triton kernel that records the BLOCK_D of each launch."""

    def __init__(self, kernel, blocks):
        self.kernel, self.blocks = kernel, blocks

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.blocks.append(kwargs["BLOCK_D"])
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_softcapped_kernels_interpreted(dtype):
    # Scores of q, k ~ N(0, 1) at head_dim 16 reach several units: a cap of 2 bends most of them.
    softcap = 2.0
    batch = decode_batch([2 * 4 + 3, 1, 0, 8], 4, 2, 16, 4, dtype)
    reference = batch.reference_decode(5, softcap)
    assert (reference - batch.reference_decode(5)).abs().max() > 0.1
    for num_splits in (1, 3):
        assert_close(run_decode(batch, 5, num_splits, softcap), reference, TOL[dtype])
    batch = PagedBatch([0, 6, 21], [19, 7, 1], 4, 2, 16, 4, dtype)
    reference = batch.reference_prefill(5, softcap)
    assert (reference - batch.reference_prefill(5)).abs().max() > 0.1
    assert_close(run_prefill(batch, 5, softcap), reference, TOL[dtype])


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_kernels_with_sinks_interpreted(dtype):
    # Sinks join the mass in the one-split output, in the reduce of several splits, and in prefill;
    # a padding row (length 0) still gives zeros.
    sinks = sink_logits(4, dtype)
    batch = decode_batch([2 * 4 + 3, 1, 0, 8], 4, 2, 16, 4, dtype)
    reference = batch.reference_decode(5, sinks=sinks.float())
    assert (reference - batch.reference_decode(5)).abs().max() > 0.1
    assert reference[2].eq(0).all()
    for num_splits in (1, 3):
        assert_close(run_decode(batch, 5, num_splits, sinks=sinks), reference, TOL[dtype])
    batch = PagedBatch([0, 6, 21], [19, 7, 1], 4, 2, 16, 4, dtype)
    reference = batch.reference_prefill(5, sinks=sinks.float())
    assert (reference - batch.reference_prefill(5)).abs().max() > 0.1
    assert_close(run_prefill(batch, 5, sinks=sinks), reference, TOL[dtype])


@pytest.mark.parametrize("sliding_window", [0, 5])
def test_sink_references_are_hf_eager_attention(sliding_window):
    """Every reference path (cache-free, paged prefill, paged decode) weighs the sinks as GPT-OSS's
    eager attention in HF does: one sequence's prefill and its last token's decode."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    batch = PagedBatch([0], [13], 4, 2, 16, 4, torch.float32)
    sinks = sink_logits(4)
    module = types.SimpleNamespace(num_key_value_groups=2, training=False, sinks=sinks)
    mask = attention_mask(torch.arange(13), 13, sliding_window)
    expected, _ = eager_attention_forward(
        module, batch.q.transpose(0, 1)[None], batch.k.transpose(0, 1)[None], batch.v.transpose(0, 1)[None],
        torch.zeros(13, 13).masked_fill(~mask, float("-inf")), scaling=batch.scale,
    )
    expected = expected[0]  # [13, Hq, D]
    torch.testing.assert_close(batch.reference_prefill(sliding_window, sinks=sinks), expected, rtol=1e-5, atol=1e-6)
    cache_free = prompt_attention(batch.q, batch.k, batch.v, batch.query_start_loc, 13, batch.scale, sliding_window,
                                  0.0, sinks)
    torch.testing.assert_close(cache_free, expected, rtol=1e-5, atol=1e-6)
    decode = paged_decode_attention_reference(batch.q[-1:], batch.k_cache, batch.v_cache, batch.block_tables,
                                              batch.seq_lens, batch.scale, sliding_window, sinks=sinks)
    torch.testing.assert_close(decode, expected[-1:], rtol=1e-5, atol=1e-6)


def test_softcapped_references_are_hf_eager_attention():
    """Every reference path (cache-free SDPA, paged prefill, paged decode) soft-caps as HF's eager
    attention does: one sequence's prefill and its last token's decode against HF's function."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    batch = PagedBatch([0], [13], 4, 2, 16, 4, torch.float32)
    module = types.SimpleNamespace(num_key_value_groups=2, training=False)
    causal = torch.full((13, 13), float("-inf")).triu(1)
    expected, _ = eager_attention_forward(
        module, batch.q.transpose(0, 1)[None], batch.k.transpose(0, 1)[None], batch.v.transpose(0, 1)[None],
        causal, scaling=batch.scale, softcap=2.0,
    )
    expected = expected[0]  # [13, Hq, D]
    torch.testing.assert_close(batch.reference_prefill(0, 2.0), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sdpa(batch.q[None], batch.k[None], batch.v[None], None, batch.scale, 2.0)[0], expected,
                               rtol=1e-5, atol=1e-6)
    decode = paged_decode_attention_reference(batch.q[-1:], batch.k_cache, batch.v_cache, batch.block_tables,
                                              batch.seq_lens, batch.scale, 0, 2.0)
    torch.testing.assert_close(decode, expected[-1:], rtol=1e-5, atol=1e-6)


def test_decode_reference_is_plain_attention():
    # The reference against attention written out by hand, one sequence at a time.
    batch = decode_batch([7, 1, 0, 12], 4, 2, 16, 4, torch.float32)
    out = paged_decode_attention_reference(*batch.decode_args(4))
    for i, n in enumerate(batch.seq_lens.tolist()):
        if n == 0:
            assert out[i].eq(0).all()
            continue
        slots = batch.block_tables[i, torch.arange(n) // 4].long() * 4 + torch.arange(n) % 4
        keys = batch.k_cache.flatten(0, 1)[slots].repeat_interleave(2, dim=1)[-4:]  # window 4, GQA
        values = batch.v_cache.flatten(0, 1)[slots].repeat_interleave(2, dim=1)[-4:]
        weights = torch.einsum("hd,thd->ht", batch.q[i], keys).mul(batch.scale).softmax(-1)
        torch.testing.assert_close(out[i], torch.einsum("ht,thd->hd", weights, values))


def test_ops_default_to_the_references_and_pass_opcheck():
    args = PagedBatch([0, 6], [5, 3], 4, 2, 16, 4, torch.float32).prefill_args(3)
    assert torch.equal(torch.ops.zoo.paged_prefill_attention(*args), paged_prefill_attention_reference(*args))
    assert torch.equal(paged_prefill_attention(*args), paged_prefill_attention_reference(*args))
    torch.library.opcheck(torch.ops.zoo.paged_prefill_attention.default, args)
    args = decode_batch([5, 0, 9], 4, 2, 16, 4, torch.float32).decode_args(0)
    assert torch.equal(torch.ops.zoo.paged_decode_attention(*args), paged_decode_attention_reference(*args))
    assert torch.equal(paged_decode_attention(*args), paged_decode_attention_reference(*args))
    torch.library.opcheck(torch.ops.zoo.paged_decode_attention.default, args)
    batch = PagedBatch([0, 0], [5, 3], 4, 2, 16, 4, torch.float32)
    args = (batch.q, batch.k, batch.v, batch.query_start_loc, 5, batch.scale, 3)
    assert torch.equal(torch.ops.zoo.prompt_attention(*args), prompt_attention_reference(*args))
    assert torch.equal(prompt_attention(*args), prompt_attention_reference(*args))
    torch.library.opcheck(torch.ops.zoo.prompt_attention.default, args)
    # The sinks, an optional tensor at the end of each op's schema.
    sinks = sink_logits(4)
    torch.library.opcheck(torch.ops.zoo.prompt_attention.default, (*args, 0.0, sinks))
    args = decode_batch([5, 0, 9], 4, 2, 16, 4, torch.float32).decode_args(0)
    torch.library.opcheck(torch.ops.zoo.paged_decode_attention.default, (*args, 0.0, 1.0, 1.0, sinks))


@pytest.mark.parametrize("sliding_window, softcap, sinks", [(0, 0.0, False), (5, 0.0, False), (0, 2.0, False),
                                                            (5, 0.0, True)])
@pytest.mark.parametrize("query_lens", [[13, 1, 6], [6, 6]], ids=["ragged", "equal"])
def test_prompt_attention_is_the_paged_prefill_of_new_prompts(query_lens, sliding_window, softcap, sinks):
    # Prompts with nothing cached: attention over their own k/v equals the paged reference over the cache.
    batch = PagedBatch([0] * len(query_lens), query_lens, 4, 2, 16, 4, torch.float32)
    sinks = sink_logits(4) if sinks else None
    out = prompt_attention(batch.q, batch.k, batch.v, batch.query_start_loc, max(query_lens), batch.scale,
                           sliding_window, softcap, sinks)
    torch.testing.assert_close(out, batch.reference_prefill(sliding_window, softcap, sinks), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale", [2.0, 1.37])
def test_prefill_reference_reads_new_tokens_back_from_a_cache_that_rounds_them(scale):
    # A bf16 cache holding k/scale and v/scale: the new tokens attend their entries read back, as
    # the kernel reads them. Divided by a power of two they come back exact; by 1.37, rounded.
    batch = PagedBatch([0, 5], [7, 3], 4, 2, 16, 4, torch.bfloat16)
    args = list(batch.prefill_args(0))
    given = paged_prefill_attention_reference(*args)
    args[3], args[4] = quantize(batch.k_cache, scale, torch.bfloat16), quantize(batch.v_cache, scale, torch.bfloat16)
    scaled = paged_prefill_attention_reference(*args, 0.0, scale, scale)
    args[1], args[2] = (dequantize(quantize(x, scale, torch.bfloat16), scale, torch.bfloat16) for x in args[1:3])
    args[3], args[4] = (dequantize(cache, scale, torch.bfloat16) for cache in args[3:5])
    read_back = paged_prefill_attention_reference(*args)
    assert torch.equal(scaled, read_back)
    assert torch.equal(scaled, given) == (scale == 2.0)


def test_num_splits_fill_the_last_wave(monkeypatch):
    # The H200's (132 SMs) fastest counts in the split sweep of docs/performance.md.
    monkeypatch.setattr(paged_attention_triton, "_num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    # GQA on the 8B shape: 8 KV heads a sequence, 64-key tiles, three programs an SM.
    gqa = dict(key_bytes=2 * 128 * 2, partial_bytes=4 * 129 * 4, block_n=64, resident=3)
    assert decode_num_splits(8, 1024, cuda, **gqa) == 16  # one sequence: a key tile a split
    assert decode_num_splits(8, 512, cuda, **gqa) == 8
    assert decode_num_splits(16 * 8, 4096, cuda, **gqa) == 3  # 384 programs of 396
    assert decode_num_splits(32 * 8, 4096, cuda, **gqa) == 3  # not 1 (256) nor 2 (512: a second wave, 30% full)
    assert decode_num_splits(64 * 8, 4096, cuda, **gqa) == 3
    # A wide table (131,072 tokens) with gains under SPLIT_COST_SLACK: 3, not 34 splits of ~3,900 keys.
    assert decode_num_splits(16 * 8, 131072, cuda, **gqa) == 3
    assert decode_num_splits(450 * 8, 2048, cuda, **gqa) == 1  # the 8B throughput run's batch
    # Over an FP8 cache the two-warp kernel: four programs an SM.
    fp8 = dict(gqa, resident=4)
    assert [decode_num_splits(b * 8, 4096, cuda, **fp8) for b in (4, 8, 16, 32, 64)] == [16, 8, 4, 2, 1]
    # MLA on DeepSeek-V3's heads: two 64-head tiles a sequence, one program an SM, 256 KiB partials.
    mla = dict(key_bytes=576 * 2, partial_bytes=64 * 513 * 4, block_n=64, resident=1)
    assert decode_num_splits(2, 4096, cuda, **mla) == 32  # 64 without the partials' traffic
    assert decode_num_splits(16 * 2, 4096, cuda, **mla) == 4  # 128 programs; 5 splits would make 160
    assert decode_num_splits(48 * 2, 4096, cuda, **mla) == 4  # 384 programs in 3 waves against 96 in one
    assert decode_num_splits(64 * 2, 4096, cuda, **mla) == 1
    assert decode_num_splits(96 * 2, 4096, cuda, **mla) == 2


def test_select_backend():
    assert isinstance(select_backend(None, "cpu"), TorchAttentionBackend)
    assert select_backend(None, "cpu").name == "torch"
    assert isinstance(select_backend("triton", "cpu"), TritonAttentionBackend)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        select_backend("flash", "cpu")


def mixed_step(dtype, device="cpu", sliding_window=None, softcap=0.0, fp8_scales=None, context_lens=(0, 5, 6, 9),
               sinks=None):
    """A layer stub with a cache, and a flat step of two prefills (by default one after cached
    context) then two decodes. The cache holds the new tokens' keys and values too: the layer writes
    them (zoo::rotary_write_kv) before its backend attends."""
    batch = PagedBatch(list(context_lens), [6, 4, 1, 1], 4, 2, 16, 4, dtype, device, fp8_scales=fp8_scales)
    new = torch.cat([torch.arange(c, c + q) for c, q in zip(batch.context_lens, batch.query_lens)])
    seq = torch.repeat_interleave(torch.arange(4), torch.tensor(batch.query_lens))
    slots = batch.block_tables.cpu()[seq, new // 4].long() * 4 + new % 4
    layer = types.SimpleNamespace(
        kv_cache=(batch.k_cache, batch.v_cache), scale=batch.scale, sliding_window=sliding_window,
        score_modifiers=ScoreModifiers(softcap=softcap, sinks=sinks is not None), k_scale=batch.scales[0],
        v_scale=batch.scales[1], sinks=sinks,
    )
    metadata = AttentionMetadata(
        query_lens=batch.query_lens, context_lens=batch.context_lens, slot_mapping=slots.to(device),
        block_tables=batch.block_tables, num_decodes=2, seq_lens=batch.seq_lens, query_start_loc=batch.query_start_loc,
    )
    return layer, batch, metadata


@pytest.mark.parametrize("backend", [TorchAttentionBackend, TritonAttentionBackend])
@pytest.mark.parametrize("step", ["new prompts", "cached context", "fp8 cache"])
def test_only_new_prompts_over_an_exact_cache_skip_reading_it(backend, step, monkeypatch):
    # New prompts over a cache of q's dtype attend their own k/v (prompt_attention); after cached
    # context, or over an FP8 cache, which rounds them, they read the cache (the paged prefill op).
    # Either way the step's rows are the paged reference's.
    import layers.attention

    calls = []

    def counted(*args):
        calls.append(args)
        return prompt_attention(*args)

    monkeypatch.setattr(layers.attention, "prompt_attention", counted)
    fp8_scales = (0.5, 2.0) if step == "fp8 cache" else None
    context_lens = (5, 0, 6, 9) if step == "cached context" else (0, 0, 6, 9)
    layer, batch, metadata = mixed_step(torch.float32, sliding_window=4, fp8_scales=fp8_scales,
                                        context_lens=context_lens)
    out = backend().forward(layer, batch.q, batch.k, batch.v, metadata)
    assert len(calls) == (step == "new prompts")
    torch.testing.assert_close(out, batch.reference_prefill(4), rtol=1e-5, atol=1e-6)


def decode_via_launcher(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, softcap, k_scale,
                        v_scale, sinks):
    out = torch.empty_like(q)
    paged_decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, out,
                                  softcap=softcap, k_scale=k_scale, v_scale=v_scale, sinks=sinks)
    return out


def prefill_via_launcher(q, k, v, *args):
    *args, softcap, k_scale, v_scale, sinks = args
    out = torch.empty_like(q)
    paged_prefill_attention_triton(q, *args, out, softcap=softcap, k_scale=k_scale, v_scale=v_scale, sinks=sinks)
    return out


@pytest.mark.interpreter
@pytest.mark.parametrize("softcap, sinks", [(0.0, False), (2.0, False), (0.0, True)], ids=["", "softcap", "sinks"])
@pytest.mark.parametrize("fp8_scales", [None, (0.5, 2.0)], ids=["", "fp8"])
def test_triton_backend_splits_a_mixed_step(softcap, sinks, fp8_scales, monkeypatch):
    # The backend's slicing of the stream and metadata, with the interpreted kernels behind the ops.
    monkeypatch.setattr(TritonAttentionBackend, "decode", staticmethod(decode_via_launcher))
    monkeypatch.setattr(TritonAttentionBackend, "prefill", staticmethod(prefill_via_launcher))
    outs = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        layer, batch, metadata = mixed_step(torch.float32, sliding_window=4, softcap=softcap, fp8_scales=fp8_scales,
                                            sinks=sink_logits(4) if sinks else None)
        outs.append(backend.forward(layer, batch.q, batch.k, batch.v, metadata))
    assert_close(outs[1], outs[0], TOL[torch.float32])


# --- GPU -------------------------------------------------------------------------------------------

SHAPES = {"32q-8kv-d128": (32, 8, 128), "9q-3kv-d64": (9, 3, 64), "16q-16kv-d128": (16, 16, 128)}
GPU_DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("sliding_window", [0, 1000])
def test_decode_kernel_cuda(dtype, shape, sliding_window):
    batch = decode_batch([1, 16, 0, 777, 3001, 2053], *SHAPES[shape], 16, dtype, "cuda")
    reference = batch.reference_decode(sliding_window)
    for num_splits in (None, 1, 7):
        assert_close(run_decode(batch, sliding_window, num_splits), reference, TOL[dtype])
    assert_close(paged_decode_attention(*batch.decode_args(sliding_window)), reference, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_cache_kernels_cuda(dtype, shape):
    # An e4m3 cache with scales: both kernels against the float32 references over the same cache.
    batch = decode_batch([1, 16, 0, 777, 3001, 2053], *SHAPES[shape], 16, dtype, "cuda", fp8_scales=(0.25, 3.0))
    reference = batch.reference_decode(1000)
    for num_splits in (None, 1, 7):
        assert_close(run_decode(batch, 1000, num_splits), reference, TOL[dtype])
    assert_close(paged_decode_attention(*batch.decode_args(1000), 0.0, 0.25, 3.0), reference, TOL[dtype])
    batch = PagedBatch([0, 517, 2000, 33], [1000, 300, 1, 129], *SHAPES[shape], 16, dtype, "cuda",
                       fp8_scales=(0.25, 3.0))
    assert paged_attention_triton._v_blocks(batch.v_cache, paged_attention_triton._prefill_tiles(batch.q)[1])
    reference = batch.reference_prefill(0)
    assert_close(run_prefill(batch, 0), reference, TOL[dtype])
    assert_close(paged_prefill_attention(*batch.prefill_args(0), 0.0, 0.25, 3.0), reference, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(32, 8, 128), (9, 3, 64), (4, 2, 16)], ids=["d128", "d64", "d16"])
@pytest.mark.parametrize("softcap", [0.0, 50.0])
@pytest.mark.parametrize("sliding_window", [0, 1000])
def test_fp8_decode_keys_as_rows_cuda(shape, softcap, sliding_window, monkeypatch):
    # The runtime's FP8 cache under a bf16 q: the keys are the products' rows and the entries widen
    # to float16. The bf16 output stays within two bf16 rounding units of the largest output from
    # the float32 reference over the same cache, as the heads-as-rows form's does.
    batch = decode_batch([1, 16, 0, 777, 3001, 2053, 128, 129], *shape, 16, torch.bfloat16, "cuda",
                         fp8_scales=(0.25, 3.0))
    batch.scale = 1.0 if softcap else batch.scale
    reference = batch.reference_decode(sliding_window, softcap)
    assert paged_attention_triton._keys_as_rows(batch.q, batch.k_cache, batch.v_cache)
    for num_splits in (None, 1, 7):
        assert_close(run_decode(batch, sliding_window, num_splits, softcap), reference, 2**-7)
    monkeypatch.setattr(paged_attention_triton, "_keys_as_rows", lambda *args: False)
    assert_close(run_decode(batch, sliding_window, None, softcap), reference, 2**-7)


@pytest.mark.gpu
def test_fp8_decode_over_blocks_longer_than_a_key_tile_cuda():
    # Cache blocks of 128 keys do not lie whole in the decode kernel's 64-key tiles at D=128: it
    # puts the heads on its products' rows and reads the key-minor V through its strides.
    batch = decode_batch([1, 16, 0, 777, 3001, 2053, 128, 129], 32, 8, 128, 128, torch.bfloat16, "cuda",
                         fp8_scales=(0.25, 3.0))
    assert paged_attention_triton._decode_tiles(batch.q)[0] == 64
    assert not paged_attention_triton._keys_as_rows(batch.q, batch.k_cache, batch.v_cache)
    reference = batch.reference_decode(1000)
    for num_splits in (None, 1, 7):
        out = run_decode(batch, 1000, num_splits)
        for row in range(len(out)):  # each against its own largest output: one key's row is 20x a long row's
            assert_close(out[row], reference[row], TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_softcapped_kernels_cuda(dtype):
    # Gemma 2's cap on scores scaled to reach it (scale 1 instead of head_dim**-0.5).
    batch = decode_batch([1, 16, 0, 777, 3001], 16, 8, 128, 16, dtype, "cuda")
    batch.scale = 1.0
    reference = batch.reference_decode(1000, 50.0)
    for num_splits in (None, 1, 7):
        assert_close(run_decode(batch, 1000, num_splits, 50.0), reference, TOL[dtype])
    assert_close(paged_decode_attention(*batch.decode_args(1000), 50.0), reference, TOL[dtype])
    batch = PagedBatch([0, 517, 33], [1000, 300, 129], 16, 8, 128, 16, dtype, "cuda")
    batch.scale = 1.0
    reference = batch.reference_prefill(0, 50.0)
    assert_close(run_prefill(batch, 0, 50.0), reference, TOL[dtype])
    assert_close(paged_prefill_attention(*batch.prefill_args(0), 50.0), reference, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("fp8_scales", [None, (0.25, 3.0)], ids=["", "fp8"])
def test_kernels_with_sinks_cuda(dtype, fp8_scales):
    # GPT-OSS's shape (64 heads over 8 KV heads of 64 dims), its 128-token window and none: decode
    # in one split and several (sinks in the reduce), over a bf16 or an e4m3 cache (keys as rows),
    # prefill, and new prompts through flash attention (scaled by its log-sum-exp).
    if fp8_scales and dtype == torch.float32:
        pytest.skip("the FP8 cache serves 16-bit models")
    shape = (64, 8, 64)
    sinks = sink_logits(64, dtype, "cuda")
    batch = decode_batch([1, 16, 0, 777, 3001, 2053], *shape, 16, dtype, "cuda", fp8_scales=fp8_scales)
    for window in (0, 128):
        reference = batch.reference_decode(window, sinks=sinks.float())
        for num_splits in (None, 1, 7):
            assert_close(run_decode(batch, window, num_splits, sinks=sinks), reference, TOL[dtype])
        assert_close(paged_decode_attention(*batch.decode_args(window), 0.0, *batch.scales, sinks), reference,
                     TOL[dtype])
    batch = PagedBatch([0, 517, 2000, 33], [1000, 300, 1, 129], *shape, 16, dtype, "cuda", fp8_scales=fp8_scales)
    for window in (0, 128):
        reference = batch.reference_prefill(window, sinks=sinks.float())
        assert_close(run_prefill(batch, window, sinks=sinks), reference, TOL[dtype])
    if fp8_scales:
        return
    batch = PagedBatch([0] * 3, [1000, 300, 129], *shape, 16, dtype, "cuda")
    assert takes_flash(batch.q, 0.0) == (dtype != torch.float32)
    for window in (0, 128):
        out = prompt_attention(batch.q, batch.k, batch.v, batch.query_start_loc, 1000, batch.scale, window, 0.0, sinks)
        assert_close(out, batch.reference_prefill(window, sinks=sinks.float()), TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("sliding_window", [0, 1000])
def test_prefill_kernel_cuda(dtype, shape, sliding_window):
    # A long fresh prompt, a chunk after unaligned context, one query after long context, odd tails.
    batch = PagedBatch([0, 517, 2000, 33], [1000, 300, 1, 129], *SHAPES[shape], 16, dtype, "cuda")
    reference = batch.reference_prefill(sliding_window)
    assert_close(run_prefill(batch, sliding_window), reference, TOL[dtype])
    assert_close(paged_prefill_attention(*batch.prefill_args(sliding_window)), reference, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("sliding_window", [0, 1000])
@pytest.mark.parametrize("query_lens", [[1000, 300, 1, 129], [1100] * 3], ids=["ragged", "one-length"])
def test_prompt_attention_cuda(dtype, shape, sliding_window, query_lens):
    # New prompts, their q/k/v views of one fused projection's output as the layer hands them over:
    # flash attention in the 16-bit dtypes, ragged or of one length, and the reference in float32.
    num_heads, num_kv_heads, head_dim = SHAPES[shape]
    batch = PagedBatch([0] * len(query_lens), query_lens, num_heads, num_kv_heads, head_dim, 16, dtype, "cuda")
    fused = torch.cat([t.flatten(1) for t in (batch.q, batch.k, batch.v)], dim=1)
    q, k, v = fused.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    q, k, v = q.view(batch.q.shape), k.view(batch.k.shape), v.view(batch.v.shape)
    assert takes_flash(q, 0.0) == (dtype != torch.float32)
    out = prompt_attention(q, k, v, batch.query_start_loc, max(query_lens), batch.scale, sliding_window)
    assert_close(out, batch.reference_prefill(sliding_window), TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_scales", [None, (0.25, 3.0)], ids=["", "fp8"])
def test_decode_kernels_compile_once_for_any_metadata_offset_and_split_count(fp8_scales):
    # A mixed step's decodes read the lengths and block tables from the row after its prefills, and
    # their count sets the split count: rows 1..4 of these (4-byte and odd-width offsets) and 5 to 7
    # splits run the split kernel compiled for rows 0..3, and the reduce compiled for 5 splits (a
    # tile of 8) serves 6 and 7.
    batch = decode_batch([1500, 700, 31, 1025, 2000], *SHAPES["32q-8kv-d128"], 16, torch.bfloat16, "cuda",
                         fp8_scales=fp8_scales)
    assert batch.block_tables.shape[1] % 4 != 0
    q, k_cache, v_cache, block_tables, seq_lens, scale, window = batch.decode_args(0)
    expected = batch.reference_decode(0)

    def decode(rows, num_splits=None):
        out = torch.full_like(q[rows], float("nan"))
        paged_decode_attention_triton(q[rows], k_cache, v_cache, block_tables[rows], seq_lens[rows], scale, window,
                                      out, num_splits=num_splits, k_scale=batch.scales[0], v_scale=batch.scales[1])
        assert_close(out, expected[rows], 2**-7)

    def compiled(kernel):
        return len(kernel.device_caches[q.device.index][0])

    decode(slice(0, 4))
    split_variants = compiled(paged_attention_triton._decode_split_kernel)
    decode(slice(1, 5))
    decode(slice(0, 4), num_splits=5)
    reduce_variants = compiled(paged_attention_triton._decode_reduce_kernel)
    for num_splits in (6, 7):
        decode(slice(1, 5), num_splits)
    assert compiled(paged_attention_triton._decode_split_kernel) == split_variants
    assert compiled(paged_attention_triton._decode_reduce_kernel) == reduce_variants


def write_decode_tokens(batch):
    """New keys and values at each sequence's last position (seq_len - 1) through its block table,
    as a decode step writes its tokens before attending (with the cache's scales); padding rows
    (length 0) get slot -1 and write nothing."""
    block_size = batch.k_cache.shape[1]
    positions = (batch.seq_lens.long() - 1).clamp(min=0)
    rows = torch.arange(len(positions), device=positions.device)
    slots = batch.block_tables[rows, positions // block_size].long() * block_size + positions % block_size
    slots = torch.where(batch.seq_lens > 0, slots, -1)
    k = torch.randn(len(rows), *batch.k_cache.shape[2:], device=slots.device).to(batch.q.dtype)
    v = torch.randn_like(k)
    write_kv_cache_reference(k, v, batch.k_cache, batch.v_cache, slots, *batch.scales)


def assert_replays_follow(op, args, rewrite, reference):
    """``op(*args)`` captured in a CUDA graph, replayed twice over the captured inputs, then twice
    after ``rewrite()`` writes new values into the same buffers: each replay must equal the eager
    op's output on the values it read and lie close to ``reference()``, and the two sets' outputs
    must differ, so that a graph that kept its captured values fails."""
    op(*args)  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(*args)
    outputs = []
    for step in range(2):
        if step:
            rewrite()
        expected = op(*args)
        for _ in range(2):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, expected), f"step {step}"
        assert_close(out, reference(), TOL[torch.bfloat16])
        outputs.append(out.clone())
    assert not torch.equal(outputs[0], outputs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_scales", [None, (0.25, 3.0)], ids=["", "fp8"])
def test_decode_op_replays_in_cuda_graph(fp8_scales):
    """Captured once, replayed over the captured inputs, then over new values written into the same
    buffers as a decode step writes them (lengths, rotated block tables, queries, the new tokens'
    keys and values in the cache): each replay is the eager op's output on the values it read,
    close to the reference, and a graph that kept its captured values fails the second."""
    batch = decode_batch([1500] * 4, *SHAPES["32q-8kv-d128"], 16, torch.bfloat16, "cuda", fp8_scales=fp8_scales)
    batch.seq_lens.copy_(torch.tensor([5, 300, 0, 1025]))

    def rewrite():
        batch.seq_lens.copy_(torch.tensor([700, 1, 64, 0]))
        batch.block_tables.copy_(batch.block_tables.roll(1, 0))
        batch.q.copy_(torch.randn_like(batch.q))
        write_decode_tokens(batch)

    assert_replays_follow(paged_decode_attention, (*batch.decode_args(0), 0.0, *batch.scales), rewrite,
                          lambda: batch.reference_decode(0))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("fp8_scales", [None, (0.5, 2.0)], ids=["", "fp8"])
def test_triton_backend_matches_torch_backend_cuda(dtype, softcap, fp8_scales):
    outs = []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        layer, batch, metadata = mixed_step(dtype, "cuda", sliding_window=4, softcap=softcap, fp8_scales=fp8_scales)
        outs.append(backend.forward(layer, batch.q, batch.k, batch.v, metadata))
    assert_close(outs[1], outs[0], TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama", "mistral-window", "gemma2"])
def test_runtime_tokens_equal_across_backends(name, tmp_path):
    from runtime import LLM
    from tests.conftest import hf_model, save_checkpoint, tiny_config
    from tests.models.test_parity import VARIANTS
    from tests.runtime.test_runtime import GREEDY, prompts

    config = {"llama": tiny_config("llama"), "mistral-window": tiny_config("mistral", sliding_window=6),
              "gemma2": VARIANTS["gemma2"]}[name]
    path = save_checkpoint(hf_model(config), tmp_path)
    batch = prompts(8, seed=4)
    tokens = {}
    for backend in ("torch", "triton"):
        # Small batches of tokens: prompts are prefilled in chunks after cached context.
        llm = LLM(str(path), device="cuda", num_blocks=256, max_num_batched_tokens=24, enforce_eager=True,
                  attention_backend=backend)
        assert all(m.backend.name == backend for m in llm.model.modules() if isinstance(m, Attention))
        outputs = llm.generate(batch, GREEDY, use_tqdm=False)
        assert all(o.error is None for o in outputs)
        tokens[backend] = [o.token_ids for o in outputs]
    assert tokens["triton"] == tokens["torch"]
