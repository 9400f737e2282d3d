"""The layer-by-layer diff against HuggingFace: its rows, its verdicts and the CLI table."""

import torch

from runtime.diff import diff_checkpoint, diff_models, format_rows, load_reference
from models import AutoModelForCausalLM
from runtime.cli import main
from tests.conftest import tiny_config

TOKENS = torch.tensor([[5, 17, 3, 88, 42, 7, 1, 60, 23, 9, 14]])


def test_rows_cover_every_block_and_agree(make_checkpoint):
    path, _ = make_checkpoint(tiny_config("qwen3", head_dim=16))
    rows = diff_checkpoint(path, input_ids=TOKENS)
    per_layer = ["input_layernorm", "self_attn", "post_attention_layernorm", "mlp"]
    expected = ["model.embed_tokens"]
    for i in range(2):
        expected += [f"model.layers.{i}.{name}" for name in per_layer] + [f"model.layers.{i}"]
    expected += ["model.norm", "lm_head"]
    assert [r.path for r in rows] == expected
    assert all(r.ok for r in rows)
    assert rows[-1].shape == (1, 11, 97)
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
    assert "all 13 modules within tolerance" in out


def test_cli_reports_bad_checkpoint(tmp_path, capsys):
    assert main(["diff", str(tmp_path / "nothing-here")]) == 2
    assert "no such checkpoint directory or file" in capsys.readouterr().err
