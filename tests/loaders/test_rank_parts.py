"""A tensor-parallel rank that reads parts of checkpoint tensors: each tensor must have its whole
shape (a larger one's part would load without a word), a wrong one is named once, however many
parts the rank reads of it, and a tensor that cannot be read in parts (dequantised from FP8 blocks)
is loaded once for all of them. One process plays rank 0 of two: loading runs no collective."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import layers.parallel
from loaders import CheckpointError, load_config, load_weights, open_checkpoint, resolve_source
from models.auto import _build_on_meta
from tests.conftest import hf_model, save_checkpoint, tiny_config
from tests.loaders.test_fp8 import QUANTIZATION, write_pair
from tests.models.test_deepseek_v3 import deepseek_config, deepseek_hf_model

EXPERTS = "model.layers.0.mlp.experts"


@pytest.fixture
def rank_0_of_2(monkeypatch):
    """Loads a checkpoint as rank 0 of two, its experts split by rows (``expert_parallel=False``)."""
    monkeypatch.setattr(layers.parallel.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(layers.parallel.dist, "get_world_size", lambda group=None: 2)

    def load(path, edit=None):
        source = resolve_source(str(path))
        config = load_config(source)
        checkpoint = open_checkpoint(source, config)
        if edit is not None:
            edit(checkpoint)
        model, whole_shapes = _build_on_meta(config, str(path), tensor_parallel="group", expert_parallel=False)
        return load_weights(model, checkpoint, torch.float32, torch.device("cpu"), keep_fp8=False,
                            whole_shapes=whole_shapes)

    return load


@pytest.fixture(scope="module")
def stacked_moe(tmp_path_factory):
    """A Qwen3-MoE checkpoint of 4 experts of 32 rows in transformers 5's stacked layout."""
    config = tiny_config("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                         num_hidden_layers=1)
    return save_checkpoint(hf_model(config), tmp_path_factory.mktemp("stacked"), save_original_format=False)


def with_tensor(base, path, name, tensor):
    shutil.copytree(base, path)
    tensors = load_file(base / "model.safetensors")
    tensors[name] = tensor
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_the_stacked_experts_load_as_the_rank_s_rows(stacked_moe, rank_0_of_2):
    stored = load_file(stacked_moe / "model.safetensors")
    experts = rank_0_of_2(stacked_moe).model.layers[0].mlp.experts
    gate_up = stored[f"{EXPERTS}.gate_up_proj"]  # [4, 64, 64]: 32 gate rows, then 32 up rows
    assert torch.equal(experts.gate_up_proj, torch.cat([gate_up[:, :16], gate_up[:, 32:48]], dim=1))
    assert torch.equal(experts.down_proj, stored[f"{EXPERTS}.down_proj"][:, :, :16])


@pytest.mark.parametrize("name, shape, message", [
    # experts of 48 rows where the config says 32: the rank's gate and up rows are in the tensor all the same
    ("gate_up_proj", (4, 96, 64), r"expected shape \(4, 64, 64\) \(of which this rank reads a part\), got \(4, 96, 64\)"),
    ("down_proj", (4, 64, 40), r"expected shape \(4, 64, 32\) \(of which this rank reads a part\), got \(4, 64, 40\)"),
    ("down_proj", (64, 32), r"expected shape \(4, 64, 32\) \(of which this rank reads a part\), got \(64, 32\)"),
])
def test_a_tensor_the_rank_reads_parts_of_must_have_its_whole_shape(stacked_moe, tmp_path, rank_0_of_2, name, shape,
                                                                    message):
    path = with_tensor(stacked_moe, tmp_path / "bad", f"{EXPERTS}.{name}", torch.randn(shape))
    with pytest.raises(CheckpointError, match=message) as error:
        rank_0_of_2(path)
    assert str(error.value).count(f"{EXPERTS}.{name}") == 1  # once, though the rank reads two parts of gate_up


def test_parts_of_a_dequantised_fp8_tensor_are_loaded_once(tmp_path, rank_0_of_2):
    model = deepseek_hf_model(deepseek_config())  # its experts stacked, as transformers 5 holds them
    write_pair(model, {name: tensor.clone() for name, tensor in model.state_dict().items()}, tmp_path,
               {**QUANTIZATION, "weight_block_size": [16, 32]})
    gate_up = "model.layers.1.mlp.experts.gate_up_proj"
    loads = []

    def count_loads(checkpoint):
        ref = checkpoint[gate_up]
        load = ref.load
        ref.load = lambda: loads.append(1) or load()

    fp8 = rank_0_of_2(tmp_path / "fp8", count_loads)
    twin = rank_0_of_2(tmp_path / "twin")
    assert loads == [1]  # the rank's gate rows and up rows cut from one dequantisation
    assert torch.equal(fp8.get_parameter(gate_up), twin.get_parameter(gate_up))
