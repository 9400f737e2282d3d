"""LLaVA on the GPU against HuggingFace transformers, one run: a LLaVA-1.5-7B-shaped model (CLIP
ViT-L/14 at 336 px, 24 layers; Llama-7B: 32 layers, hidden 4096) with random bf16 weights.

    python3 benchmarks/bench_llava.py            # --json results.json to keep the figures

ttft        one request of one 336 px image (576 image tokens) and a 32-word prompt, one new token:
            seconds from the call to its return, preprocessing included on both sides; zoo's
            ``LLM.generate`` against HF's processor + ``generate`` (the median of 5, after a warm-up).
throughput  64 such requests, each with its own image, 128 new tokens each (EOS ignored): output
            tokens/s, zoo's ``LLM.generate`` against HF's processor + batched ``generate``. HF's
            continuous-batching manager takes token ids only, no images, so HF runs one batch: every
            prompt expands to the same length (checked), so each request has the prompt and output
            length zoo's has, with no padding.
start-up    printed beside the figures, untimed: each side's load (zoo's with its KV cache and
            CUDA-graph capture) and first call.

The model and its processor (a word-level tokenizer over the 32064 ids, with ``<image>`` at 32000,
and CLIP's image processor at 336 px) are written to a temporary directory that both sides load:
zoo's requests are vLLM's, ``{"prompt": ..., "multi_modal_data": {"image": PIL image}}``.
"""

import argparse
import datetime
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer, models as tokenizer_models, pre_tokenizers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import timed  # noqa: E402
from benchmarks.startup import stage, startup_text  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402

VOCAB = 32064
IMAGE_TOKEN = 32000
PROMPT_WORDS = 32
REQUESTS = 64
NEW_TOKENS = 128
CLIP_L_336 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                  image_size=336, patch_size=14, hidden_act="quick_gelu", projection_dim=768)
LLAMA_7B = dict(vocab_size=VOCAB, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
                tie_word_embeddings=False)


def write_checkpoint(directory: Path) -> None:
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**CLIP_L_336), text_config=transformers.LlamaConfig(**LLAMA_7B),
        image_token_index=IMAGE_TOKEN, vision_feature_layer=-2, vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    del model
    torch.cuda.empty_cache()
    write_processor(directory)


def write_processor(directory: Path) -> None:
    special = {0: "<unk>", 1: "<s>", 2: "</s>", IMAGE_TOKEN: "<image>", IMAGE_TOKEN + 1: "<pad>"}
    vocab = {special.get(i, f"w{i}"): i for i in range(VOCAB)}
    backend = Tokenizer(tokenizer_models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"},
    )
    images = transformers.CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    transformers.LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=14,
                                vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                ).save_pretrained(directory)


def workload(count: int, seed: int = 0):
    """``count`` prompts of PROMPT_WORDS words around one <image>, and as many random 640x480 images."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(count):
        words = [f"w{i}" for i in rng.integers(3, IMAGE_TOKEN, PROMPT_WORDS)]
        prompts.append(" ".join(words[:4] + ["<image>"] + words[4:]))
    images = [Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)) for _ in range(count)]
    return prompts, images


def zoo_side(directory: Path, prompts, images) -> dict:
    startup = {}
    with stage(startup, "zoo load + LLM() (KV cache, CUDA graphs)"):
        # No prefix cache: the first call and the TTFT requests are among the timed ones, and HF's side reuses nothing.
        llm = LLM(str(directory), max_num_seqs=REQUESTS, max_model_len=1024, enable_prefix_caching=False)
    requests = [{"prompt": p, "multi_modal_data": {"image": img}} for p, img in zip(prompts, images)]
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    with stage(startup, "zoo first call"):
        llm.generate(requests[:2], first, use_tqdm=False)
    ttft = statistics.median(timed(lambda i=i: llm.generate([requests[i]], first, use_tqdm=False)) for i in range(5))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = []
    seconds = timed(lambda: outputs.extend(llm.generate(requests, params, use_tqdm=False)))
    assert all(len(o.token_ids) == NEW_TOKENS for o in outputs), "every request gets all its new tokens"
    tokens = sum(len(o.token_ids) for o in outputs)
    return dict(ttft_s=ttft, tokens_per_s=tokens / seconds, tokens=tokens, seconds=seconds, startup_s=startup)


@torch.inference_mode()
def hf_side(directory: Path, prompts, images) -> dict:
    startup = {}
    with stage(startup, "HF load"):
        model = transformers.LlavaForConditionalGeneration.from_pretrained(directory, dtype=torch.bfloat16)
        model = model.cuda().eval()
        processor = transformers.AutoProcessor.from_pretrained(directory)

    def generate(count, new_tokens, offset=0):
        batch = processor(images=images[offset : offset + count], text=prompts[offset : offset + count],
                          return_tensors="pt").to("cuda")
        return model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=IMAGE_TOKEN + 1)

    with stage(startup, "HF first call"):
        generate(2, 1)
    ttft = statistics.median(timed(lambda i=i: generate(1, 1, offset=i)) for i in range(5))
    outputs = []
    seconds = timed(lambda: outputs.append(generate(len(prompts), NEW_TOKENS)))
    # Every prompt expands to the same length, as in zoo, so no row is padded and each row holds
    # its prompt and exactly NEW_TOKENS new tokens (EOS off, as zoo's ignore_eos).
    prompt_lengths = processor(images=images, text=prompts, return_tensors="pt")["attention_mask"].sum(-1)
    assert (prompt_lengths == prompt_lengths[0]).all(), "the prompts expand to different lengths"
    assert outputs[0].shape == (len(prompts), prompt_lengths[0].item() + NEW_TOKENS), outputs[0].shape
    tokens = len(prompts) * NEW_TOKENS
    return dict(ttft_s=ttft, tokens_per_s=tokens / seconds, tokens=tokens, seconds=seconds, startup_s=startup)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
               "torch": torch.__version__, "transformers": transformers.__version__}
    print(results, flush=True)
    prompts, images = workload(REQUESTS)
    with tempfile.TemporaryDirectory() as directory:
        write_checkpoint(Path(directory))
        results["zoo"] = zoo = zoo_side(Path(directory), prompts, images)
        torch.cuda.empty_cache()  # zoo's LLM went with the function's frame
        print(f"zoo: TTFT {zoo['ttft_s'] * 1e3:.1f} ms; {REQUESTS} image requests x {NEW_TOKENS} tokens: "
              f"{zoo['tokens_per_s']:.0f} tok/s ({zoo['seconds']:.2f} s)", flush=True)
        results["hf"] = hf = hf_side(Path(directory), prompts, images)
        torch.cuda.empty_cache()  # and HF's model with this one's
        print(f"HF:  TTFT {hf['ttft_s'] * 1e3:.1f} ms; {REQUESTS} image requests x {NEW_TOKENS} tokens: "
              f"{hf['tokens_per_s']:.0f} tok/s ({hf['seconds']:.2f} s)", flush=True)
    print(f"zoo vs HF: TTFT {hf['ttft_s'] / zoo['ttft_s']:.2f}x faster, throughput "
          f"{zoo['tokens_per_s'] / hf['tokens_per_s']:.2f}x", flush=True)
    print(f"{startup_text({**zoo['startup_s'], **hf['startup_s']})} (the checkpoint's writing apart)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
