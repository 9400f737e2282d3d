"""LLaVA 1.5 and LLaVA-NeXT against HuggingFace's in float32: tiny random checkpoints, images of odd
sizes through transformers' image processors and processors, every tensor layout transformers
loads; what the runtime uses (encode_images, the flat forward with image_embeds, over a paged KV
cache in chunks that split an image); and the layer-by-layer diff through the vision tower."""

import re

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models as tokenizer_models, pre_tokenizers

from layers import AttentionMetadata
from layers.attention import select_backend
from layers.vision import select_best_resolution
from models import AutoModelForCausalLM, model_class_for
from models.modeling_llava import image_token_id, under_language_model
from runtime.diff import diff_models
from tests.conftest import INIT_STD, relative_error, tiny_config

TOLERANCE = 1e-5
IMAGE_TOKEN = 96  # the last id of tiny_config's vocabulary of 97
TILE = 28  # the encoder's image size: 2 x 2 patches of 14
PINPOINTS = {
    "wide-and-tall": [[28, 56], [56, 28], [56, 56]],
    "three-in-a-row": [[28, 84], [84, 28], [56, 56], [28, 28]],
    "large": [[56, 84], [84, 56], [84, 84], [28, 56]],
}
# (height, width): odd sizes, wide, tall, square, far from every pinpoint's aspect ratio
IMAGE_SIZES = [(31, 57), (60, 23), (45, 45), (17, 90), (100, 33)]


def vision_config(**overrides):
    fields = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                  image_size=TILE, patch_size=14, hidden_act="quick_gelu", projection_dim=16,
                  initializer_range=INIT_STD, initializer_factor=3.0)
    return transformers.CLIPVisionConfig(**(fields | overrides))


def llava_config(text=None, next_pinpoints=None, **overrides):
    fields = dict(vision_config=vision_config(), text_config=text or tiny_config("llama"),
                  image_token_index=IMAGE_TOKEN)
    fields.update(overrides)
    if next_pinpoints is not None:
        config = transformers.LlavaNextConfig(image_grid_pinpoints=next_pinpoints, **fields)
        config.architectures = ["LlavaNextForConditionalGeneration"]
    else:
        config = transformers.LlavaConfig(**fields)
        config.architectures = ["LlavaForConditionalGeneration"]
    return config


def hf_llava(config, seed=0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norm weights start at one, biases at zero; move them so a skipped one is visible
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.2)
    return model


def tiny_tokenizer():
    """Words w1..w94 and <image> (id 96) of the tiny vocabulary."""
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 95)}, "<pad>": 95, "<image>": IMAGE_TOKEN}
    backend = Tokenizer(tokenizer_models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", extra_special_tokens={"image_token": "<image>"}
    )


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def processor(config, tokenizer):
    """transformers' processor of the checkpoint's kind: it resizes the images and expands each
    <image> to as many image tokens as the image has features."""
    options = dict(tokenizer=tokenizer, patch_size=config.vision_config.patch_size, num_additional_image_tokens=1,
                   vision_feature_select_strategy=config.vision_feature_select_strategy)
    size = dict(size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE})
    if isinstance(config, transformers.LlavaNextConfig):
        images = transformers.LlavaNextImageProcessor(image_grid_pinpoints=config.image_grid_pinpoints, **size)
        return transformers.LlavaNextProcessor(image_processor=images, **options)
    return transformers.LlavaProcessor(image_processor=transformers.CLIPImageProcessor(**size), **options)


def images(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


PROMPTS = ["w1 w2 <image> w3 w4 <image> w5", "<image> w6 w7 w8 w9"]


def inputs(config, tokenizer, sizes=IMAGE_SIZES[:3], prompts=PROMPTS):
    """The processor's input ids [B, T] and image tensors for ``prompts`` with images of ``sizes``."""
    batch = processor(config, tokenizer)(images=images(sizes), text=prompts, return_tensors="pt", padding=True)
    return batch.input_ids, {k: batch[k] for k in ("pixel_values", "image_sizes") if k in batch}


def assert_matches(ours: torch.Tensor, reference: torch.Tensor):
    assert ours.shape == reference.shape
    assert relative_error(ours, reference) <= TOLERANCE
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def checkpoint(reference, path):
    reference.save_pretrained(path)
    return path


VARIANTS = {
    "default": llava_config(),
    "full-gelu-last-layer": llava_config(vision_config=vision_config(hidden_act="gelu"), vision_feature_layer=-1,
                                         vision_feature_select_strategy="full"),
    "feature-layer-list": llava_config(vision_feature_layer=[0, -2]),
    "list-full-no-projector-bias": llava_config(vision_feature_layer=[-3, -1], vision_feature_select_strategy="full",
                                                multimodal_projector_bias=False),
    "qwen3-tied": llava_config(text=tiny_config("qwen3", head_dim=16, tie_word_embeddings=True),
                               vision_feature_layer=[-2, -1]),
    "mistral-window": llava_config(text=tiny_config("mistral", sliding_window=7, head_dim=16)),
    "tied-by-llava-config": llava_config(text=tiny_config("qwen3", head_dim=16), tie_word_embeddings=True),
    # HF's LLaVA does not read its text model's final_logit_softcapping: the logits are not capped
    "gemma2-final-cap-unread": llava_config(text=tiny_config(
        "gemma2", head_dim=16, query_pre_attn_scalar=24, sliding_window=6, attn_logit_softcapping=3.0,
        final_logit_softcapping=4.0)),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_llava_logits_match_huggingface(variant, tokenizer, tmp_path):
    config = VARIANTS[variant]
    reference = hf_llava(config)
    model = AutoModelForCausalLM.from_pretrained(checkpoint(reference, tmp_path / "ckpt"))
    input_ids, images_in = inputs(config, tokenizer)
    with torch.no_grad():
        assert_matches(model(input_ids, **images_in), reference(input_ids=input_ids, **images_in).logits)


NEXT_VARIANTS = {grid: llava_config(text=tiny_config("mistral", head_dim=16), next_pinpoints=pinpoints)
                 for grid, pinpoints in PINPOINTS.items()}
NEXT_PROMPTS = ["w1 <image> w2"] * len(IMAGE_SIZES)  # one image of each size


@pytest.mark.parametrize("grid", NEXT_VARIANTS)
def test_llava_next_logits_and_feature_counts_match_huggingface(grid, tokenizer, tmp_path):
    config = NEXT_VARIANTS[grid]
    reference = hf_llava(config)
    model = AutoModelForCausalLM.from_pretrained(checkpoint(reference, tmp_path / "ckpt"))
    input_ids, images_in = inputs(config, tokenizer, IMAGE_SIZES, NEXT_PROMPTS)
    with torch.no_grad():
        features = model.encode_images(**images_in)
        theirs = reference.model.get_image_features(**images_in).pooler_output
        assert [len(f) for f in features] == [len(f) for f in theirs] == (input_ids == IMAGE_TOKEN).sum(1).tolist()
        for ours_image, their_image in zip(features, theirs):
            assert relative_error(ours_image, their_image) <= TOLERANCE
        assert_matches(model(input_ids, **images_in), reference(input_ids=input_ids, **images_in).logits)


def test_best_resolution_is_huggingface_s():
    from transformers.image_processing_utils import select_best_resolution as hf_select

    for pinpoints in PINPOINTS.values():
        for size in IMAGE_SIZES + [(28, 28), (1, 500), (500, 1)]:
            assert select_best_resolution(size, pinpoints) == tuple(hf_select(size, pinpoints))


def hub_layout(saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The hub's spelling (llava-hf/*) of what transformers 5 saves: the vision tower under vision_model."""
    return {name.replace("vision_tower.", "vision_tower.vision_model.", 1): t for name, t in saved.items()}


@pytest.mark.parametrize("layout", ["saved", "hub", "module-tree"])
@pytest.mark.parametrize("kind", ["llava", "llava-next"])
def test_every_tensor_layout_loads(layout, kind, tokenizer, tmp_path):
    config = llava_config(next_pinpoints=PINPOINTS["wide-and-tall"] if kind == "llava-next" else None)
    reference = hf_llava(config)
    path = checkpoint(reference, tmp_path / "ckpt")
    saved = load_file(path / "model.safetensors")
    assert any(name.startswith("language_model.model.") for name in saved)
    if layout != "saved":
        tensors = hub_layout(saved) if layout == "hub" else {k: v.contiguous() for k, v in reference.state_dict().items()}
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        # transformers itself takes the layout, with the same weights
        again = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
        assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), reference.state_dict().values()))
    model = AutoModelForCausalLM.from_pretrained(path)
    input_ids, images_in = inputs(config, tokenizer)
    with torch.no_grad():
        assert_matches(model(input_ids, **images_in), reference(input_ids=input_ids, **images_in).logits)


def test_model_from_huggingface_in_memory(tokenizer):
    config = llava_config(next_pinpoints=PINPOINTS["large"])
    reference = hf_llava(config)
    model = AutoModelForCausalLM.from_hf(reference)
    input_ids, images_in = inputs(config, tokenizer, IMAGE_SIZES[3:], ["w1 <image> w2 w3", "<image> w4"])
    with torch.no_grad():
        assert_matches(model(input_ids, **images_in), reference(input_ids=input_ids, **images_in).logits)


@pytest.mark.parametrize("kind", ["llava", "llava-next"])
def test_encode_images_and_the_flat_forward_give_the_batched_logits(kind, tokenizer):
    """Two prompts of different lengths in one flat stream, image_embeds holding their images'
    features in order, give each prompt's own [1, T] logits."""
    config = llava_config(next_pinpoints=PINPOINTS["three-in-a-row"] if kind == "llava-next" else None)
    model = AutoModelForCausalLM.from_hf(hf_llava(config))
    prompts = [("w1 <image> w2 w3 <image> w4", IMAGE_SIZES[:2]), ("w5 w6 <image>", IMAGE_SIZES[2:3])]
    single = [inputs(config, tokenizer, sizes, [prompt]) for prompt, sizes in prompts]
    with torch.no_grad():
        expected = [model(ids, **images_in)[0] for ids, images_in in single]
        embeds = torch.cat([f for _, images_in in single for f in model.encode_images(**images_in)])
        flat = torch.cat([ids[0] for ids, _ in single])
        lengths = [len(ids[0]) for ids, _ in single]
        positions = torch.cat([torch.arange(n) for n in lengths])
        logits = model(flat, positions, AttentionMetadata(query_lens=lengths), image_embeds=embeds)
    torch.testing.assert_close(logits, torch.cat(expected), rtol=0, atol=1e-5)


def test_prompt_chunks_through_the_paged_cache_may_split_an_image(tokenizer):
    """A prompt prefilled in two chunks over the paged KV cache, the cut inside its image tokens,
    each chunk given the rows of image_embeds for its own image tokens."""
    config = llava_config(next_pinpoints=PINPOINTS["wide-and-tall"])
    model = AutoModelForCausalLM.from_hf(hf_llava(config))
    input_ids, images_in = inputs(config, tokenizer, IMAGE_SIZES[:1], ["w1 w2 <image> w3 w4"])
    ids = input_ids[0]
    image_rows = (ids == IMAGE_TOKEN).nonzero()[:, 0]
    cut = int(image_rows[len(image_rows) // 2])  # the first chunk ends halfway through the image
    block_size, blocks = 4, -(-len(ids) // 4)
    pools = [tuple(torch.zeros(blocks, block_size, *shape) for shape in entry) for entry in model.kv_cache_spec()]
    model.bind_kv_cache(select_backend("torch", "cpu"), pools)
    with torch.no_grad():
        expected = model(input_ids, **images_in)[0]
        embeds = torch.cat(model.encode_images(**images_in))
        done, chunks = 0, []
        for start, end in ((0, cut), (cut, len(ids))):
            images_here = int((ids[start:end] == IMAGE_TOKEN).sum())
            metadata = AttentionMetadata(
                query_lens=[end - start], context_lens=[start], slot_mapping=torch.arange(start, end),
                block_tables=torch.arange(blocks, dtype=torch.int32)[None], seq_lens=torch.tensor([end], dtype=torch.int32),
                query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
            )
            chunks.append(model(ids[start:end], torch.arange(start, end), metadata,
                                image_embeds=embeds[done : done + images_here]))
            done += images_here
    model.unbind_kv_cache()
    assert done == len(embeds)
    torch.testing.assert_close(torch.cat(chunks), expected, rtol=0, atol=1e-5)


def test_runtime_api_is_the_text_model_s(tokenizer):
    config = llava_config(text=tiny_config("qwen3", head_dim=24, num_hidden_layers=3))
    model = AutoModelForCausalLM.from_hf(hf_llava(config))
    assert model.kv_cache_spec() == [((2, 24), (2, 24))] * 3
    assert model.capturable
    backend = select_backend("torch", "cpu")
    pools = [tuple(torch.zeros(2, 4, *shape) for shape in entry) for entry in model.kv_cache_spec()]
    model.bind_kv_cache(backend, pools)
    assert model.bound_kv_cache is pools
    assert all(layer.self_attn.kv_cache is pool for layer, pool in zip(model.model.language_model.layers, pools))
    model.unbind_kv_cache(pools)
    assert model.bound_kv_cache is None
    assert model.image_token_id == config.image_token_id == IMAGE_TOKEN


def test_the_text_model_s_ignored_tensors_are_found_under_llava_s_prefixes():
    mtp = re.compile(under_language_model(r"^model\.layers\.(3)\."))  # DeepSeek-V3's MTP layer past 3 layers
    assert mtp.search("model.language_model.layers.3.mlp.gate.weight")
    assert mtp.search("language_model.model.layers.3.eh_proj.weight")
    assert not mtp.search("model.language_model.layers.13.mlp.gate.weight")
    assert not mtp.search("model.vision_tower.encoder.layers.3.mlp.fc1.weight")
    assert under_language_model(r"\.rotary_emb\.inv_freq$") == r"\.rotary_emb\.inv_freq$"


def test_image_token_id_of_older_configs():
    class Older:  # a config from before transformers named it image_token_id
        image_token_index = 32000

    assert image_token_id(Older()) == 32000


@pytest.mark.parametrize("kind", ["llava", "llava-next"])
def test_diff_rows_cover_the_vision_tower_and_projector_and_agree(kind, tokenizer):
    config = llava_config(next_pinpoints=PINPOINTS["wide-and-tall"] if kind == "llava-next" else None)
    reference = hf_llava(config)
    model = AutoModelForCausalLM.from_hf(reference)
    input_ids, images_in = inputs(config, tokenizer)
    rows = diff_models(model, reference, input_ids, **images_in)
    paths = [r.path for r in rows]
    tower = "model.vision_tower"
    per_layer = ["layer_norm1", "self_attn", "layer_norm2", "mlp"]
    # vision_feature_layer -2: the last encoder layer is never run
    expected = [f"{tower}.embeddings", f"{tower}.pre_layrnorm"]
    for i in range(2):
        expected += [f"{tower}.encoder.layers.{i}.{name}" for name in per_layer] + [f"{tower}.encoder.layers.{i}"]
    expected += ["model.multi_modal_projector", "model.language_model.embed_tokens"]
    assert paths[: len(expected)] == expected
    assert "model.language_model.layers.1.mlp" in paths and paths[-3:] == ["model.language_model.norm", "lm_head", "logits"]
    assert all(r.ok and r.relative < 1e-5 for r in rows)


def test_bad_inputs_are_named(tokenizer):
    config = llava_config()
    model = AutoModelForCausalLM.from_hf(hf_llava(config))
    input_ids, images_in = inputs(config, tokenizer)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"image_embeds of shape \(4, 64\) for 12 image tokens"):
            model(input_ids, image_embeds=torch.zeros(4, 64))
        with pytest.raises(ValueError, match=r"pixel_values must be \[images, channels, 28, 28\], got shape \(3, 3, 56, 28\)"):
            model(input_ids, pixel_values=torch.zeros(3, 3, 56, 28))
    next_config = llava_config(next_pinpoints=PINPOINTS["wide-and-tall"])
    next_model = AutoModelForCausalLM.from_hf(hf_llava(next_config))
    with pytest.raises(ValueError, match="LLaVA-NeXT needs image_sizes"):
        next_model.encode_images(torch.zeros(1, 3, 3, TILE, TILE))


def test_full_feature_strategy_with_next_is_refused():
    config = llava_config(next_pinpoints=PINPOINTS["wide-and-tall"], vision_feature_select_strategy="full")
    with torch.device("meta"), pytest.raises(ValueError, match="'full' is not supported with LLaVA-NeXT"):
        model_class_for(config)(config)


def test_unsupported_vision_tower_is_named():
    config = llava_config(vision_config=transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=48,
                                                                        num_hidden_layers=1, num_attention_heads=4))
    with torch.device("meta"), pytest.raises(ValueError, match="vision_config.model_type 'siglip_vision_model'"):
        model_class_for(config)(config)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llava", "llava-next"])
def test_float32_on_cuda_matches_huggingface(kind, tokenizer):
    """The vision tower and the decoder through zoo's CUDA ops (Triton norms, fused q/k/v, SDPA
    without the causal mask) against HF on the same GPU; cuBLAS sums in other orders than the
    CPU's, so the bar is 1e-4."""
    config = llava_config(next_pinpoints=PINPOINTS["large"] if kind == "llava-next" else None)
    reference = hf_llava(config).cuda()
    model = AutoModelForCausalLM.from_hf(reference)
    prompts = ["w1 <image> w2", "w3 <image> w4 <image>"]
    input_ids, images_in = inputs(config, tokenizer, IMAGE_SIZES[2:], prompts)
    input_ids, images_in = input_ids.cuda(), {k: v.cuda() for k, v in images_in.items()}
    with torch.no_grad():
        ours, theirs = model(input_ids, **images_in), reference(input_ids=input_ids, **images_in).logits
    assert relative_error(ours, theirs) <= 1e-4
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
