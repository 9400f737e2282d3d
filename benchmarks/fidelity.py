"""Fidelity against HuggingFace transformers: float32 logits of every tested variant and of the real
SmolLM2-135M-Instruct GGUF, as relative error (max abs diff / max abs of HF's logits).

    .venv/bin/python benchmarks/fidelity.py

The variants are the tiny random checkpoints of tests/models/test_parity.py, those of tests/models/test_moe.py
in both checkpoint layouts (as hub repos ship them: one tensor per expert, or GraniteMoe's experts stacked
under names of their own; and transformers 5's stacked experts), those of
tests/models/test_deepseek_v3.py (DeepSeek-V3 with a non-zero score correction bias, and DeepSeek-V2), those of
tests/models/test_glm4_moe.py (GLM-4.5, GLM-4.7-Flash and dots.llm1, with a non-zero score correction bias, in
both layouts), those of tests/models/test_gpt_oss.py (GPT-OSS, with every bias and sink drawn away from its
initial value), those of tests/models/test_ernie4_5_moe.py and tests/models/test_exaone_moe.py (ERNIE 4.5 MoE
and EXAONE MoE, every bias and the score correction bias drawn away from zero, in the layouts transformers'
save_pretrained writes: the hub's and its own), and
those of tests/models/test_llava.py (LLaVA 1.5 and LLaVA-NeXT, images of odd sizes through transformers' processors).
"""

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loaders.default_model import default_model_path  # noqa: E402
from models import AutoModelForCausalLM, architecture_of  # noqa: E402
from runtime.diff import load_reference, tokenize  # noqa: E402
from tests.conftest import hf_model, relative_error, save_checkpoint  # noqa: E402
from tests.models.test_deepseek_v3 import V2_VARIANTS, VARIANTS as DEEPSEEK_VARIANTS, deepseek_hf_model  # noqa: E402
from tests.models.test_ernie4_5_moe import (  # noqa: E402
    SAVE_LAYOUTS, VARIANTS as ERNIE4_5_MOE_VARIANTS, biased_hf_model,
)
from tests.models.test_exaone_moe import VARIANTS as EXAONE_MOE_VARIANTS  # noqa: E402
from tests.models.test_glm4_moe import VARIANTS as GLM4_MOE_VARIANTS  # noqa: E402
from tests.models.test_gpt_oss import VARIANTS as GPT_OSS_VARIANTS, gpt_oss_hf_model  # noqa: E402
from tests.models.test_llava import (  # noqa: E402
    IMAGE_SIZES, NEXT_PROMPTS, NEXT_VARIANTS, VARIANTS as LLAVA_VARIANTS, hf_llava, inputs, tiny_tokenizer,
)
from tests.models.test_moe import LAYOUTS, VARIANTS as MOE_VARIANTS, layouts, write_checkpoint  # noqa: E402
from tests.models.test_parity import VARIANTS  # noqa: E402
from tests.models.test_smollm2 import SENTENCE  # noqa: E402


def row(name, architecture, ours, theirs):
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    return f"| {name} | {architecture} | {relative_error(ours, theirs):.1e} | {agree:.0%} |"


@torch.no_grad()
def main():
    print("| variant | architecture | max relative logit error | argmax agreement |")
    print("|---|---|---|---|")
    torch.manual_seed(1)
    input_ids = torch.randint(0, 97, (2, 40))
    for name, config in VARIANTS.items():
        reference = hf_model(config)
        with tempfile.TemporaryDirectory() as directory:
            model = AutoModelForCausalLM.from_pretrained(save_checkpoint(reference, Path(directory)))
        print(row(name, architecture_of(model.config), model(input_ids), reference(input_ids).logits), flush=True)
    moe = [(name, config, hf_model, layouts(name)) for name, config in MOE_VARIANTS.items()]
    moe += [(name, config, deepseek_hf_model, LAYOUTS) for name, config in GLM4_MOE_VARIANTS.items()]
    for name, config, make_reference, checkpoint_layouts in moe:
        reference = make_reference(config)
        for layout in checkpoint_layouts:
            with tempfile.TemporaryDirectory() as directory:
                path = write_checkpoint(reference, Path(directory) / layout, layout)
                model = AutoModelForCausalLM.from_pretrained(path)
            ours, theirs = model(input_ids), reference(input_ids).logits
            print(row(f"{name} ({layout})", architecture_of(model.config), ours, theirs), flush=True)
    for name, config in {**ERNIE4_5_MOE_VARIANTS, **EXAONE_MOE_VARIANTS}.items():
        reference = biased_hf_model(config)
        for layout, save_options in SAVE_LAYOUTS.items():
            with tempfile.TemporaryDirectory() as directory:
                path = save_checkpoint(reference, Path(directory), **save_options)
                model = AutoModelForCausalLM.from_pretrained(path)
            ours, theirs = model(input_ids), reference(input_ids).logits
            print(row(f"{name} ({layout})", architecture_of(model.config), ours, theirs), flush=True)
    deepseek = {**{f"deepseek_v3-{n}": c for n, c in DEEPSEEK_VARIANTS.items()}, **V2_VARIANTS}
    references = [(name, config, deepseek_hf_model) for name, config in deepseek.items()]
    references += [(name, config, gpt_oss_hf_model) for name, config in GPT_OSS_VARIANTS.items()]
    for name, config, make_reference in references:
        reference = make_reference(config)
        with tempfile.TemporaryDirectory() as directory:
            model = AutoModelForCausalLM.from_pretrained(save_checkpoint(reference, Path(directory)))
        print(row(name, architecture_of(model.config), model(input_ids), reference(input_ids).logits),
              flush=True)
    tokenizer = tiny_tokenizer()
    llava = [(name, config, inputs(config, tokenizer)) for name, config in LLAVA_VARIANTS.items()]
    llava += [(f"next-{name}", config, inputs(config, tokenizer, IMAGE_SIZES, NEXT_PROMPTS))
              for name, config in NEXT_VARIANTS.items()]
    for name, config, (image_input_ids, images) in llava:
        reference = hf_llava(config)
        with tempfile.TemporaryDirectory() as directory:
            model = AutoModelForCausalLM.from_pretrained(save_checkpoint(reference, Path(directory)))
        print(row(f"llava-{name}", architecture_of(model.config), model(image_input_ids, **images),
                  reference(input_ids=image_input_ids, **images).logits), flush=True)
    path = default_model_path()
    input_ids = tokenize(path, SENTENCE)
    model = AutoModelForCausalLM.from_pretrained(path)
    reference = load_reference(path, torch.float32, "cpu")
    print(row("SmolLM2-135M-Instruct Q4_1 GGUF", "LlamaForCausalLM", model(input_ids),
              reference(input_ids=input_ids, use_cache=False).logits))


if __name__ == "__main__":
    main()
