"""The latent attention ops' Triton kernels against their PyTorch references, the latent cache
write, and the triton attention backend's latent path against the torch backend's.

Without a GPU the launchers run on CPU tensors in Triton's interpreter (tiny ranks, 1-5 heads,
float32 and float16). On a GPU the ``gpu`` tests run the ops on CUDA at DeepSeek-V3's shapes
(128 heads, kv_lora_rank 512, rope 64, nope 128, v 128) and inside a captured CUDA graph.
Unused cache slots are NaN, so a kernel that reads past a sequence's length poisons its output.
"""

import types

import pytest
import torch

pytest.importorskip("triton")

from layers import AttentionMetadata, MLAttention, TorchAttentionBackend, TritonAttentionBackend  # noqa: E402
from ops_cuda.kv_cache import dequantize, quantize, write_kv_cache_reference  # noqa: E402
from ops_cuda.mla_attention import (  # noqa: E402
    gather_latents,
    mla_decode_attention,
    mla_decode_attention_op,
    mla_decode_attention_reference,
    mla_prefill_attention,
    mla_prefill_attention_op,
    mla_prefill_attention_reference,
    prefill_takes_flash,
)
from ops_cuda.mla_attention_triton import mla_decode_attention_triton, mla_prefill_attention_triton  # noqa: E402
from ops_cuda.paged_attention import gather_cache  # noqa: E402
from ops_cuda.triton_kernels import write_kv_cache_triton  # noqa: E402
from tests.ops.test_paged_attention import TOL, allocate_as_nan, assert_close, assert_replays_follow  # noqa: E402


class LatentBatch:
    """Sequences with ``context_lens`` cached tokens and ``query_lens`` new ones, every token's latent
    and rope key in a pool of randomly permuted blocks (unused slots NaN); decode queries (one per
    sequence, absorbed: q_latent, q_rope) and prefill queries and decompressed keys (q_nope, q_rope,
    k_nope, k_rope, v) for the new tokens. A sequence of length 0 is a padding row. With ``fp8_scale``
    the pool is float8_e4m3fn, holding the entries divided by it (``entries`` are what it reads back)."""

    def __init__(self, context_lens, query_lens, heads, rank, rope, nope, v_dim, block_size, dtype, device="cpu",
                 seed=0, fp8_scale=None):
        gen = torch.Generator().manual_seed(seed)

        def randn(*shape):
            return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        width = max(-(-n // block_size) for n in seq_lens) + 1  # wider than any sequence needs
        num_blocks = len(seq_lens) * width + 2
        tables = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * width]
        self.block_tables = tables.view(len(seq_lens), width).to(torch.int32).to(device)
        self.kv_scale = 1.0 if fp8_scale is None else fp8_scale
        cache_dtype = dtype if fp8_scale is None else torch.float8_e4m3fn
        self.cache = torch.full((num_blocks, block_size, rank + rope), float("nan"), device=device).to(cache_dtype)
        self.entries = []  # each sequence's [seq_len, rank + rope]
        for i, n in enumerate(seq_lens):
            entries = quantize(randn(n, rank + rope), self.kv_scale, cache_dtype)
            positions = torch.arange(n, device=device)
            slots = self.block_tables[i, positions // block_size].long() * block_size + positions % block_size
            self.cache.view(-1, rank + rope)[slots] = entries
            self.entries.append(dequantize(entries, self.kv_scale, dtype))
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        self.query_start_loc = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32).to(device)
        self.query_lens, self.context_lens = query_lens, context_lens
        self.rank, self.scale = rank, (nope + rope) ** -0.5
        batch, tokens, keys = len(seq_lens), sum(query_lens), sum(seq_lens)
        self.q_latent, self.q_rope_decode = randn(batch, heads, rank), randn(batch, heads, rope)
        self.q_nope, self.q_rope = randn(tokens, heads, nope), randn(tokens, heads, rope)
        # k_nope and v as views of one decompressed [keys, heads, nope + v] tensor, as kv_b_proj gives them
        self.k_nope, self.v = randn(keys, heads, nope + v_dim).split([nope, v_dim], dim=-1)
        self.k_rope = torch.cat(self.entries)[:, rank:]
        self.key_start_loc = torch.tensor([0] + seq_lens).cumsum(0).to(torch.int32).to(device)

    def decode_args(self):
        return self.q_latent, self.q_rope_decode, self.cache, self.block_tables, self.seq_lens, self.scale

    def prefill_args(self):
        return (self.q_nope, self.q_rope, self.k_nope, self.k_rope, self.v, self.query_start_loc, self.key_start_loc,
                max(self.query_lens), max(c + q for c, q in zip(self.context_lens, self.query_lens)), self.scale)

    def reference_decode(self):  # in float32, from the same (rounded) inputs
        return mla_decode_attention_reference(*_float32(self.decode_args()), self.kv_scale)

    def reference_prefill(self):
        return mla_prefill_attention_reference(*_float32(self.prefill_args()))


def _float32(args):  # an FP8 cache stays one: the reference reads it with its scale
    return [t.float() if torch.is_tensor(t) and t.is_floating_point() and t.element_size() > 1 else t for t in args]


def decode_batch(seq_lens, *shape, **kwargs):
    return LatentBatch([max(n - 1, 0) for n in seq_lens], [min(n, 1) for n in seq_lens], *shape, **kwargs)


def run_decode(batch, **options):
    out = torch.full_like(batch.q_latent, float("nan"))
    mla_decode_attention_triton(*batch.decode_args(), out, kv_scale=batch.kv_scale, **options)
    return out


def run_prefill(batch):
    out = torch.full((*batch.q_nope.shape[:2], batch.v.shape[-1]), float("nan"), dtype=batch.v.dtype,
                     device=batch.v.device)
    *args, _, scale = batch.prefill_args()  # the kernel's grid takes no key count
    mla_prefill_attention_triton(*args, scale, out)
    return out


# --- CPU: the references -------------------------------------------------------------------------


def test_decode_reference_is_the_absorbed_form_over_each_sequence():
    batch = decode_batch([5, 1, 0, 9], 3, 8, 4, 6, 5, 4, torch.float32)
    out = batch.reference_decode()
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # a padding row attends nothing
    for i in (0, 1, 3):
        entries = batch.entries[i]
        scores = (batch.q_latent[i] @ entries[:, :8].T + batch.q_rope_decode[i] @ entries[:, 8:].T) * batch.scale
        assert_close(out[i], scores.softmax(-1) @ entries[:, :8], 1e-6)


def test_gather_latents_reads_each_sequence_in_order():
    batch = LatentBatch([3, 0, 9], [2, 4, 1], 2, 8, 4, 6, 5, 4, torch.float32)
    entries, key_start_loc = gather_latents(batch.cache, batch.block_tables, batch.seq_lens, sum([5, 4, 10]))
    assert key_start_loc.tolist() == batch.key_start_loc.tolist()
    expected = [gather_cache(batch.cache, batch.block_tables[i : i + 1], n)[0] for i, n in enumerate([5, 4, 10])]
    assert torch.equal(entries, torch.cat(expected))


def test_ops_default_to_the_references_and_pass_opcheck():
    batch = decode_batch([5, 0, 9], 3, 8, 4, 6, 5, 4, torch.float32)
    assert torch.equal(mla_decode_attention_op(*batch.decode_args()), batch.reference_decode())
    assert torch.equal(mla_decode_attention(*batch.decode_args()), batch.reference_decode())
    torch.library.opcheck(mla_decode_attention_op, batch.decode_args())
    batch = LatentBatch([3, 0], [2, 4], 3, 8, 4, 6, 5, 4, torch.float32)
    assert torch.equal(mla_prefill_attention_op(*batch.prefill_args()), batch.reference_prefill())
    assert torch.equal(mla_prefill_attention(*batch.prefill_args()), batch.reference_prefill())
    torch.library.opcheck(mla_prefill_attention_op, batch.prefill_args())


# --- CPU: the Triton kernels in the interpreter --------------------------------------------------

# (heads, rank, rope, nope, v_dim, block_size): DeepSeek's split of an entry into latent and rope at
# tiny sizes, odd head counts and dims that pad their tiles.
GEOMETRIES = {"1h-r16-block4": (1, 16, 8, 8, 12, 4), "5h-r24-block16": (5, 24, 8, 12, 16, 16)}


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_decode_kernel_interpreted(dtype, geometry):
    # Lengths crossing blocks, key tiles (16) and splits; a padding row; one split and several.
    batch = decode_batch([1, 37, 0, 20], *GEOMETRIES[geometry], dtype)
    reference = batch.reference_decode()
    for num_splits in (1, 3):
        assert_close(run_decode(batch, num_splits=num_splits), reference, TOL[dtype])


@pytest.mark.interpreter
@pytest.mark.parametrize("fp8_scale", [None, 0.25], ids=["q-dtype-pool", "e4m3-pool"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_decode_kernel_interpreted_with_the_gpus_key_tiles(dtype, fp8_scale):
    # 64-key tiles, as on a GPU: lengths within one tile, filling one, across three; one split and several.
    batch = decode_batch([1, 64, 0, 150], *GEOMETRIES["5h-r24-block16"], dtype, fp8_scale=fp8_scale)
    reference = batch.reference_decode()
    for num_splits in (1, 3):
        assert_close(run_decode(batch, num_splits=num_splits, block_n=64), reference, TOL[dtype])


@pytest.mark.interpreter
def test_decode_reduce_reads_only_the_splits_that_hold_keys(monkeypatch):
    # 8 splits of whole 16-key tiles over lengths that fill 1, 3, none (a padding row) and 2 of them:
    # the others write nothing.
    batch = decode_batch([1, 37, 0, 20], *GEOMETRIES["5h-r24-block16"], torch.float32)
    reference = batch.reference_decode()
    allocate_as_nan(monkeypatch)
    assert_close(run_decode(batch, num_splits=8), reference, TOL[torch.float32])


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_prefill_kernel_interpreted(dtype, geometry):
    # A fresh prompt over two query tiles, a chunk after unaligned context, one query after context.
    batch = LatentBatch([0, 5, 19], [21, 7, 1], *GEOMETRIES[geometry], dtype)
    assert_close(run_prefill(batch), batch.reference_prefill(), TOL[dtype])


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_fp8_pool_decode_kernel_interpreted(dtype):
    # An e4m3 pool with a scale: the kernel widens its entries and applies the scale as the reference does.
    batch = decode_batch([1, 37, 0, 20], *GEOMETRIES["5h-r24-block16"], dtype, fp8_scale=0.25)
    reference = batch.reference_decode()
    for num_splits in (1, 3):
        assert_close(run_decode(batch, num_splits=num_splits), reference, TOL[dtype])


def test_fp8_pool_decode_reference_is_the_absorbed_form_over_the_rounded_entries():
    batch = decode_batch([5, 1, 9], 3, 8, 4, 6, 5, 4, torch.float32, fp8_scale=0.5)
    assert batch.cache.dtype == torch.float8_e4m3fn
    out = batch.reference_decode()
    for i in range(3):
        entries = batch.entries[i]  # the pool's e4m3 entries times 0.5
        scores = (batch.q_latent[i] @ entries[:, :8].T + batch.q_rope_decode[i] @ entries[:, 8:].T) * batch.scale
        assert_close(out[i], scores.softmax(-1) @ entries[:, :8], 1e-6)


@pytest.mark.interpreter
def test_the_kv_cache_write_kernel_writes_the_latent_pool_through_column_views():
    # The latent and the rope key of each new token into one [blocks, block_size, rank + rope] pool;
    # slot -1 (padding of a captured batch) writes nothing.
    pool = torch.full((3, 4, 8 + 4), float("nan"))
    written = pool.clone()
    latent, k_rope = torch.randn(3, 8), torch.randn(3, 4)
    slots = torch.tensor([5, -1, 10])
    write_kv_cache_triton(latent[:, None], k_rope[:, None], pool[:, :, None, :8], pool[:, :, None, 8:], slots)
    write_kv_cache_reference(latent[:, None], k_rope[:, None], written[:, :, None, :8], written[:, :, None, 8:], slots)
    assert torch.equal(pool.nan_to_num(7.0), written.nan_to_num(7.0))
    assert torch.equal(pool.view(-1, 12)[10], torch.cat((latent[2], k_rope[2])))


def mla_layer(heads=3, rank=16, rope=8, nope=8, v_dim=12, q_lora_rank=None, dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    layer = MLAttention(32, heads, q_lora_rank, rank, nope, rope, v_dim, (nope + rope) ** -0.5, rope_interleave=True)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.3)
    return layer.to(dtype=dtype, device=device)


def mixed_latent_step(layer, block_size=4, device="cpu"):
    """Layer inputs and metadata of one step: two prompts (one after cached context), then three
    decodes (the last a padding row of length 0, slot -1), over a pool of random cached entries
    whose unused slots are NaN."""
    context_lens, query_lens = [0, 6, 9, 3, 0], [7, 3, 1, 1, 1]
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    seq_lens[-1] = 0
    width = 4
    gen = torch.Generator().manual_seed(1)
    tables = torch.randperm(len(seq_lens) * width + 2, generator=gen)[: len(seq_lens) * width].view(-1, width)
    dtype = layer.kv_b_proj.weight.dtype
    pool = torch.full((tables.numel() + 2, block_size, layer.kv_lora_rank + layer.qk_rope_head_dim), float("nan"),
                      dtype=dtype, device=device)
    tables = tables.to(torch.int32).to(device)
    rows, slots = [], []
    for i, (context, n) in enumerate(zip(context_lens, seq_lens)):
        positions = torch.arange(n, device=device)
        seq_slots = tables[i, positions // block_size].long() * block_size + positions % block_size
        entries = torch.randn(max(n, 1), pool.shape[-1], generator=gen).to(dtype=dtype, device=device)
        pool.view(-1, pool.shape[-1])[seq_slots[:context]] = entries[:context]  # the cached context
        rows.append(entries[context:])
        slots.append(seq_slots[context:] if n else torch.tensor([-1], device=device))
    new = torch.cat(rows)
    tokens = new.shape[0]
    heads = layer.num_heads
    q_nope = torch.randn(tokens, heads, layer.qk_nope_head_dim, generator=gen).to(pool)
    q_rope = torch.randn(tokens, heads, layer.qk_rope_head_dim, generator=gen).to(pool)
    metadata = AttentionMetadata(
        query_lens=query_lens, context_lens=context_lens, slot_mapping=torch.cat(slots), block_tables=tables,
        num_decodes=3, seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0] + query_lens).cumsum(0).to(torch.int32).to(device),
    )
    latent, k_rope = new[:, : layer.kv_lora_rank], new[:, layer.kv_lora_rank :]
    return pool, (q_nope, q_rope, latent.contiguous(), k_rope.contiguous(), metadata)


def attend_latent(backend, layer, pool, inputs):
    # The new tokens' entries written into a copy of the pool, as the layer writes them, then attended.
    q_nope, q_rope, latent, k_rope, metadata = inputs
    layer.backend, layer.kv_cache = backend, (pool.clone(),)
    rope_cache, latent_cache = layer.cache_parts()
    write_kv_cache_reference(latent[:, None], k_rope[:, None], latent_cache, rope_cache, metadata.slot_mapping,
                             layer.kv_scale, layer.kv_scale)
    return backend.attend_latent(layer, q_nope, q_rope, metadata)


def fp8_latent_step(layer, block_size=4, device="cpu"):
    """``mixed_latent_step`` over an e4m3 pool: its cached entries rounded with the layer's kv_scale."""
    pool, inputs = mixed_latent_step(layer, block_size, device)
    written = ~pool.isnan()
    fp8_pool = torch.full_like(pool, float("nan")).to(torch.float8_e4m3fn)
    fp8_pool[written] = quantize(pool[written], layer.kv_scale, torch.float8_e4m3fn)
    return fp8_pool, inputs


def decode_via_launcher(q_latent, q_rope, cache, block_tables, seq_lens, scale, kv_scale):
    out = torch.empty_like(q_latent)
    mla_decode_attention_triton(q_latent, q_rope, cache, block_tables, seq_lens, scale, out, kv_scale=kv_scale)
    return out


def prefill_via_launcher(q_nope, q_rope, k_nope, k_rope, v, *args):
    *args, _, scale = args  # the kernel's grid takes no key count
    out = q_nope.new_empty(*q_nope.shape[:2], v.shape[-1])
    mla_prefill_attention_triton(q_nope, q_rope, k_nope, k_rope, v, *args, scale, out)
    return out


@pytest.mark.interpreter
def test_triton_backend_latent_path_matches_the_torch_backend(monkeypatch):
    # The backend's slicing of the stream and metadata, with the interpreted kernels behind the ops.
    monkeypatch.setattr(TritonAttentionBackend, "latent_decode", staticmethod(decode_via_launcher))
    monkeypatch.setattr(TritonAttentionBackend, "latent_prefill", staticmethod(prefill_via_launcher))
    layer = mla_layer()
    pool, inputs = mixed_latent_step(layer)
    ours = attend_latent(TritonAttentionBackend(), layer, pool, inputs)
    reference = attend_latent(TorchAttentionBackend(), layer, pool, inputs)
    assert ours.shape == (13, 3, 12)
    assert_close(ours[:-1], reference[:-1], 1e-5)
    assert torch.equal(ours[-1], torch.zeros_like(ours[-1]))  # the padding row


@pytest.mark.interpreter
def test_triton_backend_latent_path_over_an_fp8_pool_matches_the_torch_backend(monkeypatch):
    # Both write the new tokens into the e4m3 pool and read every entry back through the layer's kv_scale.
    monkeypatch.setattr(TritonAttentionBackend, "latent_decode", staticmethod(decode_via_launcher))
    monkeypatch.setattr(TritonAttentionBackend, "latent_prefill", staticmethod(prefill_via_launcher))
    layer = mla_layer()
    layer.kv_scale = 0.5
    pool, inputs = fp8_latent_step(layer)
    ours = attend_latent(TritonAttentionBackend(), layer, pool, inputs)
    reference = attend_latent(TorchAttentionBackend(), layer, pool, inputs)
    assert_close(ours[:-1], reference[:-1], 1e-5)
    assert torch.equal(ours[-1], torch.zeros_like(ours[-1]))
    # The same as the model's dtype over the pool read back and the new tokens' entries rounded alike.
    q_nope, q_rope, latent, k_rope, metadata = inputs
    latent, k_rope = (dequantize(quantize(t, 0.5, torch.float8_e4m3fn), 0.5, torch.float32) for t in (latent, k_rope))
    layer.kv_scale = 1.0
    dequantized = attend_latent(TorchAttentionBackend(), layer, pool.float() * 0.5,
                                (q_nope, q_rope, latent, k_rope, metadata))
    assert_close(reference[:-1], dequantized[:-1], 1e-5)


def test_mla_layer_is_capturable_where_its_backend_is():
    layer = mla_layer()
    assert not layer.capturable  # the torch backend, bound before any cache
    layer.backend = TritonAttentionBackend()
    assert layer.capturable
    layer.backend = types.SimpleNamespace(latent_capturable=False)
    assert not layer.capturable


# --- GPU -------------------------------------------------------------------------------------------

DEEPSEEK_V3 = (128, 512, 64, 128, 128, 16)  # heads, rank, rope, nope, v_dim, block_size
GLM_4_7_FLASH = (20, 512, 64, 192, 256, 16)  # wider heads: the prefill kernel's tiles fit by fewer stages and rows
GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_decode_kernel_cuda(dtype):
    batch = decode_batch([1, 16, 0, 777, 4096, 2053], *DEEPSEEK_V3, dtype, "cuda")
    reference = batch.reference_decode()
    for options in ({}, {"num_splits": 1}, {"num_splits": 7}, {"block_h": 16}):
        assert_close(run_decode(batch, **options), reference, TOL[dtype])
    assert_close(mla_decode_attention(*batch.decode_args()), reference, TOL[dtype])
    odd = decode_batch([5, 300, 0, 1025], 5, 32, 16, 16, 24, 64, dtype, "cuda")  # tiny heads and ranks
    assert_close(mla_decode_attention(*odd.decode_args()), odd.reference_decode(), TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [DEEPSEEK_V3, GLM_4_7_FLASH], ids=["deepseek_v3", "glm_4_7_flash"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_prefill_kernel_cuda(dtype, shape):
    # A long fresh prompt, a chunk after unaligned context, one query after long context, odd tails.
    batch = LatentBatch([0, 517, 2000, 33], [1000, 300, 1, 129], *shape, dtype, "cuda")
    reference = batch.reference_prefill()
    assert_close(run_prefill(batch), reference, TOL[dtype])
    # The op: flash attention where q/k and v heads are one width (GLM-4.7-Flash's) in the 16-bit
    # dtypes, its causal mask bottom-right (the queries after their cached context)
    assert prefill_takes_flash(batch.q_nope, batch.q_rope, batch.v) == (shape == GLM_4_7_FLASH and
                                                                        dtype != torch.float32)
    assert_close(mla_prefill_attention(*batch.prefill_args()), reference, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp8_pool_decode_kernel_cuda(dtype):
    batch = decode_batch([1, 16, 0, 777, 4096, 2053], *DEEPSEEK_V3, dtype, "cuda", fp8_scale=0.25)
    reference = batch.reference_decode()
    for options in ({}, {"num_splits": 1}, {"num_splits": 7}, {"block_h": 16}):
        assert_close(run_decode(batch, **options), reference, TOL[dtype])
    assert_close(mla_decode_attention(*batch.decode_args(), 0.25), reference, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_backend_latent_path_over_an_fp8_pool_matches_the_torch_backend_cuda(dtype):
    layer = mla_layer(heads=16, rank=512, rope=64, nope=128, v_dim=128, q_lora_rank=64, dtype=dtype, device="cuda")
    layer.kv_scale = 0.5
    pool, inputs = fp8_latent_step(layer, block_size=16, device="cuda")
    ours = attend_latent(TritonAttentionBackend(), layer, pool, inputs)
    reference = attend_latent(TorchAttentionBackend(), layer, pool, inputs)
    assert_close(ours, reference, TOL[dtype])


def write_decode_tokens(batch):
    """New entries at each sequence's last position (seq_len - 1) through its block table, as a decode
    step writes its tokens before attending; padding rows (length 0) write nothing."""
    rows = (batch.seq_lens > 0).nonzero()[:, 0]
    positions = batch.seq_lens[rows].long() - 1
    block_size = batch.cache.shape[1]
    slots = batch.block_tables[rows, positions // block_size].long() * block_size + positions % block_size
    entries = torch.randn(len(rows), batch.cache.shape[-1], device=batch.cache.device).to(batch.cache.dtype)
    batch.cache.view(-1, batch.cache.shape[-1])[slots] = entries


@pytest.mark.gpu
def test_decode_op_replays_in_cuda_graph():
    """Captured once, replayed over the captured inputs, then over new values written into the same
    buffers as a decode step writes them (lengths, rotated block tables, both query parts, the new
    tokens' cache entries): each replay is the eager op's output on the values it read, close to
    the reference, and a graph that kept its captured values fails the second."""
    batch = decode_batch([1500] * 4, *DEEPSEEK_V3, torch.bfloat16, "cuda")
    batch.seq_lens.copy_(torch.tensor([5, 300, 0, 1025]))

    def rewrite():
        batch.seq_lens.copy_(torch.tensor([700, 1, 64, 0]))
        batch.block_tables.copy_(batch.block_tables.roll(1, 0))
        batch.q_latent.copy_(torch.randn_like(batch.q_latent))
        batch.q_rope_decode.copy_(torch.randn_like(batch.q_rope_decode))
        write_decode_tokens(batch)

    assert_replays_follow(mla_decode_attention, batch.decode_args(), rewrite, batch.reference_decode)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_triton_backend_latent_path_matches_the_torch_backend_cuda(dtype):
    layer = mla_layer(heads=16, rank=512, rope=64, nope=128, v_dim=128, q_lora_rank=64, dtype=dtype, device="cuda")
    pool, inputs = mixed_latent_step(layer, block_size=16, device="cuda")
    ours = attend_latent(TritonAttentionBackend(), layer, pool, inputs)
    reference = attend_latent(TorchAttentionBackend(), layer, pool, inputs)
    assert_close(ours, reference, TOL[dtype])
