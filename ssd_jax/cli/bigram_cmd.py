"""`ssd-jax build-bigram`: count Max-Gram's bigram table over a directory of text/code files."""

from __future__ import annotations


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "build-bigram", help="count a Max-Gram bigram table (most frequent next token) over a directory"
    )
    parser.add_argument("--tokenizer", required=True, help="tokenizer.json to tokenize with")
    parser.add_argument("--data", required=True, help="directory whose *.py / *.txt / *.md files are counted")
    parser.add_argument("--out", required=True, help="output .npz file (replaced atomically)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from ssd_jax.draft.bigram import (
        bigram_from_files, list_text_files, load_tokenizer, save_bigram, tokenizer_fingerprint,
    )

    tokenizer = load_tokenizer(args.tokenizer)
    paths = list_text_files(args.data)
    table, num_tokens = bigram_from_files(tokenizer, paths)
    metadata = dict(source=f"build-bigram over {args.data}", files=len(paths), tokens=num_tokens)
    out = save_bigram(args.out, table, tokenizer_fingerprint(tokenizer), metadata)
    print(f"bigram table: {len(paths)} files, {num_tokens} tokens, vocab {table.shape[0]} -> {out}")
    return 0
