"""Images through the runtime, on tiny random LLaVA checkpoints in float32: greedy generation
token-identical to HuggingFace's generate, alone and batched with text requests, through chunked
prefill, prefix caching and preemption; chat with content parts; bad images failing their own
request."""

import io
import re

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


def test_image_requests_batched_with_text_requests_generate_what_each_generates_alone(llava):
    path, model, processor = llava
    first, second, third = image(1), image(2, 64, 20), image(3, 25, 50)
    two_images = "USER: <image> and <image>\nSame? ASSISTANT:"
    tokenizer = processor.tokenizer
    requests = [
        {"prompt": PROMPT, "multi_modal_data": {"image": [first]}},
        "USER: no image here ASSISTANT:",
        {"prompt_token_ids": tokenizer(two_images).input_ids, "multi_modal_data": {"image": [second, third]}},
        tokenizer("Just text").input_ids,
    ]
    outputs = llm(path, max_num_seqs=4).generate(requests, GREEDY)
    # Token-id prompts are expanded as the processor expands text.
    assert outputs[2].prompt_token_ids == processor(text=two_images, images=[second, third]).input_ids[0]
    assert token_ids(outputs) == [
        hf_generate(model, processor, PROMPT, [first]),
        hf_generate(model, processor, "USER: no image here ASSISTANT:", []),
        hf_generate(model, processor, two_images, [second, third]),
        hf_generate(model, processor, "Just text", []),
    ]


def counting_encodes(llm_):
    """Wrap the model's encode_images to count its calls."""
    calls = []
    encode = llm_.model.encode_images

    def counted(pixel_values, image_sizes=None):
        calls.append(len(pixel_values))
        return encode(pixel_values, image_sizes)

    llm_.model.encode_images = counted
    return calls


def test_chunks_that_split_the_image_tokens_generate_what_hf_generates(llava):
    path, model, processor = llava
    images = [image(4), image(5, 30, 60)]
    requests = [{"prompt": PROMPT, "multi_modal_data": {"image": img}} for img in images]
    engine = llm(path, max_num_batched_tokens=5, enable_prefix_caching=False)
    calls = counting_encodes(engine)
    outputs = engine.generate(requests, GREEDY)
    assert token_ids(outputs) == [hf_generate(model, processor, PROMPT, [img]) for img in images]
    assert calls == [1, 1]  # the vision tower ran once per request, at its first image token


def test_features_are_let_go_once_the_step_computes_the_last_image_token(llava):
    path, _, _ = llava
    engine = llm(path, max_num_batched_tokens=8, enable_prefix_caching=False).engine
    engine.add_request(0, {"prompt": PROMPT, "multi_modal_data": {"image": image(6)}}, GREEDY)
    seq = engine.sequences[0]
    last_image_token = int(seq.images.token_positions[-1])
    held = []
    while seq.num_computed_tokens <= last_image_token:
        engine.step()
        held.append(seq.image_features is not None)
    assert held == [True, True, False]  # 6 text and image tokens 0-1, image tokens 2-9, image tokens 10-15


def test_prefix_cache_shares_blocks_of_the_same_image_and_never_of_another(llava):
    path, model, processor = llava
    engine = llm(path)
    same, other = image(7), image(8)  # the same size and mode: only their pixels differ
    prompt_len = len(processor(text=PROMPT, images=same).input_ids[0])
    first_image_token = PROMPT.index("<image>")  # one token per character before it
    calls = counting_encodes(engine)
    [first] = engine.generate([{"prompt": PROMPT, "multi_modal_data": {"image": same}}], GREEDY)
    [again] = engine.generate([{"prompt": PROMPT, "multi_modal_data": {"image": same}}], GREEDY)
    [different] = engine.generate([{"prompt": PROMPT, "multi_modal_data": {"image": other}}], GREEDY)
    assert again.num_cached_tokens == (prompt_len - 1) // 4 * 4  # every full block but the one to compute
    assert different.num_cached_tokens == first_image_token // 4 * 4  # only the blocks before the image
    assert calls == [1, 1]  # the cached request computed no image token: its images were not encoded
    expected_same, expected_other = (hf_generate(model, processor, PROMPT, [img]) for img in (same, other))
    assert expected_same != expected_other  # the image decides the tokens
    assert token_ids([first, again, different]) == [expected_same, expected_same, expected_other]


def test_preempted_image_requests_are_recomputed_to_the_same_tokens(llava):
    path, model, processor = llava
    images = [image(9), image(10), image(11, 20, 70)]
    requests = [{"prompt": PROMPT, "multi_modal_data": {"image": img}} for img in images]
    engine = llm(path, num_blocks=16, max_model_len=64, max_num_batched_tokens=12, enable_prefix_caching=False)
    outputs = engine.generate(requests, GREEDY)
    assert engine.engine.scheduler.num_preemptions > 0
    assert token_ids(outputs) == [hf_generate(model, processor, PROMPT, [img]) for img in images]


def test_chat_renders_content_parts_through_the_processors_template(llava):
    path, model, processor = llava
    img = image(12)
    with_image = [{"role": "user", "content": [{"type": "image", "image": img},
                                               {"type": "text", "text": "What is shown?"}]}]
    text_only = [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    outputs = llm(path).chat([with_image, text_only], GREEDY)
    expected = []
    for conversation in (with_image, text_only):
        inputs = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                               return_dict=True, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
        expected.append(out[0, inputs["input_ids"].shape[1] :].tolist())
        assert outputs[len(expected) - 1].prompt_token_ids == inputs["input_ids"][0].tolist()
    expected = [tokens[: tokens.index(EOS_ID) + 1] if EOS_ID in tokens else tokens for tokens in expected]
    assert token_ids(outputs) == expected


@pytest.mark.parametrize("variant", ["full-strategy", "next"])
def test_other_variants_generate_what_hf_generates(variant, tmp_path):
    path, model, processor = (make_llava(tmp_path, "full") if variant == "full-strategy"
                              else make_llava_next(tmp_path))
    images = [image(13, 50, 20), image(14, 20, 50), image(15, 33, 33)]
    requests = [{"prompt": PROMPT, "multi_modal_data": {"image": img}} for img in images]
    outputs = llm(path, max_num_batched_tokens=16).generate(requests + ["USER: hi ASSISTANT:"], GREEDY)
    counts = [o.prompt_token_ids.count(IMAGE_TOKEN_ID) for o in outputs[:3]]
    assert counts == [processor(text=PROMPT, images=img).input_ids[0].count(IMAGE_TOKEN_ID) for img in images]
    assert token_ids(outputs) == [hf_generate(model, processor, PROMPT, [img]) for img in images] + [
        hf_generate(model, processor, "USER: hi ASSISTANT:", [])]


def test_block_keys_name_the_images_whose_tokens_a_range_holds():
    from runtime.multimodal import ImageInputs

    # Image a at prompt positions 2-4, image b at 5-6 and 9.
    inputs = ImageInputs(torch.zeros(2, 3, 4, 4), None, [b"a", b"b"], np.array([2, 3, 4, 5, 6, 9]), np.array([3, 6]))
    assert [inputs.digests_in(start, start + 4) for start in (0, 4, 8, 12)] == [(b"a",), (b"a", b"b"), (b"b",), ()]
    assert inputs.feature_rows(4, 8) == (2, 5) and inputs.feature_rows(0, 2) == (0, 0)


def test_image_digests_cover_what_makes_the_pixels():
    from runtime.multimodal import image_digest

    indexed = Image.fromarray(np.arange(12, dtype=np.uint8).reshape(3, 4)).convert("P")
    repainted = indexed.copy()
    repainted.putpalette([(7 * i) % 256 for i in range(768)])  # the same indices, other colours
    assert image_digest(0, indexed) == image_digest(0, indexed.copy()) != image_digest(0, repainted)
    assert image_digest(0, image(0)) != image_digest(0, image(0).convert("RGBA"))


def truncated_png():
    buffer = io.BytesIO()
    image(16).save(buffer, "PNG")
    return Image.open(io.BytesIO(buffer.getvalue()[:200]))  # the header reads; the pixels do not


def test_bad_images_fail_their_own_request_and_the_others_complete(llava):
    path, model, processor = llava
    good = image(17)
    two_placeholders = "USER: <image><image> ASSISTANT:"
    bad = {
        "image 0 cannot be decoded: image file is truncated": {"image": truncated_png()},
        r"image 0 is empty \(0x30 pixels\)": {"image": Image.new("RGB", (0, 30))},
        "image 0 is a ndarray, not a PIL.Image.Image": {"image": np.zeros((30, 30, 3), np.uint8)},
        "multi_modal_data is a dict with the one key 'image'": {"video": [good]},
        r"the prompt has 2 image placeholders \('<image>'\) but multi_modal_data has 1 images": {"image": good},
    }
    requests = [{"prompt": PROMPT, "multi_modal_data": data} for data in bad.values()]
    requests[-1]["prompt"] = two_placeholders
    others = {
        "image 1 has mode 'F'; the modes taken are 1, L, LA, P, PA, RGB, RGBA, RGBX, CMYK, YCbCr":
            {"prompt": two_placeholders, "multi_modal_data": {"image": [good, image(18).convert("F")]}},
        r"the prompt has 0 image placeholders \('<image>'\) but multi_modal_data has 1 images":
            {"prompt_token_ids": [5, 6, 7], "multi_modal_data": {"image": good}},
        r"the prompt has 1 image placeholders and no image is given": PROMPT,
        r"the prompt 'USER: <image>\\ud800' is not valid Unicode":
            {"prompt": "USER: <image>\ud800", "multi_modal_data": {"image": good}},
    }
    requests += list(others.values())
    outputs = llm(path).generate([{"prompt": PROMPT, "multi_modal_data": {"image": good}}, *requests], GREEDY)
    assert token_ids(outputs[:1]) == [hf_generate(model, processor, PROMPT, [good])]
    for index, (output, message) in enumerate(zip(outputs[1:], [*bad, *others]), start=1):
        assert output.finish_reason == "error" and output.token_ids == []
        assert output.error.startswith(f"request {index}: ")
        assert re.search(message, output.error), output.error


def test_images_for_a_model_that_takes_none_or_without_a_processor_fail_their_request(llava, tmp_path):
    from models import AutoModelForCausalLM

    llama = save_checkpoint(hf_model(tiny_config("llama")), tmp_path / "llama")
    request = {"prompt_token_ids": [5, 6, 7], "multi_modal_data": {"image": image(19)}}
    text_model = LLM(str(llama), device="cpu")
    failed, completed = text_model.generate([request, [5, 6, 7]], GREEDY)
    assert failed.error == "request 0: multi_modal_data is given, but LlamaForCausalLM takes no images"
    assert completed.error is None and len(completed.token_ids) == GREEDY.max_tokens

    path, _, processor = llava
    model = AutoModelForCausalLM.from_pretrained(str(path))
    [output] = LLM(model, tokenizer=processor.tokenizer).generate([{**request, "prompt_token_ids": [3]}], GREEDY)
    assert output.error == "request 0: multi_modal_data is given, but the checkpoint has no image processor"


@pytest.mark.parametrize("text, message", [
    ("[1]", r"not a JSON object \(its top level is list: \[1\]\)"),
    ('"x"', r"not a JSON object \(its top level is str: 'x'\)"),
    ("{", "malformed JSON"),
])
def test_a_processor_file_that_cannot_be_read_is_named(llava, tmp_path, text, message):
    import shutil

    from loaders import CheckpointError, load_processor

    path = shutil.copytree(llava[0], tmp_path / "llava")
    assert load_processor(path) is not None
    (path / "preprocessor_config.json").write_text(text)
    with pytest.raises(CheckpointError, match=r"llava/preprocessor_config\.json: " + message):
        load_processor(path)


def test_a_preempted_image_request_lets_its_features_go_and_still_gives_hfs_tokens(llava):
    path, model, processor = llava
    engine = llm(path, num_blocks=10, max_model_len=40, max_num_batched_tokens=6, enable_prefix_caching=False).engine
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompt = "U: <image> A:"  # short: both requests fit at once, and then their decodes run out of blocks
    outputs = [engine.add_request(i, {"prompt": prompt, "multi_modal_data": {"image": image(40 + i)}}, params)
               for i in range(2)]
    held_while_waiting = []
    while engine.has_unfinished():
        engine.step()
        held_while_waiting += [seq.request_id for seq in engine.scheduler.waiting if seq.image_features is not None]
    assert engine.scheduler.num_preemptions > 0 and held_while_waiting == []
    assert token_ids(outputs) == [hf_generate(model, processor, prompt, [image(40 + i)], 16) for i in range(2)]


def test_zoo_generate_takes_images(llava, tmp_path, capsys):
    from runtime.cli import main

    path, model, processor = llava
    img = image(20)
    img.save(tmp_path / "image.png")
    command = ["generate", "--model", str(path), "--max-tokens", str(GREEDY.max_tokens)]
    assert main([*command, "--image", str(tmp_path / "image.png"), PROMPT]) == 0
    expected = processor.tokenizer.decode(hf_generate(model, processor, PROMPT, [img]), skip_special_tokens=True)
    assert capsys.readouterr().out == f"{PROMPT}{expected}\n"

    (tmp_path / "text.png").write_text("not an image")
    assert main([*command, "--image", str(tmp_path / "text.png"), PROMPT]) == 2
    assert f"--image {tmp_path / 'text.png'}: cannot identify image file" in capsys.readouterr().err


@pytest.mark.gpu
def test_image_requests_on_cuda_generate_what_hf_generates(llava):
    """Image steps run eagerly with the triton backend; the decode steps between them replay CUDA graphs."""
    path, model, processor = llava
    images = [image(21), image(22, 70, 25)]
    requests = [{"prompt": PROMPT, "multi_modal_data": {"image": img}} for img in images] + ["USER: hi ASSISTANT:"]
    expected = [hf_generate(model, processor, PROMPT, [img]) for img in images]
    expected.append(hf_generate(model, processor, "USER: hi ASSISTANT:", []))
    for options in ({}, {"enforce_eager": True}, {"max_num_batched_tokens": 7}):
        engine = LLM(str(path), dtype="float32", device="cuda", block_size=16, **options)
        assert (engine.engine.runner.graphs is None) == bool(options.get("enforce_eager"))
        assert token_ids(engine.generate(requests, GREEDY)) == expected, options


@pytest.mark.gpu
def test_no_image_request_waits_for_a_kernel_to_compile(llava, monkeypatch):
    """After ``LLM()`` has started, image requests (their vision tower and projector run eagerly in the
    step that reaches their image tokens) chunked over steps beside text requests and decodes, in
    bfloat16, make Triton compile nothing."""
    from tests.runtime.test_gpu_runtime import triton_compiles

    path, _, _ = llava
    engine = LLM(str(path), dtype="bfloat16", device="cuda", block_size=16, max_num_seqs=8, max_num_batched_tokens=24)
    compiled = triton_compiles(monkeypatch)
    requests = [{"prompt": PROMPT, "multi_modal_data": {"image": image(30 + i, 40 + 9 * i, 30)}} if i % 2 else
                f"USER: say {i} ASSISTANT:" for i in range(8)]
    outputs = engine.generate(requests, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert [len(ids) for ids in token_ids(outputs)] == [12] * 8
    assert compiled == []


def test_zoo_diff_takes_images(llava, tmp_path, capsys):
    from runtime.cli import main

    path, _, _ = llava
    image(23).save(tmp_path / "image.png")
    assert main(["diff", str(path), "--prompt", PROMPT, "--image", str(tmp_path / "image.png")]) == 0
    table = capsys.readouterr().out
    for row in ("model.vision_tower.encoder.layers.0 ", "model.multi_modal_projector ",
                "model.language_model.layers.1 ", "logits "):
        assert row in table
    assert table.splitlines()[-1] == "all 22 modules within tolerance"
    # The prompt's placeholder without its image: named, not diffed as a text token.
    assert main(["diff", str(path), "--prompt", PROMPT]) == 2
    assert capsys.readouterr().err.strip() == (
        f"zoo diff: error: the input holds 1 image placeholders (id {IMAGE_TOKEN_ID}) and no image: give the images "
        "(zoo diff --image)")


def test_a_generated_image_token_id_is_a_token_in_a_step_with_image_tokens(tmp_path):
    """A model that generates the image token's id: its decodes share steps with another request's
    prompt image tokens, and the features go to the prompt's rows only, as HF embeds a generated
    image token as a token."""
    path, model, processor = make_llava(tmp_path / "ckpt")
    with torch.no_grad():  # the image token's id wins every greedy step
        model.lm_head.weight[IMAGE_TOKEN_ID] = model.model.language_model.norm.weight.sign() * 5
    save_checkpoint(model, path)
    processor.save_pretrained(path)
    llm = LLM(str(path), device="cpu", block_size=4, max_num_batched_tokens=6)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    requests = ["USER: hi", {"prompt": PROMPT, "multi_modal_data": {"image": image(1)}}]
    outputs = llm.generate(requests, params, use_tqdm=False)
    assert [o.error for o in outputs] == [None, None]
    assert IMAGE_TOKEN_ID in outputs[0].token_ids
    assert outputs[0].token_ids == hf_generate(model, processor, "USER: hi", [], 6)
    assert outputs[1].token_ids == hf_generate(model, processor, PROMPT, [image(1)], 6)


def test_the_readmes_image_snippet_runs_on_a_llava_checkpoint(llava, tmp_path, capsys):
    """The README's image requests as pasted, but for the checkpoint's name and the image's file, and the
    chat's answer kept to be checked: both requests succeed and their texts are what it prints."""
    from tests.test_readme import snippet

    image(1).save(tmp_path / "photo.png")
    code = snippet("multi_modal_data").replace('"llava-hf/llava-1.5-7b-hf"', repr(str(llava[0])))
    chat_line = "print(llm.chat([messages])[0].text)"
    assert chat_line in code
    code = code.replace(chat_line, "answer = llm.chat([messages])[0]\nprint(answer.text)")
    namespace = {}
    exec(code.replace('"photo.jpg"', repr(str(tmp_path / "photo.png"))), namespace)  # noqa: S102 (the README's own code)
    generated, answer = namespace["outs"][0], namespace["answer"]
    assert generated.error is None and answer.error is None
    assert generated.token_ids and answer.token_ids
    assert capsys.readouterr().out == generated.text + "\n" + answer.text + "\n"
