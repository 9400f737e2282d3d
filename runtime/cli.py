"""The ``zoo`` command line. Flags are checked before a model loads; output streams as it is
generated; Ctrl-C stops generation without a traceback (exit status 130) and, in ``zoo chat``,
only the current reply."""

import argparse
import os
import socket
import sys

DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8")  # runtime.config's, spelled here so that parsing imports no torch
MODEL_HELP = "checkpoint directory, .gguf file or hub repo id (default: the embedded SmolLM2-135M-Instruct GGUF)"
INTERRUPTED = 130  # the shell's status for a command ended by SIGINT
BROKEN_PIPE = 141  # and by SIGPIPE, a write to a pipe nobody reads


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default after its description, unless the description says it."""

    def _get_help_string(self, action):
        return action.help if "default" in (action.help or "") else super()._get_help_string(action)


def token_ids(text: str) -> list[int]:
    """``--token-ids``: a non-empty comma-separated list of non-negative integers."""
    try:
        ids = [int(item) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids, as 1,2,3") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"{text!r}: token ids are >= 0")
    return ids


def _parsed(text: str, parse, what: str):
    try:
        return parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def port(text: str) -> int:
    """``--port``: a TCP port, checked before the model loads."""
    value = _parsed(text, int, "a port number")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port: 0 to 65535")
    return value


def host(text: str) -> str:
    """``--host``: an address of this machine, checked before the model loads (uvicorn binds it only
    after). A name is resolved as uvicorn resolves it; binding port 0 takes no port."""
    try:
        family, _, _, _, address = socket.getaddrinfo(text, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not an address or a host name that resolves: "
                                         f"{exc.strerror}") from None
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((address[0], 0, *address[2:]))
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not an address of this machine: {exc.strerror}") from None
    return text


def count(text: str) -> int:
    """A count of at least 1 (``--steps``)."""
    value = _parsed(text, int, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: a count is at least 1")
    return value


def api_key(text: str) -> str:
    """``--api-key``: a non-empty key (an empty one, as from an unset variable, would turn the check off)."""
    if not text:
        raise argparse.ArgumentTypeError("the key is empty (an unset variable?): give a key, or leave the flag out")
    return text


def tolerance(text: str) -> float:
    """``--atol``/``--rtol``: a finite number >= 0."""
    value = _parsed(text, float, "a number")
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: a tolerance is a finite number >= 0")
    return value


def _open_images(paths: list[str]) -> list:
    from PIL import Image

    images = []
    for path in paths:
        try:
            image = Image.open(path)
            image.load()  # open reads the header only: a truncated or damaged image fails here, not in a request
        except (OSError, Image.DecompressionBombError) as exc:  # a missing file, one PIL does not read as an
            raise ValueError(f"--image {path}: {exc}") from exc  # image, or one past PIL's pixel limit
        images.append(image)
    return images


def _diff(args) -> int:
    import torch

    from loaders import default_model_path
    from runtime.diff import DEFAULT_PROMPT, DEFAULT_STEPS, diff_checkpoint, format_rows

    if args.steps is not None and not args.runtime:
        raise ValueError("--steps counts the decode steps of --runtime: give --runtime too")
    if args.prompt is not None and args.token_ids:
        raise ValueError("give --prompt or --token-ids, not both")
    steps = DEFAULT_STEPS if args.steps is None else args.steps
    model = args.model or str(default_model_path())
    input_ids = torch.tensor([args.token_ids]) if args.token_ids else None
    prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
    images = _open_images(args.image or [])
    path = f"the runtime's prefill and {steps} decode steps" if args.runtime else "a cache-free forward"
    print(f"zoo diff: {model} ({args.dtype}, {args.device}, {path}) against HuggingFace transformers", flush=True)
    rows = diff_checkpoint(model, input_ids=input_ids, prompt=prompt, dtype=getattr(torch, args.dtype),
                           device=args.device, atol=args.atol, rtol=args.rtol,
                           runtime_steps=steps if args.runtime else None, images=images)
    print(format_rows(rows))
    return 0 if all(r.ok for r in rows) else 1


def _sampling(args):
    """The command's sampling flags, checked (a ValueError names the first bad one)."""
    from runtime import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    params.validate()
    return params


def _load_llm(args):
    from loaders import default_model_path
    from runtime import LLM

    return LLM(args.model or str(default_model_path()), dtype=args.dtype, device=args.device,
               max_model_len=args.max_model_len, kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tp,
               keep_mxfp4=args.keep_mxfp4)


def _generate(args) -> int:
    if bool(args.prompt) == bool(args.token_ids):
        raise ValueError("give either PROMPT text or --token-ids, not both and not neither")
    if args.image and args.token_ids:
        raise ValueError("--image goes with a PROMPT of text, whose <image> placeholders take the images, "
                         "not with --token-ids")
    if args.image and len(args.prompt) != 1:
        raise ValueError("--image goes with one PROMPT, whose <image> placeholders take the images in order")
    images = _open_images(args.image or [])  # a bad image is reported before the model loads
    params = _sampling(args)
    llm = _load_llm(args)
    try:
        return _generate_with(llm, args, params, images)
    finally:
        llm.shutdown()


def _generate_with(llm, args, params, images: list) -> int:
    import time

    if args.prompt and llm.tokenizer is None:
        raise ValueError(f"{args.model or 'the model'} has no tokenizer: give the prompt as --token-ids 1,2,3")
    prompts = args.prompt or [args.token_ids]
    requests = [{"prompt": prompts[0], "multi_modal_data": {"image": images}}] if images else prompts
    texts, ids, errors = [""] * len(prompts), [[] for _ in prompts], [None] * len(prompts)
    finished = [False] * len(prompts)
    single = len(prompts) == 1
    if single:  # one prompt streams: first the prompt, then each piece as it is generated
        print(prompts[0] if args.prompt else ",".join(map(str, prompts[0])) + " ->", end="", flush=True)
    start = time.perf_counter()
    try:
        for delta in llm.stream(requests, params):
            i = delta.index
            texts[i] += delta.text
            ids[i] += delta.token_ids
            errors[i], finished[i] = delta.error, delta.finish_reason is not None
            if single and not delta.error:
                print(delta.text if args.prompt else "".join(f" {t}" for t in delta.token_ids), end="", flush=True)
            elif delta.finish_reason and not delta.error:
                _print_output(args, prompts[i], i, texts[i], ids[i])
    except KeyboardInterrupt:
        if single:
            print(flush=True)
        else:  # what the unfinished prompts had when Ctrl-C came
            for i, prompt in enumerate(prompts):
                if not finished[i]:
                    _print_output(args, prompt, i, texts[i], ids[i], " (interrupted)")
        print("zoo generate: interrupted", file=sys.stderr)
        return INTERRUPTED
    elapsed = time.perf_counter() - start
    if single:
        print()
    for error in filter(None, errors):
        print(f"zoo generate: error: {error}", file=sys.stderr)
    tokens = sum(map(len, ids))
    if tokens:
        print(f"-- {tokens} tokens in {elapsed:.2f} s: {tokens / elapsed:.1f} tokens/s", file=sys.stderr)
    return 1 if any(errors) else 0


def _print_output(args, prompt, index: int, text: str, ids: list[int], note: str = "") -> None:
    generated = repr(text) if args.prompt else ",".join(map(str, ids))
    shown = repr(prompt) if args.prompt else ",".join(map(str, prompt))
    print(f"[{index}] {shown} -> {generated}{note}", flush=True)


def _chat(args) -> int:
    params = _sampling(args)
    llm = _load_llm(args)
    try:
        return _chat_with(llm, args, params)
    finally:
        llm.shutdown()


def _chat_with(llm, args, params) -> int:
    if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
        what = "no tokenizer" if llm.tokenizer is None else "a tokenizer without a chat template"
        raise ValueError(f"{args.model or 'the model'} has {what}: zoo chat needs one "
                         f"(zoo generate --token-ids 1,2,3 takes token ids)")
    conversation = [{"role": "system", "content": args.system}] if args.system else []
    # A template that does not compile, or refuses the system message, ends the command here; an error
    # of a message later leaves that message out.
    llm.chat_prompt([*conversation, {"role": "user", "content": "Hello"}])
    print("zoo chat: Ctrl-C stops a reply; an empty line, Ctrl-D or Ctrl-C at the prompt ends the conversation.",
          file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return INTERRUPTED
        if not line:
            return 0
        conversation.append({"role": "user", "content": line})
        reply, error = [], None
        try:
            for delta in llm.stream([llm.chat_prompt(conversation)], params):
                print(delta.text, end="", flush=True)
                reply.append(delta.text)
                error = delta.error or error
        except ValueError as exc:  # a message the template or tokenizer refuses
            error = str(exc)
        except KeyboardInterrupt:  # the reply so far stays in the conversation
            print(" [stopped]", end="", flush=True)
        print(flush=True)
        if error:  # the conversation goes on without the message
            conversation.pop()
            print(f"error: {error}; the message is left out of the conversation", file=sys.stderr)
        else:
            conversation.append({"role": "assistant", "content": "".join(reply)})


def _add_sampling_flags(command, max_tokens: int, temperature: float) -> None:
    command.add_argument("--model", help=MODEL_HELP)
    command.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate at most per prompt")
    command.add_argument("--temperature", type=float, default=temperature, help="sampling temperature; 0 is greedy")
    command.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens "
                                                                   "holding this probability (1 is off)")
    command.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 is off)")
    command.add_argument("--seed", type=int, help="seed of the samples, for reproducible output (default: none)")
    command.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                         help="weights' dtype; auto: the checkpoint's dtype on CUDA, float32 on the CPU")
    command.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    command.add_argument("--max-model-len", type=int, default=4096,
                         help="prompt + generated tokens of a sequence at most (capped by the model's limit)")
    _add_kv_cache_dtype_flag(command)
    _add_keep_mxfp4_flag(command)
    _add_tp_flag(command)


def _add_keep_mxfp4_flag(command) -> None:
    command.add_argument("--keep-mxfp4", action=argparse.BooleanOptionalAction,
                         help="keep MXFP4 experts (gpt-oss's) in MXFP4, about a quarter of their bf16 memory; on CUDA "
                              "decode steps of up to ~128 sequences run faster, prompts and larger batches slower "
                              "(default: kept on CUDA, dequantised on the CPU)")


def _add_tp_flag(command) -> None:
    command.add_argument("--tp", type=int, default=1, metavar="N",
                         help="tensor parallelism: split the model over N ranks, one process and CUDA device each "
                              "(or N processes on the CPU)")


def _add_kv_cache_dtype_flag(command) -> None:
    command.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                         help="the KV cache's dtype: auto is the model's; fp8 is e4m3, a byte a value, so about "
                              "twice the tokens fit")


def _serve(args) -> int:
    from loaders import default_model_path
    from runtime import LLM
    from runtime.engine import start_up_objects_frozen
    from runtime.server import serve

    model = args.model or str(default_model_path())
    options = {name: getattr(args, name) for name in ("max_model_len", "max_num_seqs", "num_blocks", "kv_cache_gib")
               if getattr(args, name) is not None}
    llm = LLM(model, dtype=args.dtype, device=args.device, enforce_eager=args.enforce_eager,
              compile_decode=args.compile_decode, kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tp,
              keep_mxfp4=args.keep_mxfp4, **options)
    # The embedded model's file is SmolLM2-135M-Instruct.Q4_1.gguf: it is served as SmolLM2-135M-Instruct.
    name = args.served_model_name or args.model or default_model_path().name.split(".")[0]
    try:
        with start_up_objects_frozen():
            serve(llm, name, args.host, args.port, args.api_key)
    finally:
        llm.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    from runtime.diff import DEFAULT_PROMPT, DEFAULT_STEPS

    formatter = HelpFormatter
    parser = argparse.ArgumentParser(prog="zoo", description="zoo: a model zoo for LLM inference",
                                     formatter_class=formatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{generate,chat,diff,serve}")

    generate = commands.add_parser("generate", help="generate text for one or more prompts, streaming one",
                                   description="Generate text for one or more prompts (several run as one batch); "
                                               "one prompt streams as it is generated.", formatter_class=formatter)
    generate.add_argument("prompt", nargs="*", help="prompt text; several run as one batch (default: none, "
                                                    "when --token-ids gives the prompt)")
    generate.add_argument("--token-ids", type=token_ids,
                          help="a prompt as comma-separated token ids instead of text (for checkpoints without a "
                               "tokenizer); prints the generated ids (default: none)")
    generate.add_argument("--image", action="append", metavar="PATH",
                          help="an image for the prompt's <image> placeholders, in order; repeat for several "
                               "(default: none)")
    _add_sampling_flags(generate, max_tokens=64, temperature=0.0)
    generate.set_defaults(run=_generate)

    chat = commands.add_parser("chat", help="chat interactively, streaming the replies",
                               description="Chat interactively, streaming the replies. Ctrl-C stops a reply; an "
                                           "empty line, Ctrl-D or Ctrl-C at the prompt ends the conversation.",
                               formatter_class=formatter)
    chat.add_argument("--system", help="system message (default: none)")
    _add_sampling_flags(chat, max_tokens=256, temperature=0.7)
    chat.set_defaults(run=_chat)

    diff = commands.add_parser("diff", help="diff a model layer by layer against HuggingFace transformers",
                               description="Diff a model layer by layer against HuggingFace transformers.",
                               formatter_class=formatter)
    diff.add_argument("model", nargs="?", help=MODEL_HELP)
    diff.add_argument("--prompt", help=f"text to run through both models (default: {DEFAULT_PROMPT!r})")
    diff.add_argument("--token-ids", type=token_ids,
                      help="comma-separated token ids to use instead of --prompt (default: none)")
    diff.add_argument("--image", action="append", metavar="PATH",
                      help="an image for the prompt's <image> placeholders (put before the prompt where it has none); "
                           "repeat for several (default: none)")
    diff.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of both models")
    diff.add_argument("--device", default="cpu", help="device of both models")
    diff.add_argument("--atol", type=tolerance, help="absolute tolerance (default by dtype)")
    diff.add_argument("--rtol", type=tolerance,
                      help="tolerance relative to the reference's max abs value (default by dtype)")
    diff.add_argument("--runtime", action="store_true", help="diff the runtime's path: a prefill through the paged "
                                                             "KV cache, then greedy decode steps, against HF with its cache")
    diff.add_argument("--steps", type=count, help=f"decode steps of --runtime (default: {DEFAULT_STEPS})")
    diff.set_defaults(run=_diff)

    serve = commands.add_parser("serve", help="serve a model over the OpenAI API (HTTP)",
                                description="Serve a model over the OpenAI API: chat and text completions, "
                                            "models, health and Prometheus metrics.", formatter_class=formatter)
    serve.add_argument("model", nargs="?", help=MODEL_HELP)
    serve.add_argument("--host", type=host, default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=port, default=8000, help="port to listen on")
    serve.add_argument("--served-model-name", help="the name clients give as `model` (default: MODEL as given)")
    serve.add_argument("--api-key", type=api_key, help="a key every request but GET /health must bear as `Authorization: Bearer "
                                         "KEY` (default: none, no key)")
    serve.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                       help="weights' dtype; auto: the checkpoint's dtype on CUDA, float32 on the CPU")
    serve.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    serve.add_argument("--max-model-len", type=int, default=4096,
                       help="prompt + generated tokens of a sequence at most (capped by the model's limit)")
    serve.add_argument("--max-num-seqs", type=int, help="sequences per step at most (default 64)")
    serve.add_argument("--num-blocks", type=int, help="KV-cache blocks (default: as many as the memory budget holds)")
    serve.add_argument("--kv-cache-gib", type=float, help="the KV cache's memory (default: 1 GiB on the CPU, "
                                                          "on CUDA what the model leaves of 90%% of the device)")
    _add_kv_cache_dtype_flag(serve)
    _add_keep_mxfp4_flag(serve)
    serve.add_argument("--enforce-eager", action="store_true",
                       help="on CUDA, run decode steps without CUDA graphs (default: graphs where the model allows)")
    serve.add_argument("--compile-decode", action="store_true",
                       help="on the CPU, run decode steps through one graph torch.compile builds at start (tens of "
                            "seconds; needs a C++ compiler; default: eager steps)")
    _add_tp_flag(serve)
    serve.set_defaults(run=_serve)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (FileNotFoundError, ValueError, NotImplementedError) as exc:  # NotImplementedError: what zoo refuses to run
        print(f"zoo {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # while the model loads, or between steps of zoo diff
        print(f"\nzoo {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:  # the reader of the output went away (| head): stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that exit's flush does not raise again
        return BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
