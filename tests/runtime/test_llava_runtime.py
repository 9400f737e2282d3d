"""Images through the runtime, on tiny random LLaVA checkpoints in float32: greedy generation
token-identical to HuggingFace's generate, alone and batched with text requests, through chunked
prefill, prefix caching and preemption; chat with content parts; bad images failing their own
request."""

import io

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from runtime import LLM, SamplingParams
from tests.conftest import INIT_STD, hf_model, save_checkpoint, tiny_config

IMAGE_TOKEN_ID = 3
EOS_ID = 2
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
PROMPT = "USER: <image>\nWhat is shown? ASSISTANT:"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %} "
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def tiny_tokenizer():
    """One token per printable character, BOS, EOS and the image placeholder."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": EOS_ID, "<image>": IMAGE_TOKEN_ID, "\n": 4}
    for code in range(32, 127):
        vocab[chr(code)] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        extra_special_tokens={"image_token": "<image>"},
    )


def text_config():
    return transformers.LlamaConfig(
        vocab_size=112, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=INIT_STD, bos_token_id=1,
        eos_token_id=EOS_ID, tie_word_embeddings=False,
    )


def vision_config(image_size):
    return transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=image_size,
        patch_size=14, projection_dim=32,
    )


def make_llava(path, strategy="default"):
    """LLaVA 1.5 with 56-pixel images: 16 image tokens each (17 with the "full" strategy)."""
    config = transformers.LlavaConfig(
        vision_config=vision_config(56), text_config=text_config(), image_token_id=IMAGE_TOKEN_ID,
        vision_feature_layer=-2, vision_feature_select_strategy=strategy,
    )
    image_processor = transformers.CLIPImageProcessor(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    processor = transformers.LlavaProcessor(
        image_processor=image_processor, tokenizer=tiny_tokenizer(), patch_size=14, chat_template=CHAT_TEMPLATE,
        vision_feature_select_strategy=strategy, num_additional_image_tokens=1,
    )
    return save(transformers.LlavaForConditionalGeneration, config, processor, path)


def make_llava_next(path):
    """LLaVA-NeXT with 28-pixel tiles on grids of up to 2x2: token counts that vary with the image's shape."""
    config = transformers.LlavaNextConfig(
        vision_config=vision_config(28), text_config=text_config(), image_token_id=IMAGE_TOKEN_ID,
        vision_feature_layer=-2, vision_feature_select_strategy="default",
        image_grid_pinpoints=[[28, 56], [56, 28], [56, 56]],
    )
    image_processor = transformers.LlavaNextImageProcessor(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
        image_grid_pinpoints=[[28, 56], [56, 28], [56, 56]],
    )
    processor = transformers.LlavaNextProcessor(
        image_processor=image_processor, tokenizer=tiny_tokenizer(), patch_size=14, chat_template=CHAT_TEMPLATE,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
    )
    return save(transformers.LlavaNextForConditionalGeneration, config, processor, path)


def save(model_class, config, processor, path):
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():  # CLIP's init is tiny: larger weights make every image change the tokens
        for name, param in model.named_parameters():
            if "vision_tower" in name or "projector" in name:
                param.normal_(0, INIT_STD if param.dim() > 1 else 0.5)
    save_checkpoint(model, path)
    processor.save_pretrained(path)
    return path, model, processor


def image(seed, width=40, height=30, mode="RGB"):
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels).convert(mode)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return make_llava(tmp_path_factory.mktemp("llava"))


def llm(path, **options):
    options.setdefault("block_size", 4)
    return LLM(str(path), device="cpu", **options)


def hf_generate(model, processor, text, images, max_tokens=GREEDY.max_tokens):
    """HF's greedy tokens for one prompt, cut after the first EOS as the runtime stops there."""
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    tokens = out[0, inputs["input_ids"].shape[1] :].tolist()
    return tokens[: tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens


def token_ids(outputs):
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return [o.token_ids for o in outputs]


def test_an_image_request_generates_what_hf_generates(llava):
    path, model, processor = llava
    img = image(0)
    [output] = llm(path).generate([{"prompt": PROMPT, "multi_modal_data": {"image": img}}], GREEDY)
    expected = processor(text=PROMPT, images=img).input_ids[0]
    assert output.prompt == PROMPT and output.prompt_token_ids == expected
    assert output.prompt_token_ids.count(IMAGE_TOKEN_ID) == 16
    assert token_ids([output]) == [hf_generate(model, processor, PROMPT, [img])]
