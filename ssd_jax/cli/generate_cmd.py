"""`ssd-jax generate`: decode a prompt with any method (default: the embedded pair), print the
text (or stream it with --stream), then a short stats summary."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ssd_jax.errors import InputError
from ssd_jax.methods import CLI_DEFAULT_METHOD, METHODS
from ssd_jax.runtime.progress import show_notices
from ssd_jax.sampling import COUPLINGS

SUMMARY_FIELDS = (
    "num_generated_tokens", "tokens_per_second", "wall_time_s", "compile_time_s", "target_calls",
    "acceptance_rate", "mean_acceptance_length", "block_efficiency", "cache_hit_rate",
)


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1]")
    parser.add_argument("--coupling", default="rejection", choices=list(COUPLINGS),
                        help="rejection (default): speculative sampling, the target's law; gumbel: every method "
                             "gives autoregressive sampling's exact tokens for the seed")
    parser.add_argument("--seed", type=int, default=0, help="PRNG seed for sampling")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate text (default models: the embedded target/draft pair)",
        description="Generate a continuation of PROMPT, print it (--stream: as it is decoded), then print stats.",
    )
    parser.add_argument("prompt", nargs="*", help="prompt text (several = a batch)")
    parser.add_argument("--prompt-ids", action="append", default=None,
                        help="comma-separated token ids instead of text (repeat for a batch)")
    parser.add_argument("--target", "--model", dest="target", default=None,
                        help="target model directory, HF or converted (default: embedded target)")
    parser.add_argument("--draft", default=None, help="draft model directory (default: embedded draft); with "
                        "--method eagle, a head directory (default: the embedded head)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="params dtype (default: the backend's: float32 on CPU, bfloat16 on GPU/TPU)")
    parser.add_argument("--method", default=CLI_DEFAULT_METHOD,
                        help=f"one of {', '.join(METHODS)} (default: {CLI_DEFAULT_METHOD}; defaults of every option: "
                             f"ssd_jax.methods.DEFAULTS, README)")
    parser.add_argument("--num-draft-tokens", type=draft_len_arg, default=None,
                        help="draft length L, or 'auto' for adaptive speculation (speculative methods)")
    parser.add_argument("--max-draft-len", type=int, default=None,
                        help="the longest draft --num-draft-tokens auto may choose (8)")
    parser.add_argument("--draft-threshold", type=float, default=None,
                        help="auto: a single-path draft stops when its top probability falls below this (0.02)")
    parser.add_argument("--num-paths", type=int, default=None, help="draft paths K (multi-path methods)")
    retrieval = parser.add_argument_group("retrieval drafting (--method pld|logitspec)")
    retrieval.add_argument("--prompt-lookup-min", type=int, default=None, help="pld: smallest n-gram matched (1)")
    retrieval.add_argument("--prompt-lookup-max", type=int, default=None, help="pld: largest n-gram matched (3)")
    retrieval.add_argument("--logitspec-topk", type=int, default=None,
                           help="logitspec: next-next guesses taken from the last logit (16)")
    retrieval.add_argument("--tree-capacity", type=int, default=None, help="logitspec: tree nodes, root included (64)")
    retrieval.add_argument("--max-ngram", type=int, default=None, help="logitspec: largest n-gram retrieved (3)")
    cascade = parser.add_argument_group("cascade speculative drafting (--method csd)")
    cascade.add_argument("--drafts", default=None, metavar="DIR[,DIR...]",
                         help="drafter model directories, largest first (default: --draft, else the embedded draft)")
    cascade.add_argument("--k-matrix", type=parse_k_matrix_arg, default=None, metavar="ROWS",
                         help="rows separated by ';', entries by ',' (e.g. '0,4,1;0,0,2;0,0,0': the target gets 4 "
                              "rounds of draft 1, each reviewing 2 Max-Gram tokens, then 1 Max-Gram token) or JSON")
    cascade.add_argument("--max-draft-tokens", type=draft_len_arg, default=None,
                         help="the most cascade draft tokens the target verifies per step (default: the "
                              "cascade's cap), or 'auto' (that cap, and plain decoding while the cascade does not pay)")
    cascade.add_argument("--lenience", type=float, default=None,
                         help="drafters keep a token whose probability is within this factor of their top one "
                              "(>= 1; above 1 at temperature 0 only; default 2 there, else 1)")
    ssd = parser.add_argument_group("speculative speculative decoding (--method ssd)")
    ssd.add_argument("--fanout-budget", type=int, default=None, help="ssd: speculations prepared per step (10)")
    ssd.add_argument("--fanout", default=None, choices=["geometric", "uniform"],
                     help="ssd: how the budget spreads over outcome depths (geometric = Saguaro)")
    ssd.add_argument("--saguaro-c", type=float, default=None,
                     help="ssd: Saguaro sampling's down-weighting C of cached tokens, in [0, 1] (1 = off)")
    ssd.add_argument("--fallback", default=None, choices=["jit", "ngram", "auto"],
                     help="ssd: drafting after a cache miss (jit = draft model; auto = n-gram at batch >= 8)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, stats)")
    parser.add_argument("--compare", action="store_true", help="also run autoregressive decoding; print the speedup")
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument("--stream", action="store_true",
                       help="print the text of one prompt as it is decoded, in pieces that grow while they take "
                            "under 0.1 s (two programs of their own, kept by the compile cache like the others)")
    shown.add_argument("--no-stream", action="store_true", help="print the text when done (the default)")
    parser.add_argument("--compile-cache", default=None, metavar="DIR",
                        help="keep compiled programs in DIR, so the next run loads them instead of compiling "
                             "('' : none; default: $SSD_JAX_COMPILE_CACHE, else ~/.cache/ssd_jax/xla, "
                             "unless JAX_COMPILATION_CACHE_DIR is set)")
    add_sampling_arguments(parser)
    parser.set_defaults(func=run)


def draft_len_arg(text: str):
    """'auto' or an integer (checked by the method object)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def parse_k_matrix_arg(text: str) -> list[list[int]]:
    """'0,4,1;0,0,2;0,0,0' or '[[0,4,1],[0,0,2],[0,0,0]]' -> nested lists of ints (checked by generate)."""
    try:
        value = json.loads(text) if text.strip().startswith("[") else [
            [int(v) for v in row.split(",") if v.strip()] for row in text.split(";") if row.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected rows like '0,4,1;0,0,2;0,0,0', got {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(row, list) for row in value):
        raise argparse.ArgumentTypeError(f"expected a list of rows, got {text!r}")
    return value


def encode_prompts(args, tokenizer) -> list[list[int]]:
    prompts: list[list[int]] = []
    for text in args.prompt or []:
        if tokenizer is None:
            raise InputError("a text prompt needs a model with tokenizer.json; pass --prompt-ids instead")
        ids = tokenizer.encode(text).ids
        if not ids:
            raise InputError(f"prompt {text!r} encodes to no tokens")
        prompts.append(ids)
    for ids in args.prompt_ids or []:
        try:
            prompts.append([int(t) for t in ids.split(",") if t.strip()])
        except ValueError:
            raise InputError(f"--prompt-ids must be comma-separated integers, got {ids!r}") from None
    if not prompts:
        raise InputError("give a PROMPT or --prompt-ids")
    return prompts


def load_models(args):
    """(target, draft or None) from the flags, defaulting to the embedded pair."""
    import ssd_jax
    from ssd_jax.defaults import default_model_dirs
    from ssd_jax.runtime.pairing import check_same_tokenizer

    if args.target is None:
        target_dir, default_draft = default_model_dirs()
        draft_dir = args.draft or default_draft
    else:
        target_dir, draft_dir = args.target, args.draft
    target = ssd_jax.load(target_dir, dtype=args.dtype)
    if args.method == "eagle":   # --draft names a head directory (default: the embedded target's head)
        from ssd_jax.defaults import EAGLE_HEAD_DIR
        from ssd_jax.eagle import load_head

        if args.draft is None and args.target is not None:
            raise InputError("--method eagle with --target needs --draft HEAD_DIR (a head trained for that target: "
                             "ssd-jax train-head, or an EAGLE-3 head converted by python -m checkpoints_convert --eagle3)")
        return target, load_head(args.draft or EAGLE_HEAD_DIR, target=target, dtype=args.dtype)
    uses_draft = args.method not in ("ar", "pld", "logitspec") and not (args.method == "csd" and args.drafts)
    draft = ssd_jax.load(draft_dir, dtype=args.dtype) if draft_dir and uses_draft else None
    if draft is not None:
        check_same_tokenizer(target, draft)
    return target, draft


class TextStreamer:
    """Prints row 0's text as tokens arrive (decoding the whole row each time, so multi-token
    characters and merges come out right)."""

    def __init__(self, tokenizer, prefix: str = ""):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.printed = ""
        self.prefix = prefix

    def __call__(self, new_tokens, counts) -> None:
        if self.prefix:
            sys.stdout.write(self.prefix)
            self.prefix = ""
        self.tokens.extend(int(t) for t in new_tokens[0, : int(counts[0])])
        text = self._text()
        if text.startswith(self.printed) and not text.endswith("\ufffd"):
            self._write(text)

    def finish(self) -> None:
        """Prints what was held back when the decode ended: the text after the last piece that
        ended inside a character (the unstreamed output prints it, a replacement character
        included), or where a merge rewrote what was printed, the text past what both share."""
        if self.prefix:
            sys.stdout.write(self.prefix)
            self.prefix = ""
        text = self._text()
        shared = len(os.path.commonprefix([text, self.printed]))
        sys.stdout.write(text[shared:])
        sys.stdout.flush()
        self.printed = text

    def _text(self) -> str:
        return self.tokenizer.decode(self.tokens) if self.tokenizer else " ".join(map(str, self.tokens)) + " "

    def _write(self, text: str) -> None:
        sys.stdout.write(text[len(self.printed):])
        sys.stdout.flush()
        self.printed = text


# Method options settable from the command line (argparse dest -> method field: generate.OLD_OPTIONS).
METHOD_OPTION_FLAGS = ("num_draft_tokens", "max_draft_len", "draft_threshold", "num_paths", "prompt_lookup_min", "prompt_lookup_max", "logitspec_topk",
                       "tree_capacity", "max_ngram", "fanout_budget", "fanout", "saguaro_c", "fallback",
                       "k_matrix", "max_draft_tokens", "lenience")


def load_drafts(args, target, draft) -> list:
    """The drafters of --method csd: --drafts DIR[,DIR...] (largest first), else [the --draft or
    embedded draft]. InputError for --drafts with another method or a drafter with another tokenizer."""
    import ssd_jax
    from ssd_jax.runtime.pairing import check_same_tokenizer

    if args.method != "csd":
        raise InputError(f"--drafts is for --method csd (got --method {args.method}); use --draft")
    if not args.drafts:
        return [draft] if draft is not None else None
    drafts = [ssd_jax.load(d.strip(), dtype=args.dtype) for d in args.drafts.split(",") if d.strip()]
    for model in drafts:
        check_same_tokenizer(target, model)
    return drafts


def build_method(args):
    """The method object of the flags: --method's class with the given option flags as fields
    (defaults from `ssd_jax.methods.DEFAULTS`); InputError for a flag the method does not take."""
    import dataclasses

    from ssd_jax.generate import OLD_OPTIONS
    from ssd_jax.methods import METHOD_CLASSES, as_method

    cls = type(as_method(args.method))  # InputError naming an unknown method
    fields = {f.name for f in dataclasses.fields(cls)}
    given = {name: getattr(args, name) for name in METHOD_OPTION_FLAGS if getattr(args, name, None) is not None}
    for name in given:
        if OLD_OPTIONS[name] not in fields:
            raise InputError(f"--{name.replace('_', '-')} is not an option of --method {args.method} "
                             f"({cls.__name__} takes {', '.join(sorted(fields)) or 'no options'})")
    return cls(**{OLD_OPTIONS[name]: value for name, value in given.items()})


def print_stats(stats: dict, file=sys.stdout) -> None:
    shown = {k: stats[k] for k in SUMMARY_FIELDS if k in stats}
    print("--- " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()),
          file=file)


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
    print_stats(out.stats)


def run(args) -> int:
    import jax

    import ssd_jax
    from ssd_jax.runtime.compile_cache import use_command_line_cache

    use_command_line_cache(args.compile_cache)
    if sys.stderr.isatty():   # a first run compiles and times for tens of seconds: say so
        show_notices(sys.stderr)
    target, draft = load_models(args)
    method = build_method(args)
    if args.method == "csd" or args.drafts:
        drafts = load_drafts(args, target, draft)
        draft = tuple(drafts) if drafts is not None else None
    prompts = encode_prompts(args, target.tokenizer)
    common = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, coupling=args.coupling, key=jax.random.PRNGKey(args.seed))
    if args.stream and (args.json or len(prompts) > 1):
        raise InputError("--stream prints one prompt's text as it is decoded; got "
                         + ("--json" if args.json else f"{len(prompts)} prompts"))
    streaming = args.stream
    stream = TextStreamer(target.tokenizer, prefix=args.prompt[0] if args.prompt else "") if streaming else None
    out = ssd_jax.generate(target, prompts, method=method, draft=draft, stream=stream, **common)
    baseline = None
    if args.compare:
        out, baseline, speedup = compare_with_ar(
            lambda: ssd_jax.generate(target, prompts, method=method, draft=draft, **common),
            lambda: ssd_jax.generate(target, prompts, method="ar", **common))
        out.stats["ar_tokens_per_second"] = baseline.stats["tokens_per_second"]
        out.stats["speedup_over_ar"] = speedup
        out.stats["compare_rounds"] = COMPARE_ROUNDS
    if streaming:
        stream.finish()
        print()
        print_stats(out.stats)
    elif len(prompts) == 1 and not args.json:
        # As the stream shows it: the prompt, its continuation, the stats.
        text = out.texts(target.tokenizer)[0] if target.tokenizer is not None else " ".join(map(str, out.tokens[0]))
        print((args.prompt[0] if args.prompt else "") + text)
        print_stats(out.stats)
    else:
        print_result(out, target.tokenizer, args.json)
    if baseline is not None and not args.json:
        print(f"--- speedup over autoregressive: {out.stats['speedup_over_ar']:.2f}x "
              f"(median of {COMPARE_ROUNDS} paired runs; {out.stats['tokens_per_second']:.1f} vs "
              f"{baseline.stats['tokens_per_second']:.1f} tokens/s in the median runs)")
    return 0


COMPARE_ROUNDS = 5


def compare_with_ar(run_method, run_ar):
    """(the method's median run, AR's median run, the speedup): after one warm run of each (a
    fresh executable's first run is slow: page faults, cold caches), COMPARE_ROUNDS rounds that
    each run both back to back, unstreamed (streaming costs a host copy per step). The speedup is
    the median over rounds of the round's tokens/s ratio: a shared machine's speed drifts between
    calls, and a pair run in the same round sees the same drift, where single calls can scatter
    far from the true ratio. The median runs are by tokens/s, their stats whole."""
    def speed(out):
        return out.stats["tokens_per_second"]

    run_method(), run_ar()
    rounds = [(run_method(), run_ar()) for _ in range(COMPARE_ROUNDS)]
    middle = COMPARE_ROUNDS // 2
    ratio = sorted(speed(spec) / speed(ar) for spec, ar in rounds)[middle]
    return (sorted((spec for spec, _ in rounds), key=speed)[middle],
            sorted((ar for _, ar in rounds), key=speed)[middle], ratio)
