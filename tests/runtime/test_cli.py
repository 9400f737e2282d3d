"""The zoo command line as a user meets it: flags checked before loading, streamed output, Ctrl-C,
checkpoints without a tokenizer, and help that shows every flag."""

import gc
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from gguf import GGUFReader

import runtime
from runtime import LLM, SamplingParams
from runtime.cli import main
from runtime.compiled_decode import CompiledDecode
from tests.conftest import hf_model, save_checkpoint, tiny_config
from tests.loaders.gguf_writer import T, write_llama_gguf
from tests.runtime.test_compiled_decode import has_cpp_compiler

ROOT = Path(__file__).resolve().parents[2]
PROMPT_IDS = [5, 9, 13, 2]


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory):
    """A checkpoint without a tokenizer, long enough a context for long generations."""
    config = tiny_config("llama", max_position_embeddings=4096, eos_token_id=None, bos_token_id=None)
    return save_checkpoint(hf_model(config), tmp_path_factory.mktemp("cli") / "ckpt")


@pytest.fixture(scope="module")
def with_chat_template(tmp_path_factory):
    """A GGUF file with a tokenizer and a chat template, and a context of 4096 tokens."""
    path = tmp_path_factory.mktemp("cli") / "chat.gguf"
    write_llama_gguf(path, T.F32, tokenizer="gpt2")
    reader = GGUFReader(path, "r+")
    reader.fields["llama.context_length"].parts[-1][0] = 4096
    reader.data.flush()
    return path


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(runtime, "LLM", refuse)


class LoadingStarted(Exception):
    pass


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
@pytest.mark.parametrize("flags, keep", [([], None), (["--keep-mxfp4"], True), (["--no-keep-mxfp4"], False)])
def test_keep_mxfp4_reaches_the_llm_as_given(command, flags, keep, monkeypatch):
    """No flag leaves the choice to the loader (MXFP4 kept on CUDA, dequantised on the CPU)."""
    asked = []

    def record(*args, keep_mxfp4, **kwargs):
        asked.append(keep_mxfp4)
        raise LoadingStarted

    monkeypatch.setattr(runtime, "LLM", record)
    with pytest.raises(LoadingStarted):
        main([command, *flags, *(["--token-ids", "1,2"] if command == "generate" else [])])
    assert asked == [keep]


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "inf"], "temperature must be a finite number, got inf"),
    (["--top-p", "0"], r"top_p must be in \(0, 1\], got 0.0"),
    (["--max-tokens", "0"], "max_tokens must be a positive integer, got 0"),
    (["--top-k", "-3"], r"top_k must be an integer >= 0 \(0 = off\), got -3"),
])
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_sampling_flags_are_checked_before_the_model_loads(command, flags, message, no_loading, capsys):
    argv = [command, *flags] + (["Hello"] if command == "generate" else [])
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert re.fullmatch(rf"zoo {command}: error: {message}\n", captured.err)
    assert captured.out == ""


@pytest.mark.parametrize("argv, message", [
    (["serve", "--port", "99999"], "argument --port: 99999 is not a port: 0 to 65535"),
    (["serve", "--port", "http"], "argument --port: 'http' is not a port number"),
    (["serve", "--api-key", ""], "argument --api-key: the key is empty"),
    (["serve", "--host", "999.999.999.999"],
     "argument --host: '999.999.999.999' is not an address or a host name that resolves"),
    (["serve", "--host", "192.0.2.1"], "argument --host: '192.0.2.1' is not an address of this machine"),
    (["diff", "--atol", "-1"], "argument --atol: '-1': a tolerance is a finite number >= 0"),
    (["diff", "--rtol", "nan"], "argument --rtol: 'nan': a tolerance is a finite number >= 0"),
    (["diff", "--runtime", "--steps", "0"], "argument --steps: 0: a count is at least 1"),
    (["diff", "--runtime", "--steps", "two"], "argument --steps: 'two' is not an integer"),
])
def test_server_and_diff_flags_are_checked_before_the_model_loads(argv, message, no_loading, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert f"zoo {argv[0]}: error: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["diff", "generate"])
@pytest.mark.parametrize("value", ["1,a", "", "1,,2", "-1"])
def test_bad_token_ids_name_the_flag(command, value, no_loading, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--token-ids", value])
    assert exit_.value.code == 2
    assert f"zoo {command}: error: argument --token-ids: {value!r}" in capsys.readouterr().err


def test_a_model_larger_than_the_free_host_memory_is_an_error_not_a_kill(no_tokenizer, monkeypatch, capsys):
    monkeypatch.setattr("loaders.load.available_host_memory", lambda: 0)
    assert main(["generate", "--model", str(no_tokenizer), "--device", "cpu", "--token-ids", "1,2"]) == 2
    assert re.search(rf"zoo generate: error: {no_tokenizer / 'model.safetensors'}: the model needs \d+\.\d GiB of "
                     r"memory in torch.float32 on the CPU, and 0\.0 GiB are available; a 16-bit dtype",
                     capsys.readouterr().err)


def test_a_truncated_image_and_steps_without_runtime_are_errors_before_the_model_loads(no_loading, tmp_path,
                                                                                       capsys):
    import numpy as np
    from PIL import Image

    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(noise).save(tmp_path / "whole.png")
    whole = (tmp_path / "whole.png").read_bytes()
    cut = tmp_path / "cut.png"
    cut.write_bytes(whole[: len(whole) // 2])  # its header whole: PIL opens it and fails only to decode it
    assert main(["generate", "--image", str(cut), "<image> What is it?"]) == 2
    assert main(["diff", "--image", str(cut)]) == 2
    assert main(["diff", "--steps", "3"]) == 2
    assert main(["diff", "--prompt", "Hi", "--token-ids", "1,2"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    errors = captured.err.splitlines()
    assert errors[3] == "zoo diff: error: give --prompt or --token-ids, not both"
    assert errors[0].startswith(f"zoo generate: error: --image {cut}: ") and "truncated" in errors[0]
    assert errors[1].startswith(f"zoo diff: error: --image {cut}: ") and "truncated" in errors[1]
    assert errors[2] == "zoo diff: error: --steps counts the decode steps of --runtime: give --runtime too"


def test_generate_takes_a_prompt_or_token_ids(no_loading, capsys):
    assert main(["generate"]) == 2
    assert main(["generate", "--token-ids", "1,2", "Hello"]) == 2
    assert capsys.readouterr().err.count("give either PROMPT text or --token-ids") == 2
    assert main(["generate", "--token-ids", "1,2", "--image", "photo.png"]) == 2
    assert capsys.readouterr().err == ("zoo generate: error: --image goes with a PROMPT of text, whose <image> "
                                       "placeholders take the images, not with --token-ids\n")


def test_generate_takes_token_ids_for_a_checkpoint_without_a_tokenizer(no_tokenizer, capsys):
    params = SamplingParams(max_tokens=5, temperature=0)
    expected = LLM(str(no_tokenizer), device="cpu").generate([PROMPT_IDS], params, use_tqdm=False)[0].token_ids
    argv = ["generate", "--model", str(no_tokenizer), "--device", "cpu", "--max-tokens", "5", "--token-ids",
            ",".join(map(str, PROMPT_IDS))]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out == f"5,9,13,2 -> {' '.join(map(str, expected))}\n"
    assert "-- 5 tokens in" in captured.err


def test_text_or_chat_without_a_tokenizer_is_a_clear_error(no_tokenizer, capsys):
    assert main(["generate", "--model", str(no_tokenizer), "--device", "cpu", "Hello"]) == 2
    assert main(["chat", "--model", str(no_tokenizer), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"zoo generate: error: {no_tokenizer} has no tokenizer: give the prompt as --token-ids 1,2,3" in err
    assert f"zoo chat: error: {no_tokenizer} has no tokenizer: zoo chat needs one" in err


def test_serve_with_a_cache_past_the_memory_names_it_and_exits_2(no_tokenizer, capsys):
    assert main(["serve", str(no_tokenizer), "--device", "cpu", "--num-blocks", str(10**12)]) == 2
    assert re.fullmatch(r"zoo serve: error: the KV cache's 1000000000000 blocks of block_size=16 tokens take \d+ bytes, "
                        r"more than the \d+ bytes of memory left: lower num_blocks, kv_cache_gib or block_size\n",
                        capsys.readouterr().err)


def test_serve_takes_what_start_up_made_out_of_the_collectors_sight_until_it_ends(no_tokenizer, monkeypatch):
    frozen = []
    monkeypatch.setattr("runtime.server.serve", lambda llm, *args: frozen.append(gc.get_freeze_count()))
    assert gc.get_freeze_count() == 0
    assert main(["serve", str(no_tokenizer), "--device", "cpu"]) == 0
    assert frozen[0] > 100_000  # torch's, the model's and the LLM's objects
    assert gc.get_freeze_count() == 0  # the process's last collection frees them


@pytest.mark.skipif(not has_cpp_compiler(), reason="inductor needs a C++ compiler")
def test_serve_compiles_decode_steps_with_compile_decode(no_tokenizer, monkeypatch):
    served = []
    monkeypatch.setattr("runtime.server.serve", lambda llm, *args: served.append(llm.engine.runner.compiled))
    assert main(["serve", str(no_tokenizer), "--device", "cpu", "--compile-decode"]) == 0
    assert isinstance(served[0], CompiledDecode)


def test_chat_with_a_template_that_does_not_compile_names_it_and_exits_2(tmp_path, monkeypatch, capsys):
    from tests.runtime.test_server import break_chat_template, save_chat_checkpoint

    template = break_chat_template(save_chat_checkpoint(tmp_path / "ckpt"), "chat_template.jinja")
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", "--model", str(template.parent), "--device", "cpu"]) == 2
    assert f"zoo chat: error: {template}: the chat template does not compile (line 1: " in capsys.readouterr().err


class Cli:
    """``zoo`` in a subprocess, its output read as it comes."""

    def __init__(self, *argv):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # SIGINT as a terminal delivers it, also where this test runs in a job started with `&`, which
        # its children would inherit ignoring SIGINT.
        self.process = subprocess.Popen([sys.executable, "-m", "runtime.cli", *argv], cwd=ROOT, env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.out, self.err = "", ""
        for stream, name in ((self.process.stdout, "out"), (self.process.stderr, "err")):
            threading.Thread(target=self._read, args=(stream, name), daemon=True).start()

    def _read(self, stream, name):
        while chunk := stream.read(1):
            setattr(self, name, getattr(self, name) + chunk)

    def wait_for(self, condition, timeout=180):
        deadline = time.monotonic() + timeout
        while not condition(self.out):
            assert self.process.poll() is None, f"zoo exited early: {self.out!r} {self.err!r}"
            assert time.monotonic() < deadline, f"timed out: {self.out!r} {self.err!r}"
            time.sleep(0.05)

    def interrupt(self):
        self.process.send_signal(signal.SIGINT)

    def exit_code(self, timeout=60):
        code = self.process.wait(timeout)
        time.sleep(0.2)  # the reader threads take the last output
        return code


@pytest.mark.slow  # a fresh Python process imports torch and transformers
def test_ctrl_c_in_generate_keeps_what_was_streamed_and_exits_130(no_tokenizer):
    cli = Cli("generate", "--model", str(no_tokenizer), "--device", "cpu", "--max-tokens", "4000",
              "--token-ids", ",".join(map(str, PROMPT_IDS)))
    cli.wait_for(lambda out: len(out.split(" -> ")[-1].split()) >= 3)  # streaming: ids before the end
    cli.interrupt()
    assert cli.exit_code() == 130
    assert "Traceback" not in cli.err and "zoo generate: interrupted" in cli.err
    streamed = cli.out.split(" -> ")[1].split()
    assert cli.out.startswith("5,9,13,2 -> ") and 3 <= len(streamed) < 4000


@pytest.mark.slow  # a fresh Python process imports torch and transformers
def test_ctrl_c_in_chat_stops_the_reply_and_a_second_at_the_prompt_quits(with_chat_template):
    cli = Cli("chat", "--model", str(with_chat_template), "--device", "cpu", "--max-tokens", "4000",
              "--temperature", "0")
    cli.wait_for(lambda out: out == "> ")
    cli.process.stdin.write("hello\n")
    cli.process.stdin.flush()
    cli.wait_for(lambda out: len(out) > 12)
    cli.interrupt()
    cli.wait_for(lambda out: out.endswith(" [stopped]\n> "))  # back at the prompt, conversation kept
    cli.process.stdin.write("the world\n")
    cli.process.stdin.flush()
    cli.wait_for(lambda out: len(out.split("[stopped]\n> ")[1]) > 12)
    cli.interrupt()
    cli.wait_for(lambda out: out.count(" [stopped]\n> ") == 2)
    cli.interrupt()
    assert cli.exit_code() == 130
    assert "Traceback" not in cli.err


def test_a_chat_message_that_fails_is_left_out_and_the_conversation_goes_on(with_chat_template, monkeypatch,
                                                                             capsys):
    # Past max_model_len, or not valid Unicode: named, and the next message is answered as if it
    # had not been sent (the conversation did not grow by it).
    lines = iter(["hello", "the world " * 20, "bad \udcff text", "hello again", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    conversations = []
    chat_prompt = runtime.LLM.chat_prompt
    monkeypatch.setattr(runtime.LLM, "chat_prompt",
                        lambda self, conversation: (conversations.append(list(conversation)),
                                                    chat_prompt(self, conversation))[1])
    assert main(["chat", "--model", str(with_chat_template), "--device", "cpu", "--max-tokens", "4",
                 "--max-model-len", "64", "--temperature", "0"]) == 0
    errors = capsys.readouterr().err.splitlines()[1:]
    assert len(errors) == 2 and all(e.endswith("; the message is left out of the conversation") for e in errors)
    assert "max_model_len is 64" in errors[0] and "is not valid Unicode" in errors[1]
    assert [[m["content"] for m in c if m["role"] == "user"] for c in conversations[1:]] == [
        ["hello"], ["hello", ("the world " * 20).strip()], ["hello", "bad \udcff text"], ["hello", "hello again"]]


def test_an_image_past_pils_pixel_limit_is_named(no_loading, tmp_path, capsys, monkeypatch):
    from PIL import Image

    Image.new("1", (64, 64)).save(tmp_path / "large.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # PIL refuses twice its limit: 4096 pixels here
    assert main(["generate", "--image", str(tmp_path / "large.png"), "<image> What is it?"]) == 2
    assert capsys.readouterr().err.startswith(f"zoo generate: error: --image {tmp_path / 'large.png'}: Image size")


def test_diff_names_a_folder_that_holds_no_checkpoint(tmp_path, capsys):
    assert main(["diff", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.slow  # a fresh Python process imports torch and transformers
def test_output_piped_into_a_reader_that_goes_away_ends_quietly(no_tokenizer):
    process = subprocess.Popen([sys.executable, "-m", "runtime.cli", "generate", "--model", str(no_tokenizer),
                                "--device", "cpu", "--token-ids", "5,9", "--max-tokens", "4000"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    process.stdout.read(5)
    process.stdout.close()  # as `| head -c 5` does
    assert process.wait(timeout=120) == 141
    assert "Traceback" not in process.stderr.read().decode()


@pytest.mark.slow  # a fresh Python process imports torch and transformers
def test_chat_ends_at_eof_with_status_0(with_chat_template):
    cli = Cli("chat", "--model", str(with_chat_template), "--device", "cpu")
    cli.wait_for(lambda out: out == "> ")
    cli.process.stdin.close()
    assert cli.exit_code() == 0
    assert "Traceback" not in cli.err


def _flags(help_text: str) -> list[str]:
    # Each option's line names its flags, a yes/no flag both (--keep-mxfp4, --no-keep-mxfp4).
    lines = re.findall(r"^  (--[\w-]+(?:, --[\w-]+)*)", help_text, flags=re.MULTILINE)
    return [flag for line in lines for flag in line.split(", ")]


@pytest.mark.parametrize("command", ["generate", "chat", "diff", "serve"])
def test_help_describes_every_flag_with_its_default_and_the_readme_lists_them(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    help_text = capsys.readouterr().out
    entries = re.split(r"\n(?=  -)", help_text.split("options:\n", 1)[1])
    flags = [entry for entry in entries if not entry.startswith("  -h")]
    assert len(flags) >= 5
    for entry in flags:
        name = entry.split()[0]
        description = re.sub(r"^  --[\w-]+( [A-Z_]+| \{[\w,]+\})?\s+", "", entry.strip("\n"), count=1)
        assert len(description) > 10, f"{command} {name} has no description"
        assert "default" in description, f"{command} {name} does not say its default"
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Command line", 1)[1].split("```")[1].replace("\n   ", " ")  # continuation lines
    synopsis = " ".join(line for line in block.splitlines() if line.startswith(f"zoo {command}"))
    assert set(_flags(help_text)) - {"--help"} == set(re.findall(r"--[\w-]+", synopsis))
