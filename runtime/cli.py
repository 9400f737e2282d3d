"""The ``zoo`` command line."""

import argparse
import sys

DTYPES = ("float32", "bfloat16", "float16")


def _diff(args) -> int:
    import torch

    from loaders.default_model import default_model_path
    from runtime.diff import diff_checkpoint, format_rows

    model = args.model or str(default_model_path())
    input_ids = None
    if args.token_ids:
        input_ids = torch.tensor([[int(t) for t in args.token_ids.split(",")]])
    path = f"the runtime's prefill and {args.steps} decode steps" if args.runtime else "a cache-free forward"
    print(f"zoo diff: {model} ({args.dtype}, {args.device}, {path}) against HuggingFace transformers", flush=True)
    rows = diff_checkpoint(model, input_ids=input_ids, prompt=args.prompt, dtype=getattr(torch, args.dtype),
                           device=args.device, atol=args.atol, rtol=args.rtol,
                           runtime_steps=args.steps if args.runtime else None)
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

    llm = _load_llm(args)
    params = _sampling(args)
    start = time.perf_counter()
    outputs = llm.generate(args.prompt, params, use_tqdm=len(args.prompt) > 1)
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


def _serve(args) -> int:
    from loaders.default_model import default_model_path
    from runtime import LLM
    from runtime.server import serve

    model = args.model or str(default_model_path())
    options = {name: getattr(args, name) for name in ("max_model_len", "max_num_seqs", "num_blocks", "kv_cache_gib")
               if getattr(args, name) is not None}
    llm = LLM(model, dtype=args.dtype, device=args.device, enforce_eager=args.enforce_eager, **options)
    # The embedded model's file is SmolLM2-135M-Instruct.Q4_1.gguf: it is served as SmolLM2-135M-Instruct.
    name = args.served_model_name or args.model or default_model_path().name.split(".")[0]
    serve(llm, name, args.host, args.port, args.api_key)
    return 0


def main(argv=None) -> int:
    from runtime.diff import DEFAULT_PROMPT, DEFAULT_STEPS

    parser = argparse.ArgumentParser(prog="zoo", description="zoo: a model zoo for LLM inference")
    commands = parser.add_subparsers(dest="command", required=True)

    diff = commands.add_parser("diff", help="diff a model layer by layer against HuggingFace transformers")
    diff.add_argument("model", nargs="?", help="checkpoint directory, .gguf file or hub repo id "
                                              "(default: the embedded SmolLM2-135M-Instruct GGUF)")
    diff.add_argument("--prompt", default=DEFAULT_PROMPT, help="text to run through both models")
    diff.add_argument("--token-ids", help="comma-separated token ids to use instead of --prompt")
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

    serve = commands.add_parser("serve", help="serve a model over the OpenAI API (HTTP)")
    serve.add_argument("model", nargs="?", help="checkpoint directory, .gguf file or hub repo id "
                                               "(default: the embedded SmolLM2-135M-Instruct GGUF)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", help="the name clients give as `model` (default: MODEL as given)")
    serve.add_argument("--api-key", help="a key every request but GET /health must bear (Authorization: Bearer KEY)")
    serve.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                       help="auto: the checkpoint's dtype on CUDA, float32 on the CPU")
    serve.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    serve.add_argument("--max-model-len", type=int, default=4096)
    serve.add_argument("--max-num-seqs", type=int, help="sequences per step at most (default 64)")
    serve.add_argument("--num-blocks", type=int, help="KV-cache blocks (default: as many as the memory budget holds)")
    serve.add_argument("--kv-cache-gib", type=float, help="the KV cache's memory (default: 1 GiB on the CPU, "
                                                          "on CUDA what the model leaves of 90%% of the device)")
    serve.add_argument("--enforce-eager", action="store_true", help="on CUDA, run decode steps without CUDA graphs")
    serve.set_defaults(run=_serve)

    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"zoo {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
