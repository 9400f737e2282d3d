"""The ``zoo`` command line."""

import argparse
import sys

DTYPES = ("float32", "bfloat16", "float16")


def _diff(args) -> int:
    import torch

    from loaders.default_model import default_model_path
    from loaders.diff import diff_checkpoint, format_rows

    model = args.model or str(default_model_path())
    input_ids = None
    if args.token_ids:
        input_ids = torch.tensor([[int(t) for t in args.token_ids.split(",")]])
    print(f"zoo diff: {model} ({args.dtype}, {args.device}) against HuggingFace transformers", flush=True)
    rows = diff_checkpoint(model, input_ids=input_ids, prompt=args.prompt, dtype=getattr(torch, args.dtype),
                           device=args.device, atol=args.atol, rtol=args.rtol)
    print(format_rows(rows))
    return 0 if all(r.ok for r in rows) else 1


def main(argv=None) -> int:
    from loaders.diff import DEFAULT_PROMPT

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
    diff.set_defaults(run=_diff)

    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"zoo {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
