"""The layer-by-layer diff against HuggingFace: its rows, its verdicts and the CLI table, for a
cache-free forward and for the runtime's prefill and decode steps."""

import pytest
import torch

import layers.attention
from models import AutoModelForCausalLM
from runtime.cli import main
from runtime.diff import diff_checkpoint, diff_models, diff_runtime, format_rows, load_reference
from tests.conftest import tiny_config

TOKENS = torch.tensor([[5, 17, 3, 88, 42, 7, 1, 60, 23, 9, 14]])


def test_rows_cover_every_block_and_agree(make_checkpoint):
    path, _ = make_checkpoint(tiny_config("qwen3", head_dim=16))
    rows = diff_checkpoint(path, input_ids=TOKENS)
    per_layer = ["input_layernorm", "self_attn", "post_attention_layernorm", "mlp"]
    expected = ["model.embed_tokens"]
    for i in range(2):
        expected += [f"model.layers.{i}.{name}" for name in per_layer] + [f"model.layers.{i}"]
    expected += ["model.norm", "lm_head", "logits"]
    assert [r.path for r in rows] == expected
    assert all(r.ok for r in rows)
    assert rows[-1].shape == rows[-2].shape == (1, 11, 97)
    assert all(r.relative < 1e-5 and r.cosine > 0.999999 for r in rows)


def test_first_divergent_module_is_marked(make_checkpoint):
    path, _ = make_checkpoint(tiny_config("llama"))
    model = AutoModelForCausalLM.from_pretrained(path)
    reference = load_reference(path, torch.float32, "cpu")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1.01)
    rows = diff_models(model, reference, TOKENS)
    bad = [r.path for r in rows if not r.ok]
    assert bad[0] == "model.layers.1.mlp"
    assert all(r.ok for r in rows[: [r.path for r in rows].index("model.layers.1.mlp")])
    table = format_rows(rows)
    assert "model.layers.1.mlp" in table.split("<-- first over tolerance")[0].splitlines()[-1]
    assert f"{len(rows)} modules compared, {len(bad)} over tolerance" in table


def test_cli_prints_table(make_checkpoint, capsys):
    path, _ = make_checkpoint(tiny_config("mistral", sliding_window=4))
    assert main(["diff", str(path), "--token-ids", ",".join(map(str, TOKENS[0].tolist()))]) == 0
    out = capsys.readouterr().out
    assert "model.layers.1.self_attn" in out and "cosine" in out
    assert "all 14 modules within tolerance" in out


def test_cli_reports_bad_checkpoint(tmp_path, capsys):
    assert main(["diff", str(tmp_path / "nothing-here")]) == 2
    assert "no such checkpoint directory or file" in capsys.readouterr().err


def test_a_change_after_the_lm_head_shows_in_the_logits_row(make_checkpoint, monkeypatch):
    path, _ = make_checkpoint(tiny_config("llama"))
    model = AutoModelForCausalLM.from_pretrained(path)
    reference = load_reference(path, torch.float32, "cpu")
    forward = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda *args, **kwargs: 30 * torch.tanh(forward(*args, **kwargs) / 30))
    rows = diff_models(model, reference, TOKENS)
    assert [r.path for r in rows if not r.ok] == ["logits"]


def test_runtime_rows_cover_the_prefill_and_each_decode_step(make_checkpoint):
    path, _ = make_checkpoint(tiny_config("qwen3", head_dim=16))
    rows = diff_checkpoint(path, input_ids=TOKENS, runtime_steps=3)
    blocks = [r.path for r in diff_checkpoint(path, input_ids=TOKENS)]
    assert [r.path for r in rows] == [f"{step}/{block}" for step in ("prefill", "decode 1", "decode 2", "decode 3")
                                      for block in blocks]
    assert all(r.ok for r in rows), format_rows(rows)
    shapes = {r.path: r.shape for r in rows}
    assert shapes["prefill/model.norm"] == (1, 11, 64) and shapes["prefill/logits"] == (1, 1, 97)
    assert shapes["decode 3/model.norm"] == (1, 1, 64) and shapes["decode 3/logits"] == (1, 1, 97)


def test_a_decode_path_bug_passes_the_cache_free_diff_and_fails_the_runtime_diff(make_checkpoint, monkeypatch):
    """The decode attention misses the key its own token just wrote (as a stale cache would)."""
    decode_key_slots = layers.attention.decode_key_slots

    def without_the_newest_key(block_tables, seq_lens, block_size, window):
        slots, mask, attending = decode_key_slots(block_tables, seq_lens, block_size, window)
        mask = mask.clone()
        mask[torch.arange(len(seq_lens)), seq_lens.long() - 1] = False
        return slots, mask, attending

    monkeypatch.setattr(layers.attention, "decode_key_slots", without_the_newest_key)
    path, _ = make_checkpoint(tiny_config("llama"))
    assert all(r.ok for r in diff_checkpoint(path, input_ids=TOKENS))
    rows = diff_checkpoint(path, input_ids=TOKENS, runtime_steps=2)
    first_bad = next(r for r in rows if not r.ok)
    assert first_bad.path == "decode 1/model.layers.0.self_attn"
    assert all(r.ok for r in rows if r.path.startswith("prefill/"))
    table = format_rows(rows)
    assert "decode 1/model.layers.0.self_attn" in table.split("<-- first over tolerance")[0].splitlines()[-1]


def test_cli_runtime_mode(make_checkpoint, capsys):
    path, _ = make_checkpoint(tiny_config("llama"))
    assert main(["diff", str(path), "--token-ids", ",".join(map(str, TOKENS[0].tolist())), "--runtime", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "prefill and 2 decode steps" in out and "decode 2/logits" in out
    assert "all 42 modules within tolerance" in out


def test_runtime_diff_takes_one_prompt(make_checkpoint):
    path, _ = make_checkpoint(tiny_config("llama"))
    model = AutoModelForCausalLM.from_pretrained(path)
    with pytest.raises(ValueError, match=r"one prompt, input_ids \[1, T\]; got shape \(2, 11\)"):
        diff_runtime(model, load_reference(path, torch.float32, "cpu"), TOKENS.repeat(2, 1))


@pytest.mark.parametrize("runtime_steps", [None, 2], ids=["cache-free", "runtime"])
def test_token_ids_outside_the_vocabulary_are_named_on_either_path(make_checkpoint, runtime_steps):
    path, _ = make_checkpoint(tiny_config("llama"))
    with pytest.raises(ValueError, match=r"input_ids hold ids outside \[0, 97\): min 5, max 500"):
        diff_checkpoint(path, input_ids=torch.tensor([[5, 500]]), runtime_steps=runtime_steps)


@pytest.mark.parametrize("arguments, error, message", [
    (dict(runtime_steps=2.5), ValueError, r"runtime_steps must be None or an integer >= 1, got 2.5"),
    (dict(runtime_steps=0), ValueError, r"runtime_steps must be None or an integer >= 1, got 0"),
    (dict(atol="1e-3"), ValueError, r"atol must be None or a finite number >= 0, got '1e-3'"),
    (dict(rtol=-1), ValueError, r"rtol must be None or a finite number >= 0, got -1"),
    (dict(input_ids=[[1, 2, 3]]), TypeError, r"input_ids must be a torch tensor of token ids, got list"),
    (dict(prompt=None), TypeError, r"prompt must be a string where no input_ids are given, got NoneType"),
], ids=str)
def test_bad_diff_arguments_are_named_before_the_models_load(arguments, error, message, monkeypatch):
    import runtime.diff

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(runtime.diff, "tokenize", no_loading)
    monkeypatch.setattr(runtime.diff.AutoModelForCausalLM, "from_pretrained", no_loading)
    with pytest.raises(error, match=message):
        diff_checkpoint("unused", **arguments)


def test_a_runtime_diff_past_max_position_embeddings_names_the_limit(make_checkpoint):
    path, _ = make_checkpoint(tiny_config("llama", max_position_embeddings=16))
    with pytest.raises(ValueError, match="a prompt of 14 tokens, 2 decode steps and the token the last samples take 17 "
                                         "positions; the model's max_position_embeddings is 16"):
        diff_checkpoint(path, input_ids=torch.arange(1, 15)[None], runtime_steps=2)
    assert all(r.ok for r in diff_checkpoint(path, input_ids=torch.arange(1, 14)[None], runtime_steps=2))
