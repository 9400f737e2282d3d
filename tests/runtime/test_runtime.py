"""The runtime on tiny random checkpoints, float32: token-identical to HuggingFace's generate and
to itself under chunked prefill, prefix caching, preemption and batching."""

import itertools
import random
import types

import numpy as np
import pytest
import torch

from ops_cuda.linear import PackedWeight
from runtime import LLM, SamplingParams
from tests.conftest import hf_model, relative_error, save_checkpoint, tiny_config
from tests.models.test_parity import VARIANTS as PARITY

ARCHITECTURES = {
    "llama": tiny_config("llama"),
    "mistral-window": tiny_config("mistral", sliding_window=6),
    "qwen2": tiny_config("qwen2", tie_word_embeddings=True),
    "qwen3": tiny_config("qwen3", head_dim=16),
}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def prompts(count=5, seed=0, low=1, high=40):
    rng = random.Random(seed)
    return [[rng.randrange(3, 97) for _ in range(rng.randint(low, high))] for _ in range(count)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}
    for name, config in ARCHITECTURES.items():
        model = hf_model(config)
        made[name] = (save_checkpoint(model, tmp_path_factory.mktemp(name)), model)
    return made


def llm(path, **options):
    """An LLM on the CPU whose steps run ahead of the host as they do on CUDA, so that these tests
    cover that scheme (``runtime.run_ahead``); the CPU's own takes each step in at once."""
    options.setdefault("block_size", 4)
    engine = LLM(str(path), device="cpu", **options)
    engine.engine.run_ahead.runs_ahead = True
    return engine


def token_ids(outputs):
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return [o.token_ids for o in outputs]


def test_engine_options_come_as_keywords_or_a_config_and_resolve_against_the_model(checkpoints):
    from runtime import EngineConfig

    path, _ = checkpoints["llama"]  # max_position_embeddings 64
    by_keywords = llm(path, max_num_seqs=3, max_model_len=1000)
    by_config = LLM(str(path), device="cpu", config=EngineConfig(block_size=4, max_num_seqs=3, max_model_len=1000))
    overridden = LLM(str(path), device="cpu", config=EngineConfig(block_size=8, max_num_seqs=3), block_size=4)
    for engine in (by_keywords.engine, by_config.engine, overridden.engine):
        assert engine.config == EngineConfig(max_num_seqs=3, max_model_len=64, block_size=4,
                                             max_num_batched_tokens=2048)
        assert engine.block_manager.block_size == 4 and engine.scheduler.max_num_seqs == 3
    unchunked = llm(path, enable_chunked_prefill=False).engine.config
    assert unchunked.max_num_batched_tokens == unchunked.max_model_len == 64
    with pytest.raises(ValueError, match=r"without chunked prefill max_num_batched_tokens \(32\) must be >= "
                                         r"max_model_len \(64\)"):
        llm(path, enable_chunked_prefill=False, max_num_batched_tokens=32)
    batch = prompts(3)
    assert token_ids(by_config.generate(batch, GREEDY, use_tqdm=False)) == token_ids(
        by_keywords.generate(batch, GREEDY, use_tqdm=False))


def test_dtype_auto_is_float32_on_the_cpu_and_an_explicit_dtype_wins(tmp_path):
    path = save_checkpoint(hf_model(ARCHITECTURES["llama"]), tmp_path, dtype=torch.bfloat16)
    assert next(LLM(str(path), device="cpu").model.parameters()).dtype == torch.float32
    assert next(LLM(str(path), device="cpu", dtype="bfloat16").model.parameters()).dtype == torch.bfloat16


def test_bfloat16_decode_steps_multiply_by_packed_weights_to_the_same_tokens(checkpoints, monkeypatch):
    import layers.linear

    path, _ = checkpoints["qwen3"]
    packed_llm = llm(path, dtype="bfloat16")
    model = packed_llm.engine.runner.model
    if not PackedWeight.supports(model.lm_head.weight):
        pytest.skip("this CPU's torch packs no bfloat16 weights")
    assert model.lm_head.packed is not None and model.model.layers[0].self_attn.qkv_proj.packed is not None
    copies = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if getattr(m, "packed", None) is not None)
    monkeypatch.setattr(layers.linear, "available_memory", lambda: copies)  # the copies would take all of it
    with pytest.warns(UserWarning, match="not packing the weights"):
        unpacked_llm = llm(path, dtype="bfloat16")
    batch = prompts(4)
    products = []
    packed_linear = PackedWeight.linear
    monkeypatch.setattr(PackedWeight, "linear", lambda *args: products.append(1) or packed_linear(*args))
    # oneDNN computes both the packed bfloat16 products and F.linear's, bit for bit: the same tokens.
    packed_tokens = token_ids(packed_llm.generate(batch, GREEDY, use_tqdm=False))
    assert products, "the decode steps multiplied by no packed weight"
    products.clear()
    assert packed_tokens == token_ids(unpacked_llm.generate(batch, GREEDY, use_tqdm=False))
    assert not products and all(m.packed is None for m in unpacked_llm.engine.runner.model.modules() if hasattr(m, "packed"))


def test_a_new_engine_sizes_its_cache_without_the_cache_of_an_earlier_one(checkpoints, monkeypatch):
    # On CUDA the cache is sized by the free memory: the cache an earlier engine of the same model
    # bound to its layers must be gone by then (the second LLM found 0 GiB free on the H200).
    import gc
    import weakref

    import runtime.engine
    from models import AutoModelForCausalLM

    path, _ = checkpoints["llama"]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, device="cpu")
    first = LLM(model, block_size=4)
    old_pool = weakref.ref(first.engine.kv_cache.pools[0][0])
    expected = token_ids(first.generate(prompts(3), GREEDY, use_tqdm=False))
    del first
    bound_when_sized = []
    sized = runtime.engine.blocks_for_budget

    def record(model, *args):
        bound_when_sized.append(model.bound_kv_cache)
        bound_when_sized.extend(m.kv_cache for m in model.modules() if hasattr(m, "kv_cache"))
        return sized(model, *args)

    monkeypatch.setattr(runtime.engine, "blocks_for_budget", record)
    second = LLM(model, block_size=4)
    gc.collect()
    assert len(bound_when_sized) > 1 and all(cache is None for cache in bound_when_sized)
    assert old_pool() is None
    assert token_ids(second.generate(prompts(3), GREEDY, use_tqdm=False)) == expected


def test_an_llm_dropped_takes_its_kv_cache_with_it(checkpoints):
    import gc
    import weakref

    from models import AutoModelForCausalLM

    path, _ = checkpoints["llama"]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, device="cpu")
    engine = LLM(model, block_size=4)
    engine.generate(prompts(2), GREEDY, use_tqdm=False)
    pool = weakref.ref(engine.engine.kv_cache.pools[0][0])
    del engine
    gc.collect()
    assert pool() is None
    assert model.bound_kv_cache is None
    assert all(m.kv_cache is None for m in model.modules() if hasattr(m, "kv_cache"))


def test_an_llm_whose_model_a_newer_llm_took_over_says_so(checkpoints):
    from models import AutoModelForCausalLM

    path, _ = checkpoints["llama"]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, device="cpu")
    first = LLM(model, block_size=4)
    second = LLM(model, block_size=4)
    with pytest.raises(RuntimeError, match="taken over by a newer LLM"):
        first.generate(prompts(2), GREEDY, use_tqdm=False)
    assert token_ids(second.generate(prompts(2), GREEDY, use_tqdm=False)) == token_ids(
        llm(path).generate(prompts(2), GREEDY, use_tqdm=False))


def test_a_stream_left_early_or_an_interrupted_call_leaves_nothing_running(checkpoints, monkeypatch):
    path, _ = checkpoints["llama"]
    engine = llm(path, num_blocks=64)
    batch = prompts(4)
    expected = token_ids(llm(path).generate(batch, GREEDY, use_tqdm=False))
    free_blocks = engine.engine.block_manager.num_free_blocks

    def nothing_left():
        while engine.engine.has_unfinished():  # a step launched ahead is taken in, computing nothing new
            assert engine.engine.step() == []
        assert not engine.engine.sequences and not engine.engine.outputs
        assert engine.engine.block_manager.num_free_blocks == free_blocks

    for delta in engine.stream(prompts(3, seed=1), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)):
        break  # the reader stops reading
    nothing_left()
    steps = 0
    step = engine.engine.step

    def interrupted_step():
        nonlocal steps
        steps += 1
        if steps == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(engine.engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts(3, seed=2), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    monkeypatch.setattr(engine.engine, "step", step)
    nothing_left()
    assert token_ids(engine.generate(batch, GREEDY, use_tqdm=False)) == expected
    assert not engine.engine.sequences and not engine.engine.outputs  # finished requests are not kept either


def test_llm_built_under_inference_mode_generates_outside_it(checkpoints):
    path, _ = checkpoints["llama"]
    with torch.inference_mode():
        built_inside = llm(path)
    batch = prompts(3)
    assert token_ids(built_inside.generate(batch, GREEDY, use_tqdm=False)) == token_ids(
        llm(path).generate(batch, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("files, expected", [
    ({"/proc/meminfo": "MemTotal: 8000 kB\nMemAvailable: 4000 kB\n"}, 4000 * 1024),
    ({"/proc/meminfo": "MemAvailable: 4000 kB\n", "/sys/fs/cgroup/memory.max": "max\n",
      "/sys/fs/cgroup/memory.current": "100\n"}, 4000 * 1024),
    ({"/proc/meminfo": "MemAvailable: 4000 kB\n", "/sys/fs/cgroup/memory.max": "3000000\n",
      "/sys/fs/cgroup/memory.current": "1000000\n"}, 2000000),
    ({"/sys/fs/cgroup/memory/memory.limit_in_bytes": "5000\n", "/sys/fs/cgroup/memory/memory.usage_in_bytes": "1000\n"},
     4000),
    ({}, None),
], ids=["meminfo", "cgroup-v2-unlimited", "cgroup-v2-limit", "cgroup-v1-limit", "unknown"])
def test_available_memory_takes_the_tighter_of_the_system_and_its_container(files, expected, monkeypatch):
    import builtins
    import io

    import layers.linear

    def fake_open(path, *args, **kwargs):
        if path not in files:
            raise FileNotFoundError(path)
        return io.StringIO(files[path])

    monkeypatch.setattr(builtins, "open", fake_open)
    assert layers.linear.available_memory() == expected


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_greedy_matches_hf_generate(name, checkpoints):
    path, reference = checkpoints[name]
    batch = prompts()
    engine = llm(path)
    model = engine.engine.runner.model
    if PackedWeight.supports(model.lm_head.weight):  # products of 3 rows or more read packed weights
        assert model.lm_head.packed is not None and model.model.layers[0].mlp.down_proj.packed is not None
    outputs = engine.generate(batch, GREEDY, use_tqdm=False)
    for prompt, output in zip(batch, outputs):
        ids = torch.tensor([prompt])
        expected = reference.generate(ids, max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
        assert output.token_ids == expected
        assert output.prompt_token_ids == prompt
        assert output.finish_reason == ("stop" if expected[-1] == reference.config.eos_token_id else "length")


@pytest.fixture(scope="module")
def longrope_checkpoint(tmp_path_factory):
    model = hf_model(PARITY["phi3-longrope"])  # an original context of 32 positions, max_position_embeddings 64
    return save_checkpoint(model, tmp_path_factory.mktemp("longrope")), model


def hf_greedy(reference, prompt, max_new_tokens):
    ids = torch.tensor([prompt])
    return reference.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, len(prompt):].tolist()


def test_longrope_generates_what_hf_generates_on_either_side_of_the_original_context(longrope_checkpoint):
    """Sequences that stay within the original context take the short factors, as HF's do; with a
    max_model_len past it, every position takes the long ones, as HF's forwards of prompts past it do."""
    path, reference = longrope_checkpoint
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    within = prompts(4, seed=21, low=3, high=20)  # 32 tokens at most with the 12 generated
    engine = llm(path, max_model_len=33)
    assert engine.engine.runner.model.capturable
    assert token_ids(engine.generate(within, params, use_tqdm=False)) == [hf_greedy(reference, p, 12) for p in within]
    past = prompts(3, seed=22, low=33, high=45)
    with pytest.warns(UserWarning, match="LongRoPE with max_model_len 64: every position takes the long factors"):
        engine = llm(path)
    assert token_ids(engine.generate(past, params, use_tqdm=False)) == [hf_greedy(reference, p, 12) for p in past]
    # The set fixed for the engine's cache leaves a cache-free forward HF's pick: short for 20 positions
    ids = torch.tensor([(within[0] + past[0])[:20]])
    with torch.no_grad():
        assert relative_error(engine.engine.runner.model(ids), reference(ids).logits) < 1e-5


def test_a_longrope_sequence_growing_past_the_original_context_keeps_the_long_factors(longrope_checkpoint):
    # HF's generate takes the short factors until a forward passes 32 positions, its cache then holding keys
    # of both sets; zoo takes the long ones throughout, as HF's forward of the whole sequence does.
    path, reference = longrope_checkpoint
    prompt = prompts(1, seed=23, low=10, high=10)[0]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    [output] = token_ids(llm(path).generate([prompt], params, use_tqdm=False))
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + output[:-1]])).logits[0]
    assert output == logits[len(prompt) - 1:].argmax(-1).tolist()


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_on_the_cpu_each_step_gives_its_own_tokens(name, checkpoints):
    # A CPU step has been computed by the time it is launched: a request's first token comes back
    # from its prompt's step, each next one from the step that sampled it, and the same tokens as HF.
    path, reference = checkpoints[name]
    engine = LLM(str(path), device="cpu", block_size=4).engine
    assert not engine.run_ahead.runs_ahead
    prompt = prompts(1, seed=21, low=9, high=9)[0]
    engine.add_request(0, prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    steps = []
    while engine.has_unfinished():
        steps.append([output.token_ids.copy() for output in engine.step()])
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=4, min_new_tokens=4,
                                  do_sample=False)[0, len(prompt):].tolist()
    assert steps == [[expected[:1]], [expected[:2]], [expected[:3]], [expected]]
    assert engine.run_ahead.num_steps_run_ahead == 0


def record_steps(engine):
    """Each step the engine's scheduler hands out, as (request_id, num_computed_tokens before it,
    new tokens, prompt length) per sequence, recorded at the moment it is scheduled."""
    steps = []
    schedule = engine.engine.scheduler.schedule

    def recorded():
        scheduled, failed = schedule()
        steps.append([(seq.request_id, seq.num_computed_tokens, count, seq.num_prompt_tokens)
                      for seq, count in scheduled])
        return scheduled, failed

    engine.engine.scheduler.schedule = recorded
    return steps


def test_chunked_prefill_changes_nothing(checkpoints):
    path, _ = checkpoints["mistral-window"]
    batch = prompts(6, seed=1, low=10, high=40)
    plain = token_ids(llm(path, enable_chunked_prefill=False).generate(batch, GREEDY, use_tqdm=False))
    engine = llm(path, max_num_batched_tokens=7)
    steps = record_steps(engine)
    assert token_ids(engine.generate(batch, GREEDY, use_tqdm=False)) == plain
    # Every step stays within the token budget, and prompts longer than it are split across steps:
    # a prefill chunk that ends before its prompt does.
    assert steps and all(sum(count for _, _, count, _ in step) <= 7 for step in steps)
    split = {rid for step in steps for rid, computed, count, prompt in step if computed + count < prompt}
    assert len(split) >= 4, split


def test_prefix_cache_hits_change_nothing(checkpoints):
    path, _ = checkpoints["qwen3"]
    shared = prompts(1, seed=2, low=20, high=20)[0]
    batch = [shared + tail for tail in prompts(4, seed=3, low=1, high=9)] + [shared[:16]]
    solo = [token_ids(llm(path, enable_prefix_caching=False).generate([p], GREEDY, use_tqdm=False))[0] for p in batch]
    engine = llm(path)
    first = engine.generate(batch, GREEDY, use_tqdm=False)
    again = engine.generate(batch, GREEDY, use_tqdm=False)
    assert token_ids(first) == solo and token_ids(again) == solo
    assert all(o.num_cached_tokens >= 16 for o in again[:4])
    # An entirely cached prompt (16 tokens = 4 full blocks) still computes its last block.
    assert again[4].num_cached_tokens == 12
    # A block's key chains the blocks before it: a prompt that starts with the tokens of a later
    # block of a cached prompt (shared[4:8], cached after shared[:4]) gets no hit. A hit saves its
    # compute: each prompt's prefill computes the tokens the cache did not serve, no more.
    shifted = shared[4:8] + prompts(1, seed=5, low=6, high=6)[0]
    steps = record_steps(engine)
    third = engine.generate(batch + [shifted], GREEDY, use_tqdm=False)
    assert third[-1].num_cached_tokens == 0
    assert token_ids(third) == solo + [token_ids(llm(path, enable_prefix_caching=False).generate(
        [shifted], GREEDY, use_tqdm=False))[0]]
    computed = {}
    for step in steps:
        for rid, done, count, prompt in step:
            if done < prompt:
                computed[rid] = computed.get(rid, 0) + count
    for output in third:
        assert computed[output.request_id] == len(output.prompt_token_ids) - output.num_cached_tokens


def test_reset_prefix_cache_serves_no_earlier_prompt(checkpoints):
    path, _ = checkpoints["qwen3"]
    batch = prompts(3, seed=41, low=12, high=20)
    engine = llm(path)
    first = engine.generate(batch, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in engine.generate(batch, GREEDY, use_tqdm=False))
    engine.reset_prefix_cache()
    assert not engine.engine.block_manager.cached
    again = engine.generate(batch, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [0, 0, 0] and token_ids(again) == token_ids(first)


def test_torch_backend_derives_the_decode_keys_once_per_step(checkpoints, monkeypatch):
    # Every layer reads the same slots; a step's metadata is new, so each step derives them anew.
    import layers.attention

    derived = []

    def counted(block_tables, seq_lens, *args):
        derived.append(seq_lens.tolist())
        return decode_key_slots(block_tables, seq_lens, *args)

    decode_key_slots = layers.attention.decode_key_slots
    monkeypatch.setattr(layers.attention, "decode_key_slots", counted)
    path, _ = checkpoints["llama"]
    engine = llm(path, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    assert derived == [[4, 3], [5, 4], [6, 5]]  # three decode steps after the prefill, two layers each


def test_preemption_changes_nothing(checkpoints):
    path, _ = checkpoints["llama"]
    batch = prompts(6, seed=4, low=12, high=30)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    roomy = token_ids(llm(path).generate(batch, params, use_tqdm=False))
    tight = llm(path, num_blocks=16)  # 64 tokens of cache for ~6 x 40
    assert token_ids(tight.generate(batch, params, use_tqdm=False)) == roomy
    assert tight.engine.scheduler.num_preemptions > 0


def test_a_preempted_request_counts_as_cached_only_what_the_cache_held_at_its_first_admission(checkpoints):
    """Re-admitted, it finds the blocks it computed itself: those are no prefix-cache hit of its prompt."""
    path, _ = checkpoints["llama"]
    batch = prompts(6, seed=31, low=5, high=30)  # no two share a block
    params = SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True)
    tight = llm(path, num_blocks=14, max_model_len=56)
    outputs = tight.generate(batch, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.num_cached_tokens for o in outputs] == [0] * 6
    assert token_ids(outputs) == token_ids(llm(path).generate(batch, params, use_tqdm=False))


def test_block_table_rows_follow_the_sequences(checkpoints):
    """The rows of the block manager's table, which the model reads, equal each sequence's block
    table after every step: through prefix-cache hits, preemption, and rows that finished
    sequences hand on."""
    path, _ = checkpoints["llama"]
    shared = prompts(1, seed=14, low=12, high=12)[0]
    batch = [shared + tail for tail in prompts(8, seed=15, low=1, high=20)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    roomy = token_ids(llm(path).generate(batch, params, use_tqdm=False))
    tight = llm(path, num_blocks=20, max_num_seqs=4)
    engine, manager = tight.engine, tight.engine.block_manager
    outputs = [engine.add_request(i, prompt, params) for i, prompt in enumerate(batch)]
    rows_used = set()
    while engine.has_unfinished():
        engine.step()
        holding = [seq for seq in engine.sequences.values() if seq.block_table]
        rows = [seq.table_row for seq in holding]
        assert None not in rows and len(set(rows)) == len(rows)
        rows_used.update(rows)
        for seq in holding:
            row = manager.block_tables[seq.table_row]
            assert row[: len(seq.block_table)].tolist() == seq.block_table and not row[len(seq.block_table) :].any()
        assert all(seq.table_row is None for seq in engine.sequences.values() if not seq.block_table)
        assert not manager.block_tables[manager.free_rows].any()
    assert token_ids(outputs) == roomy
    assert engine.scheduler.num_preemptions > 0 and any(o.num_cached_tokens for o in outputs)
    assert len(rows_used) <= 4 and sorted(manager.free_rows) == [0, 1, 2, 3]


def test_a_step_gathers_the_table_columns_its_longest_sequence_fills(checkpoints, monkeypatch):
    """The block manager's rows are as wide as max_model_len needs (the model's 64 positions here:
    16 blocks); a step gathers and packs only the columns that hold its sequences' blocks."""
    import runtime.model_runner
    from runtime.step_inputs import StepInputs

    steps = []

    class Recorded(StepInputs):
        def __init__(self, *args):
            super().__init__(*args)
            steps.append((self.block_tables.shape[1], int(self.seq_lens.max()), self.table_width))

    monkeypatch.setattr(runtime.model_runner, "StepInputs", Recorded)
    path, _ = checkpoints["llama"]
    batch, params = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]], SamplingParams(max_tokens=6, temperature=0.0)
    llm(path, block_size=4).generate(batch, params, use_tqdm=False)
    assert [width for width, _, _ in steps] == [-(-longest // 4) for _, longest, _ in steps]
    assert {width for width, _, _ in steps} == {2, 3, 4} and {table_width for _, _, table_width in steps} == {16}


def test_staging_sends_a_table_as_wide_as_the_kernels_compiled_for_with_zeros_after_its_columns():
    from runtime.cuda_graphs import Staging

    staging = Staging.__new__(Staging)  # its packing alone, on the CPU: a plain buffer, no CUDA event
    staging.buffer = torch.full((64,), 99, dtype=torch.int32)  # what an earlier step left there
    staging.copied = types.SimpleNamespace(synchronize=lambda: None, record=lambda: None)
    lengths, table = np.array([5, 9], dtype=np.int32), np.array([[3, 1], [4, 0]], dtype=np.int32)
    sent_lengths, sent_table = staging.send_arrays((lengths, table), "cpu", shapes=(None, (2, 6)))
    assert sent_lengths.tolist() == [5, 9]
    assert sent_table.tolist() == [[3, 1, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0]]


def test_request_alone_equals_request_in_batch(checkpoints):
    path, _ = checkpoints["qwen2"]
    batch = prompts(7, seed=5)
    engine = llm(path, enable_prefix_caching=False)
    together = token_ids(engine.generate(batch, GREEDY, use_tqdm=False))
    assert together == [token_ids(engine.generate([p], GREEDY, use_tqdm=False))[0] for p in batch]


def test_seeded_sampling_is_reproducible(checkpoints):
    path, _ = checkpoints["llama"]
    engine = llm(path)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    prompt = prompts(1, seed=6)[0]
    alone = token_ids(engine.generate([prompt], params, use_tqdm=False))[0]
    others = [SamplingParams(max_tokens=16, temperature=0.8, seed=s, ignore_eos=True) for s in range(4)]
    batched = token_ids(engine.generate(prompts(4, seed=7) + [prompt], others + [params], use_tqdm=False))
    assert batched[-1] == alone
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=4321, ignore_eos=True)
    assert token_ids(engine.generate([prompt], other_seed, use_tqdm=False))[0] != alone


def test_a_top_k_past_the_vocabulary_keeps_every_token(checkpoints):
    path, _ = checkpoints["llama"]  # vocab_size 97
    engine = llm(path)
    prompt = prompts(1, seed=11)[0]

    def seeded(top_k):
        return SamplingParams(max_tokens=8, temperature=1.0, top_k=top_k, seed=5, ignore_eos=True)

    unfiltered = token_ids(engine.generate([prompt], seeded(0), use_tqdm=False))[0]
    greedy = token_ids(engine.generate([prompt], GREEDY, use_tqdm=False))[0]
    for top_k in (97, 2**63, 10**30, np.uint64(2**64 - 1)):
        outputs = engine.generate([prompt, prompt], [seeded(top_k), GREEDY], use_tqdm=False)
        assert token_ids(outputs) == [unfiltered, greedy], top_k


def test_a_tiny_temperature_generates_the_greedy_tokens(checkpoints):
    path, _ = checkpoints["llama"]
    engine = llm(path)
    batch = prompts(3, seed=12)
    greedy = token_ids(engine.generate(batch, GREEDY, use_tqdm=False))
    for temperature in (1e-38, 1e-300):
        params = SamplingParams(max_tokens=12, temperature=temperature, seed=3)
        assert token_ids(engine.generate(batch, params, use_tqdm=False)) == greedy, temperature


def test_repetition_penalty_matches_hf_generate(checkpoints):
    # A penalised request reads every token it has so far, the one sampled at the step before
    # included: the host takes each step in before the next is scheduled, and 24 greedy steps
    # equal HF's generate(repetition_penalty=...) token for token.
    path, reference = checkpoints["llama"]
    batch = prompts(4, seed=14, low=3, high=20)
    for penalty in (1.5, 0.8):
        params = SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=penalty, ignore_eos=True)
        outputs = token_ids(llm(path).generate(batch, params, use_tqdm=False))
        for prompt, output in zip(batch, outputs):
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24,
                                          do_sample=False, repetition_penalty=penalty)
            assert output == expected[0, len(prompt):].tolist(), penalty


def test_stop_token_ids_and_max_tokens(checkpoints):
    path, _ = checkpoints["llama"]
    engine = llm(path)
    prompt = prompts(1, seed=8)[0]
    free = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert len(free.token_ids) == 10 and free.finish_reason == "length"
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    stopped = engine.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                       stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert stopped.token_ids == free.token_ids[: first + 1] and stopped.finish_reason == "stop"


def test_sequences_ending_by_length_leave_the_next_step_running_ahead(checkpoints):
    # A sequence whose pending token is its last (max_tokens, or max_model_len) is left out of the
    # next step instead of the host waiting for that token: every decode step runs ahead.
    path, _ = checkpoints["llama"]  # max_position_embeddings 64
    engine = llm(path, max_model_len=40)
    batch = prompts(4, seed=12, low=5, high=8)
    longest = token_ids(engine.generate(batch, SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True),
                                        use_tqdm=False))
    ahead = engine.engine.run_ahead.num_steps_run_ahead
    lengths = [3, 5, 7, 9]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outputs = engine.generate(batch, params, use_tqdm=False)
    assert token_ids(outputs) == [ids[:n] for ids, n in zip(longest, lengths)]
    assert [o.finish_reason for o in outputs] == ["length"] * 4
    # One prompt step, then 8 decode steps for the longest, each launched while the one before runs.
    assert engine.engine.run_ahead.num_steps_run_ahead - ahead == 8
    # A prompt that reaches max_model_len ends there with no wait either.
    near_limit = [prompts(1, seed=13, low=36, high=36)[0]]
    ahead = engine.engine.run_ahead.num_steps_run_ahead
    output = engine.generate(near_limit, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                             use_tqdm=False)[0]
    assert len(output.token_ids) == 4 and output.finish_reason == "length"
    assert engine.engine.run_ahead.num_steps_run_ahead - ahead == 3
    assert not engine.engine.scheduler.running and engine.engine.block_manager.num_free_blocks == \
        engine.engine.block_manager.num_blocks


def test_tokens_sampled_ahead_of_a_stop_are_dropped(checkpoints):
    # Decodes run ahead of the host: the step after a stop token is already launched when the
    # host sees it. Its token must not reach the output, and the cache must stay right.
    path, reference = checkpoints["llama"]
    engine = llm(path)
    batch = prompts(4, seed=10, low=5, high=20)
    free = token_ids(engine.generate(batch, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                                     use_tqdm=False))
    assert engine.engine.run_ahead.num_steps_run_ahead > 0
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[ids[3 + i]])
              for i, ids in enumerate(free)]
    stopped = token_ids(engine.generate(batch, params, use_tqdm=False))
    assert stopped == [ids[: ids.index(ids[3 + i]) + 1] for i, ids in enumerate(free)]
    # Each prompt with its stopped output, now served from the prefix cache, continues like HF.
    continued = [p + ids for p, ids in zip(batch, stopped)]
    outputs = token_ids(engine.generate(continued, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                                        use_tqdm=False))
    for prompt, output in zip(continued, outputs):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=4, min_new_tokens=4, do_sample=False)
        assert output == expected[0, len(prompt):].tolist()


def test_blocks_full_of_generated_tokens_are_cached(checkpoints):
    # The blocks a sequence fills with its generated tokens are keyed like its prompt's: a prompt
    # made of an earlier prompt and its output is served from the cache up to its last full block
    # before its last token, generated tokens included, and continues like the uncached one.
    path, _ = checkpoints["llama"]
    engine = llm(path)
    batch = prompts(3, seed=12, low=5, high=10)
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    first = token_ids(engine.generate(batch, params, use_tqdm=False))
    continued = [p + ids for p, ids in zip(batch, first)]
    outputs = engine.generate(continued, params, use_tqdm=False)
    for prompt, generated, output in zip(batch, first, outputs):
        assert output.num_cached_tokens == (len(prompt) + len(generated) - 1) // 4 * 4
        assert output.num_cached_tokens >= (len(prompt) // 4 + 3) * 4  # 3 blocks of generated tokens at least
    uncached = llm(path, enable_prefix_caching=False).generate(continued, params, use_tqdm=False)
    assert token_ids(outputs) == token_ids(uncached)


def test_max_model_len_ends_generation_at_the_same_token(checkpoints):
    # The last token that fits max_model_len is generated whether or not decodes run ahead.
    path, _ = checkpoints["llama"]
    batch = prompts(3, seed=11, low=6, high=12)
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    outputs = llm(path, max_model_len=24).generate(batch, params, use_tqdm=False)
    free = token_ids(llm(path).generate(batch, params, use_tqdm=False))
    for prompt, output, unbounded in zip(batch, outputs, free):
        assert output.token_ids == unbounded[: 24 - len(prompt)] and output.finish_reason == "length"
    [last] = llm(path, max_model_len=len(batch[0]) + 1).generate(batch[:1], params, use_tqdm=False)
    assert last.token_ids == free[0][:1] and last.finish_reason == "length"


def test_logprobs_are_the_models(checkpoints):
    path, reference = checkpoints["qwen3"]
    prompt = prompts(1, seed=9)[0]
    output = llm(path).generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=3), use_tqdm=False)[0]
    ids = torch.tensor([prompt + output.token_ids])
    with torch.no_grad():
        expected = reference(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    assert len(output.logprobs) == 6
    for step, (token, entry) in enumerate(zip(output.token_ids, output.logprobs)):
        assert token in entry and len(entry) == 3  # greedy: the sampled token is also the top one
        for alternative, logprob in entry.items():
            assert logprob == pytest.approx(expected[step, alternative].item(), abs=1e-5)
        assert set(entry) == set(expected[step].topk(3).indices.tolist())


def test_sampled_tokens_carry_their_own_logprobs(checkpoints):
    # A drawn token's logprob is that token's under the model (not the most likely token's): each
    # step's entry holds the sampled token with HF's log_softmax value for it.
    path, reference = checkpoints["qwen3"]
    batch = prompts(3, seed=15)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, logprobs=0, ignore_eos=True)
    outputs = llm(path).generate(batch, params, use_tqdm=False)
    drawn_below_the_top = 0
    for prompt, output in zip(batch, outputs):
        assert output.error is None and len(output.logprobs) == 12
        with torch.no_grad():
            expected = reference(torch.tensor([prompt + output.token_ids])).logits[0, len(prompt) - 1 : -1]
        expected = expected.log_softmax(-1)
        for step, (token, entry) in enumerate(zip(output.token_ids, output.logprobs)):
            assert list(entry) == [token]
            assert entry[token] == pytest.approx(expected[step, token].item(), abs=1e-5)
            drawn_below_the_top += token != int(expected[step].argmax())
    assert drawn_below_the_top > 3  # the draws are not all the greedy tokens


def test_bad_requests_fail_alone(checkpoints):
    path, _ = checkpoints["llama"]
    engine = llm(path, max_model_len=48)
    good = prompts(2, seed=10, high=20)
    bad = {
        "the prompt is empty": ([], GREEDY),
        "token id 97 is outside the vocabulary": ([5, 97], GREEDY),
        "max_tokens must be a positive integer": ([5, 6], SamplingParams(max_tokens=0)),
        "the prompt has 60 tokens; max_model_len is 48": ([5] * 60, GREEDY),
        "the prompt has 48 tokens; max_model_len is 48, which holds the prompt and at least one generated token":
            ([5] * 48, GREEDY),
        "temperature must be >= 0": ([5], SamplingParams(temperature=-1.0)),
        "top_p must be in (0, 1]": ([5], SamplingParams(top_p=0.0)),
        "min_p must be in [0, 1]": ([5], SamplingParams(min_p=1.5)),
        "top_k must be an integer >= 0": ([5], SamplingParams(top_k=-3)),
        "repetition_penalty must be > 0": ([5], SamplingParams(repetition_penalty=0.0)),
        "a prompt of token ids: element 0 is a float (1.5), not a token id": ([1.5, 2], GREEDY),
        "a prompt of token ids: element 1 is a list ([3, 4]), not a token id": ([5, [3, 4]], GREEDY),
        "'prompt_token_ids': element 2 is a str ('7'), not a token id": ({"prompt_token_ids": [5, 6, "7"]}, GREEDY),
        "stop strings need a tokenizer": ([5], SamplingParams(stop=["x"])),
        "temperature must be a finite number, got 'hot'": ([5], SamplingParams(temperature="hot")),
        "seed must be None or an integer": ([5], SamplingParams(seed="abc")),
        "seed must be None or an integer in [-2**63, 2**64), got 1180591620717411303424": (
            [5], SamplingParams(seed=2**70)),
        "stop_token_ids must be integers in [0, 97), got [1.5]": ([5], SamplingParams(stop_token_ids=[1.5])),
        "max_tokens must be a positive integer, got True": ([5], SamplingParams(max_tokens=True)),
        "temperature must be a finite number, got 1000000000": ([5], SamplingParams(temperature=10**400)),
        "ignore_eos must be True or False, got 'no'": ([5], SamplingParams(ignore_eos="no")),
    }
    batch = [good[0]] + [p for p, _ in bad.values()] + [good[1]]
    params = [GREEDY] + [s for _, s in bad.values()] + [GREEDY]
    outputs = engine.generate(batch, params, use_tqdm=False)
    for i, (message, output) in enumerate(zip(bad, outputs[1:-1]), start=1):
        assert output.finish_reason == "error" and output.error.startswith(f"request {i}: {message}"), output.error
    assert outputs[0].error is None and outputs[-1].error is None
    assert token_ids([outputs[0], outputs[-1]]) == token_ids(engine.generate(good, GREEDY, use_tqdm=False))


def test_a_call_that_fails_while_adding_its_requests_leaves_none_of_them(checkpoints, monkeypatch):
    engine = llm(checkpoints["llama"][0])
    add_request = engine.engine.add_request

    def fail_on_the_second(request_id, prompt, params):
        if request_id == 1:
            raise RuntimeError("a failure while adding request 1")
        return add_request(request_id, prompt, params)

    monkeypatch.setattr(engine.engine, "add_request", fail_on_the_second)
    with pytest.raises(RuntimeError, match="while adding request 1"):
        engine.generate(prompts(3), GREEDY, use_tqdm=False)
    assert not engine.engine.has_unfinished()  # request 0, added first, is gone too


def test_arguments_of_the_wrong_kind_are_named(checkpoints):
    from models import AutoModelForCausalLM

    path, reference = checkpoints["llama"]
    with pytest.raises(TypeError, match="mmap must be True or False, got 'no'"):
        llm(path, mmap="no")
    with pytest.raises(TypeError, match="tokenizer must be a transformers tokenizer .* got str"):
        llm(path, tokenizer="/a/tokenizer/path")
    with pytest.raises(TypeError, match="not transformers' LlamaForCausalLM: convert it with .*from_hf"):
        LLM(reference)
    # A built model runs where it is: another device is refused (here without CUDA, or on CUDA: it is on the CPU).
    with pytest.raises(ValueError, match=r"^device 'cuda'"):
        LLM(AutoModelForCausalLM.from_pretrained(path), device="cuda")
    engine = llm(path)
    for prompts_given, kind in ((None, "NoneType"), (torch.tensor([1, 2, 3]), "Tensor"), (b"hello", "bytes"),
                                ((p for p in ["a"]), "generator")):
        with pytest.raises(TypeError, match=f"prompts must be a string, .* got {kind}"):
            engine.generate(prompts_given, GREEDY, use_tqdm=False)
    for prompts_given, kind in (([[5, 6], 5], "int"), (["a", None], "NoneType"), ([[5], b"x"], "bytes")):
        with pytest.raises(TypeError, match=rf"prompts\[1\] must be a string, a list of token ids or a dict, got {kind}"):
            engine.generate(prompts_given, GREEDY, use_tqdm=False)
    assert not engine.engine.sequences  # raised before any request was queued
    # a tuple of token ids is one prompt, as a list of them is
    assert token_ids(llm(path).generate((5, 6, 7), GREEDY, use_tqdm=False)) == token_ids(
        llm(path).generate([[5, 6, 7]], GREEDY, use_tqdm=False))
    with pytest.raises(TypeError, match=r"sampling_params must be a SamplingParams or a list of them, got dict; "
                                        r"make one of its settings with SamplingParams\(\*\*settings\)"):
        engine.generate("Hi", {"temperature": 0}, use_tqdm=False)
    for params_given, kind in (((p for p in [GREEDY]), "generator"), ("greedy", "str"), (0.0, "float")):
        with pytest.raises(TypeError, match=f"sampling_params must be a SamplingParams or a list of them, got {kind}$"):
            engine.stream([[5, 6]], params_given).__next__()
    # one element of the wrong kind in a list fails its request alone
    outputs = engine.generate([[5, 6], [5, 7]], [GREEDY, {"temperature": 0}], use_tqdm=False)
    assert outputs[0].error is None
    assert outputs[1].error == "request 1: sampling params must be a SamplingParams, got dict"
    assert not engine.engine.has_unfinished()


def test_an_eos_id_that_is_no_token_id_is_named(checkpoints, tmp_path):
    import json
    import shutil

    path = shutil.copytree(checkpoints["llama"][0], tmp_path / "llama")
    generation = path / "generation_config.json"
    generation.write_text(json.dumps({**json.loads(generation.read_text()), "eos_token_id": "2"}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id must be a token id .* got '2'"):
        llm(path)


@pytest.mark.parametrize("text, message", [
    ("{bad", "malformed JSON"),
    ("[1]", r"not a JSON object \(its top level is list: \[1\]\)"),
    ("null", r"not a JSON object \(its top level is NoneType: None\)"),
    ('{"max_new_tokens": "x"}', "'<=' not supported"),  # a field of the wrong type
])
def test_a_generation_config_that_cannot_be_read_is_named(checkpoints, tmp_path, text, message):
    # Not passed over for the model config's EOS ids, which may not be the ones generate stops at.
    import shutil

    from loaders import CheckpointError

    path = shutil.copytree(checkpoints["llama"][0], tmp_path / "llama")
    (path / "generation_config.json").write_text(text)
    with pytest.raises(CheckpointError, match=r"llama/generation_config.json: " + message):
        llm(path)


@pytest.mark.parametrize("where, eos, bad", [
    ("generation_config.json", 999999, 999999), ("generation_config.json", -1, -1),
    ("generation_config.json", [2, 97], 97), ("the model's config", 97, 97),
])
def test_an_eos_id_outside_the_vocabulary_is_named(checkpoints, tmp_path, where, eos, bad):
    import json
    import shutil

    path = shutil.copytree(checkpoints["llama"][0], tmp_path / "llama")  # vocab_size 97
    file = path / ("config.json" if where == "the model's config" else "generation_config.json")
    if where == "the model's config":
        (path / "generation_config.json").unlink()
    file.write_text(json.dumps({**json.loads(file.read_text()), "eos_token_id": eos}))
    with pytest.raises(ValueError, match=rf"{where}: eos_token_id {bad} is outside the vocabulary \[0, 97\)"):
        llm(path)
    file.write_text(json.dumps({**json.loads(file.read_text()), "eos_token_id": 96}))
    assert llm(path).engine.eos_token_ids == {96}


def test_numpy_integers_and_tuples_are_valid_prompts_and_settings(checkpoints):
    import numpy as np

    path, _ = checkpoints["llama"]
    engine = llm(path)
    as_python = SamplingParams(max_tokens=5, temperature=0.8, seed=7, stop_token_ids=[3])
    as_numpy = SamplingParams(max_tokens=np.int64(5), temperature=np.float32(0.8), seed=np.int64(7),
                              stop_token_ids=(np.int64(3),))
    numpy_prompts = [list(np.array(p, dtype=np.int64)) for p in prompts(2)]
    assert token_ids(engine.generate(numpy_prompts, as_numpy, use_tqdm=False)) == token_ids(
        engine.generate(prompts(2), as_python, use_tqdm=False))
    one_prompt = engine.generate(numpy_prompts[0], as_numpy, use_tqdm=False)  # one prompt, not one per token
    assert len(one_prompt) == 1 and one_prompt[0].prompt_token_ids == prompts(2)[0]


def test_a_cache_that_cannot_hold_one_sequence_of_max_model_len_is_refused(checkpoints):
    path, _ = checkpoints["llama"]  # max_position_embeddings 64
    with pytest.raises(ValueError, match=r"max_model_len=64 does not fit the KV cache: 4 blocks of block_size=4 hold "
                                         r"16 tokens; give at least 16 blocks .* or max_model_len <= 16"):
        llm(path, num_blocks=4)
    with pytest.raises(ValueError, match=r"max_model_len=64 does not fit the KV cache: 2 blocks of block_size=4"):
        llm(path, kv_cache_gib=4096 / (1 << 30))  # the budget's blocks, of 2048 bytes
    engine = llm(path, num_blocks=4, max_model_len=16)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outputs = engine.generate([[5] * 30, [5, 6, 7], [8, 9]], long, use_tqdm=False)
    assert outputs[0].error == ("request 0: the prompt has 30 tokens; max_model_len is 16, which holds the prompt and at "
                                "least one generated token")
    assert [(o.finish_reason, len(o.token_ids)) for o in outputs[1:]] == [("length", 13), ("length", 14)]


@pytest.mark.parametrize("options, message", [
    (dict(num_blocks=10**12), r"the KV cache's 1000000000000 blocks of block_size=4 tokens take \d+ bytes, more than "
                              r"the \d+ bytes of memory left: lower num_blocks, kv_cache_gib or block_size"),
    (dict(block_size=10**9, num_blocks=1), "the KV cache's 1 blocks of block_size=1000000000 tokens take"),
    (dict(block_size=10**9), r"no memory left for the KV cache: a block of block_size=1000000000 tokens takes \d+ "
                             r"bytes, the budget is 1073741824 bytes"),
    (dict(max_num_seqs=10**12), r"max_num_seqs=1000000000000 asks for \d+ bytes of per-sequence buffers, more than"),
], ids=["num_blocks", "block_size", "block_size-budget", "max_num_seqs"])
def test_sizes_past_the_memory_are_named_before_they_are_allocated(checkpoints, options, message):
    path, _ = checkpoints["llama"]
    with pytest.raises(ValueError, match=message):
        llm(path, **options)


def test_streaming_adds_up_to_generate(checkpoints):
    path, _ = checkpoints["qwen2"]
    engine = llm(path)
    batch = prompts(3, seed=11)
    expected = token_ids(engine.generate(batch, GREEDY, use_tqdm=False))
    streamed = [[] for _ in batch]
    finished = set()
    for delta in engine.stream(batch, GREEDY):
        streamed[delta.index] += delta.token_ids
        if delta.finish_reason:
            finished.add(delta.index)
    assert streamed == expected and finished == {0, 1, 2}


def test_calls_made_while_a_stream_is_suspended_each_get_their_own_requests(checkpoints):
    """A generate, or another stream, of the same thread while a stream waits for its reader: every
    step runs all their requests, and each call still gives all of its own tokens and finish."""
    path, _ = checkpoints["qwen2"]
    engine = llm(path)
    first, second, third = prompts(2, seed=21), prompts(3, seed=22), prompts(2, seed=23)
    expected = {name: token_ids(llm(path).generate(batch, GREEDY, use_tqdm=False))
                for name, batch in {"first": first, "second": second, "third": third}.items()}

    def collect(deltas, size):
        tokens, reasons = [[] for _ in range(size)], [None] * size
        for delta in deltas:
            assert reasons[delta.index] is None  # nothing after a request's finish
            tokens[delta.index] += delta.token_ids
            reasons[delta.index] = delta.finish_reason
        return tokens, reasons

    stream = engine.stream(first, GREEDY)
    head = [next(stream)]
    assert token_ids(engine.generate(second, GREEDY, use_tqdm=False)) == expected["second"]
    tokens, reasons = collect([*head, *stream], 2)
    assert tokens == expected["first"] and None not in reasons

    one, other = engine.stream(first, GREEDY), engine.stream(third, GREEDY)
    interleaved = [[], []]
    for deltas in itertools.zip_longest(one, other):
        for side, delta in enumerate(deltas):
            if delta is not None:
                interleaved[side].append(delta)
    assert collect(interleaved[0], 2)[0] == expected["first"]
    assert collect(interleaved[1], 2)[0] == expected["third"]
    assert not engine.engine.sequences and not engine.engine.outputs


@pytest.mark.slow
def test_soak_random_requests(checkpoints):
    """Hundreds of random requests through a small pool: each finishes once, equal to its solo run."""
    path, _ = checkpoints["mistral-window"]
    rng = random.Random(12)
    batch = prompts(200, seed=13, high=30)
    params = [SamplingParams(max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 0.9]), seed=i, ignore_eos=True)
              for i in range(len(batch))]
    engine = llm(path, num_blocks=48, max_num_seqs=16, max_num_batched_tokens=64)
    outputs = engine.generate(batch, params, use_tqdm=False)
    assert [o.request_id for o in outputs] == list(range(200)) and all(o.finished for o in outputs)
    # Both kinds of step happened: preempting ones (taken in first) and ones run ahead of the host.
    assert engine.engine.scheduler.num_preemptions > 0 and engine.engine.run_ahead.num_steps_run_ahead > 0
    solo = llm(path, enable_prefix_caching=False)
    for prompt, param, output in zip(batch, params, outputs):
        assert output.token_ids == token_ids(solo.generate([prompt], param, use_tqdm=False))[0]
        assert len(output.token_ids) == param.max_tokens


@pytest.mark.parametrize("max_batch", [1, 3, 8, 13, 450, 512])
def test_every_batch_has_a_graph_padding_it_by_less_than_8_rows(max_batch):
    from runtime.cuda_graphs import capture_sizes

    sizes = capture_sizes(max_batch)
    assert sizes[-1] == max_batch and sizes == sorted(set(sizes))
    for batch in range(1, max_batch + 1):
        padded = next(size for size in sizes if size >= batch)
        assert padded - batch < 8
        if batch in (1, 2, 4) or batch % 8 == 0 or batch == max_batch:
            assert padded == batch


@pytest.mark.parametrize("max_tokens", [8, 16, 100, 512, 1024])
def test_every_step_has_a_piecewise_size_padding_it_by_less_than_half(max_tokens):
    from runtime.cuda_graphs import piece_sizes

    sizes = piece_sizes(max_tokens)
    assert sizes[-1] == max_tokens and sizes == sorted(set(sizes))
    for tokens in range(1, max_tokens + 1):
        padded = next(size for size in sizes if size >= tokens)
        assert padded < 2 * tokens or padded == sizes[0]


def test_a_graphed_step_stages_its_tokens_padded_with_rows_that_write_nothing():
    from types import SimpleNamespace

    from runtime.cuda_graphs import stage_tokens

    step = SimpleNamespace(input_ids=np.array([5, 6, 7]), sources=np.array([0, 2, 0]), positions=np.array([3, 4, 9]),
                           slots=np.array([35, 36, 80]))
    host = np.full((5, 8), 99, dtype=np.int64)
    stage_tokens(host, step, 4)
    assert host[:4, :4].tolist() == [[5, 6, 7, 0], [0, 2, 0, 0], [3, 4, 9, 0], [35, 36, 80, -1]]
    assert (host[:4, 4:] == 99).all() and (host[4] == 99).all()  # past the size and the fifth row: untouched


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", ["llama", "mistral-window", "qwen3_moe", "deepseek_v3", "gemma2"])
def test_compiling_the_kernels_at_start_runs_on_every_architecture_and_writes_nothing(name, backend):
    """``ModelRunner.compile_kernels`` (run by ``LLM()`` on CUDA, where it compiles the paged prefill
    and argmax kernels): a prompt begun in an earlier step beside a decode goes through each
    architecture's attention (MLA's latent path among them) on either backend, and the KV cache
    keeps every byte it had."""
    from models import AutoModelForCausalLM
    from tests.models.test_deepseek_v3 import VARIANTS, deepseek_hf_model

    configs = {"qwen3_moe": tiny_config("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
               "gemma2": tiny_config("gemma2", head_dim=16, sliding_window=6)}
    hf = deepseek_hf_model(VARIANTS["q_lora-interleaved-groups"]) if name == "deepseek_v3" else hf_model(
        configs.get(name) or ARCHITECTURES[name])
    llm = LLM(AutoModelForCausalLM.from_hf(hf), device="cpu", block_size=4, attention_backend=backend)
    pools = llm.engine.kv_cache.pools
    for pool in pools:
        for part in pool:
            part.normal_()
    before = [[part.clone() for part in pool] for pool in pools]
    llm.engine.runner.compile_kernels()
    assert all(torch.equal(part, kept) for pool, kept_pool in zip(pools, before) for part, kept in zip(pool, kept_pool))
