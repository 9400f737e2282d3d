"""Every Python snippet of the README runs as pasted, or is a verbatim excerpt of the file it names."""

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# Each ```python block with the paragraph before it.
BLOCKS = re.findall(r"([^\n]*(?:\n[^\n]+)*)\n\n```python\n(.*?)```", README, flags=re.DOTALL)
EXCERPT_OF = re.compile(r"`(models/[\w/]+\.py)` is the whole of")


def snippet(marker: str) -> str:
    """The one Python snippet of the README that holds ``marker``."""
    (code,) = [code for _, code in BLOCKS if marker in code]
    return code


def test_the_readme_has_the_snippets_these_tests_run():
    """The Python API's two snippets run here; the image requests' in tests/runtime/test_llava_runtime.py
    (on a tiny LLaVA checkpoint), the openai client's in tests/runtime/test_server.py (against a
    server); the excerpt is checked against its file."""
    assert len(BLOCKS) == 5
    assert [bool(EXCERPT_OF.search(before)) for before, _ in BLOCKS] == [False, False, False, False, True]
    assert snippet("multi_modal_data") and snippet("from openai import OpenAI")


def test_an_excerpt_is_the_code_of_the_file_it_names():
    before, code = BLOCKS[4]
    assert code.strip() in (ROOT / EXCERPT_OF.search(before).group(1)).read_text()


@pytest.mark.slow  # loads the embedded SmolLM2-135M-Instruct and generates
def test_the_python_api_snippets_run_as_pasted():
    import torch

    loaded = {}
    exec(BLOCKS[0][1], loaded)  # noqa: S102 (the README's own code)
    assert loaded["logits"].shape == (1, 5, 49152)
    assert torch.isfinite(loaded["logits"]).all()
    generated = {}
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(BLOCKS[1][1], generated)  # noqa: S102
    outs = generated["outs"]
    assert all(o.error is None for o in outs) and "Paris" in outs[0].text
    assert printed.getvalue().startswith(outs[0].text)
