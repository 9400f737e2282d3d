"""The ``zoo`` command line."""

import argparse
import sys

DTYPES = ("float32", "bfloat16", "float16")


def _open_images(paths: list[str]) -> list:
    from PIL import Image

    images = []
    for path in paths:
        try:
            images.append(Image.open(path))
        except OSError as exc:  # a missing file, or one PIL does not read as an image
            raise ValueError(f"--image {path}: {exc}") from exc
    return images


def _diff(args) -> int:
    import torch

    from loaders.default_model import default_model_path
    from runtime.diff import diff_checkpoint, format_rows

    model = args.model or str(default_model_path())
    input_ids = None
    if args.token_ids:
        input_ids = torch.tensor([[int(t) for t in args.token_ids.split(",")]])
    images = _open_images(args.image or [])
    path = f"the runtime's prefill and {args.steps} decode steps" if args.runtime else "a cache-free forward"
    print(f"zoo diff: {model} ({args.dtype}, {args.device}, {path}) against HuggingFace transformers", flush=True)
    rows = diff_checkpoint(model, input_ids=input_ids, prompt=args.prompt, dtype=getattr(torch, args.dtype),
                           device=args.device, atol=args.atol, rtol=args.rtol,
                           runtime_steps=args.steps if args.runtime else None, images=images)
    print(format_rows(rows))
    return 0 if all(r.ok for r in rows) else 1


def _load_llm(args):
    from loaders.default_model import default_model_path
    from runtime import LLM

    return LLM(args.model or str(default_model_path()), dtype=args.dtype, device=args.device,
               max_model_len=args.max_model_len)


def _sampling(args):
    from runtime import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


def _generate(args) -> int:
    import time

    prompts = args.prompt
    if args.image:
        if len(prompts) > 1:
            raise ValueError("--image goes with one prompt, whose <image> placeholders take the images in order")
        prompts = [{"prompt": prompts[0], "multi_modal_data": {"image": _open_images(args.image)}}]
    llm = _load_llm(args)
    params = _sampling(args)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    elapsed = time.perf_counter() - start
    for output in outputs:
        if output.error:
            print(f"error: {output.error}", file=sys.stderr)
            continue
        print(f"{output.prompt}{output.text}" if len(outputs) == 1 else f"[{output.request_id}] {output.prompt!r} -> {output.text!r}")
    tokens = sum(len(o.token_ids) for o in outputs)
    print(f"-- {tokens} tokens in {elapsed:.2f} s: {tokens / elapsed:.1f} tokens/s", file=sys.stderr)
    return 1 if any(o.error for o in outputs) else 0


def _chat(args) -> int:
    llm = _load_llm(args)
    params = _sampling(args)
    conversation = [{"role": "system", "content": args.system}] if args.system else []
    print("zoo chat: an empty line or Ctrl-D ends the conversation.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not line:
            return 0
        conversation.append({"role": "user", "content": line})
        reply = []
        for delta in llm.stream([llm.chat_prompt(conversation)], params):
            print(delta.text, end="", flush=True)
            reply.append(delta.text)
            if delta.error:
                print(f"error: {delta.error}", file=sys.stderr)
        print()
        conversation.append({"role": "assistant", "content": "".join(reply)})


def main(argv=None) -> int:
    from runtime.diff import DEFAULT_PROMPT, DEFAULT_STEPS

    parser = argparse.ArgumentParser(prog="zoo", description="zoo: a model zoo for LLM inference")
    commands = parser.add_subparsers(dest="command", required=True)

    diff = commands.add_parser("diff", help="diff a model layer by layer against HuggingFace transformers")
    diff.add_argument("model", nargs="?", help="checkpoint directory, .gguf file or hub repo id "
                                              "(default: the embedded SmolLM2-135M-Instruct GGUF)")
    diff.add_argument("--prompt", default=DEFAULT_PROMPT, help="text to run through both models")
    diff.add_argument("--token-ids", help="comma-separated token ids to use instead of --prompt")
    diff.add_argument("--image", action="append", metavar="PATH",
                      help="an image for the prompt's <image> placeholders (put before the prompt where it has none); "
                           "repeat for several")
    diff.add_argument("--dtype", choices=DTYPES, default="float32")
    diff.add_argument("--device", default="cpu")
    diff.add_argument("--atol", type=float, help="absolute tolerance (default by dtype)")
    diff.add_argument("--rtol", type=float, help="tolerance relative to the reference's max abs value (default by dtype)")
    diff.add_argument("--runtime", action="store_true", help="diff the runtime's path: a prefill through the paged "
                                                             "KV cache, then greedy decode steps, against HF with its cache")
    diff.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="decode steps of --runtime")
    diff.set_defaults(run=_diff)

    for name, run, text in (("generate", _generate, "generate text for one or more prompts"),
                            ("chat", _chat, "chat interactively, streaming the replies")):
        command = commands.add_parser(name, help=text)
        if name == "generate":
            command.add_argument("prompt", nargs="+", help="prompt text (several prompts run as one batch)")
            command.add_argument("--image", action="append", metavar="PATH",
                                 help="an image for the prompt's <image> placeholders, in order (repeat for several)")
        else:
            command.add_argument("--system", help="system message")
        command.add_argument("--model", help="checkpoint directory, .gguf file or hub repo id "
                                             "(default: the embedded SmolLM2-135M-Instruct GGUF)")
        command.add_argument("--max-tokens", type=int, default=64 if name == "generate" else 256)
        command.add_argument("--temperature", type=float, default=0.0 if name == "generate" else 0.7)
        command.add_argument("--top-p", type=float, default=1.0)
        command.add_argument("--top-k", type=int, default=0)
        command.add_argument("--seed", type=int)
        command.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                             help="auto: the checkpoint's dtype on CUDA, float32 on the CPU")
        command.add_argument("--device", help="cpu or cuda (default: cuda when available)")
        command.add_argument("--max-model-len", type=int, default=4096)
        command.set_defaults(run=run)

    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"zoo {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
