"""`ssd-jax generate`: decode prompts with any method and print the text and the stats."""

from __future__ import annotations

import argparse
import json
import sys

from ssd_jax.errors import InputError


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)


def register(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate text from prompts")
    parser.add_argument("--model", required=True, help="target model directory (Hugging Face or converted)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--prompt", action="append", default=None,
                        help="prompt text (repeat for a batch); needs the model's tokenizer.json")
    parser.add_argument("--prompt-ids", action="append", default=None,
                        help="comma-separated token ids (repeat for a batch)")
    parser.add_argument("--method", default="ar")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_sampling_arguments(parser)
    parser.set_defaults(func=run)


def encode_prompts(args, tokenizer) -> list[list[int]]:
    prompts: list[list[int]] = []
    for text in args.prompt or []:
        if tokenizer is None:
            raise InputError("--prompt needs a model with tokenizer.json; pass --prompt-ids instead")
        prompts.append(tokenizer.encode(text).ids)
    for ids in args.prompt_ids or []:
        try:
            prompts.append([int(t) for t in ids.split(",") if t.strip()])
        except ValueError:
            raise InputError(f"--prompt-ids must be comma-separated integers, got {ids!r}") from None
    if not prompts:
        raise InputError("give at least one --prompt or --prompt-ids")
    return prompts


def print_result(out, tokenizer, as_json: bool) -> None:
    texts = out.texts(tokenizer) if tokenizer is not None else None
    if as_json:
        json.dump(dict(tokens=out.tokens, texts=texts, finish_reasons=out.finish_reasons, stats=out.stats),
                  sys.stdout, indent=2)
        print()
        return
    for i, row in enumerate(out.tokens):
        print(f"--- row {i} ({out.finish_reasons[i]}, {len(row)} tokens)")
        print(texts[i] if texts is not None else " ".join(map(str, row)))
    print("--- stats")
    for name, value in out.stats.items():
        print(f"{name:>24}: {value:.4g}" if isinstance(value, float) else f"{name:>24}: {value}")


def run(args) -> int:
    import jax

    import ssd_jax

    model = ssd_jax.load(args.model, dtype=args.dtype)
    prompts = encode_prompts(args, model.tokenizer)
    out = ssd_jax.generate(
        model, prompts, max_new_tokens=args.max_new_tokens, method=args.method,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, key=jax.random.PRNGKey(args.seed),
    )
    print_result(out, model.tokenizer, args.json)
    return 0
