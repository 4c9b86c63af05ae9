"""What a LogitSpec step would accept at each position of greedy text, and what that says about
which trees are worth verifying (no timing: T=0 outcomes are deterministic).

    python benchmarks/logitspec_outcomes.py [--prompts 2] [--new-tokens 128] [--smoke]

For the held-out sets of `bench_regimes` (code, prose, repetition) on the embedded target: the
target's greedy text and its logits (one forward over prompt + text), then at every position the
LogitSpec tree a step there would verify (context = prompt + text so far, last logits = the ones
the current token was drawn from) and the depth the exact walk accepts on the text that follows.
Widening the target (`ssd_jax.testing.widen`) leaves every logit as it is, so these are the
cost regimes' outcomes too.

Reported per set and tree (root branch L, tree size N):
- the share of positions whose root branch retrieves nothing, and the chance that a tree verified
  there accepts anything (only the last logit's guesses remain);
- the mean accepted depth where the root branch retrieved something;
- tokens per priced step of three step rules, replayed over the text: always verify ("always"),
  verify only where the root branch retrieved something, else a plain step ("retrieved": the
  gate of `RetrievalParts.gates`), and the oracle that verifies only where it accepts something.
  A plain step costs 1, a verified tree `--tree-price` (1.39: the calibrated price of an 8-node
  tree against a plain step of the 8x-widened target at batch 1 on the 2-core VM of
  docs/benchmarks.md).

Writes benchmarks/results/logitspec_outcomes.json. --smoke: one prompt a set, 16 tokens, one tree.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR, format_table, machine_info, write_json  # noqa: E402

TREES = ((6, 8), (7, 8), (6, 16), (8, 16))   # (root branch L, tree size N); 8: the CPU's default size
TREE_PRICE = 1.39
LOOKAHEAD = 12                                # text tokens a walk may match (> the longest branch)


def greedy_text(target, prompt: list[int], new_tokens: int) -> tuple[list[int], np.ndarray]:
    """(the target's greedy continuation, the logits float32 [T, V] of prompt + continuation)."""
    import jax.numpy as jnp

    import ssd_jax
    from ssd_jax import reference

    tokens = ssd_jax.generate(target, [prompt], max_new_tokens=new_tokens).tokens[0]
    logits = np.asarray(reference.forward(target, jnp.asarray([prompt + tokens], jnp.int32)))[0]
    return tokens, logits


def outcomes(prompt: list[int], text: list[int], logits: np.ndarray, root_len: int, size: int) -> dict:
    """Per position i of text (the current token text[i]): the accepted depth of the tree a step
    there verifies, and how many root-branch nodes retrieved something. Lists of ints."""
    import jax
    import jax.numpy as jnp

    from ssd_jax.draft.logitspec import logitspec_tree
    from ssd_jax.draft.tree_layout import logitspec_layout
    from ssd_jax.loop.shadow import matched_depth
    from ssd_jax.methods import LogitSpec

    method = LogitSpec(draft_len=root_len, tree_size=size)
    layout = logitspec_layout(root_len, method.topk, size)
    sequence = np.asarray(prompt + text, np.int32)
    n = len(text)
    current = len(prompt) + np.arange(n)                   # the current token's position
    context = np.zeros((n, len(sequence)), np.int32)
    for i, position in enumerate(current):
        context[i, :position + 1] = sequence[:position + 1]
    follow = np.zeros((n, LOOKAHEAD), np.int32)
    follow_len = np.zeros(n, np.int32)
    for i in range(n):
        after = text[i + 1:i + 1 + LOOKAHEAD]
        follow[i, :len(after)], follow_len[i] = after, len(after)
    tree = jax.jit(lambda c, length, last: logitspec_tree(c, length, last, layout, max_ngram=method.max_ngram))
    tokens, valid = tree(jnp.asarray(context), jnp.asarray(current + 1, jnp.int32), jnp.asarray(logits[current - 1]))
    depth = matched_depth(tokens, valid, np.asarray(layout.parents), jnp.asarray(follow), jnp.asarray(follow_len))
    retrieved = np.asarray(valid)[:, 1:1 + layout.lengths[0]].sum(axis=1)
    return dict(depth=np.asarray(depth).tolist(), retrieved=retrieved.tolist())


def replay(depth: list[int], retrieved: list[int], rule: str, tree_price: float) -> tuple[int, float]:
    """(tokens, price) of decoding the text by `rule` from its first token: "always", "retrieved"
    or "oracle" (module docstring)."""
    i, price, n = 0, 0.0, len(depth)
    while i < n - 1:
        verify = dict(always=True, retrieved=retrieved[i] > 0, oracle=depth[i] > 0)[rule]
        i += depth[i] + 1 if verify else 1
        price += tree_price if verify else 1.0
    return i, price


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=2, help="prompts per set")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--tree-price", type=float, default=TREE_PRICE, help="a verified tree over a plain step")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "logitspec_outcomes.json"))
    args = parser.parse_args(argv)
    prompts, new_tokens, trees = (1, 16, TREES[:1]) if args.smoke else (args.prompts, args.new_tokens, TREES)

    import ssd_jax
    from benchmarks.bench_regimes import prompt_sets

    target, _ = ssd_jax.default_models()
    texts = {name: [(p, *greedy_text(target, p, new_tokens)) for p in batch]
             for name, batch in prompt_sets(target.tokenizer, prompts, 1).items()}
    rows, table = [], []
    for root_len, size in trees:
        for name, cases in texts.items():
            found = [outcomes(p, text, logits, root_len, size) for p, text, logits in cases]
            depth = np.concatenate([f["depth"] for f in found])
            retrieved = np.concatenate([f["retrieved"] for f in found]) > 0
            row = dict(set=name, root_branch=root_len, tree_size=size, positions=int(depth.size),
                       share_nothing_retrieved=float(np.mean(~retrieved)),
                       accepts_anything_where_nothing_retrieved=(float(np.mean(depth[~retrieved] > 0))
                                                                 if np.any(~retrieved) else None),
                       mean_depth_where_retrieved=float(np.mean(depth[retrieved])) if np.any(retrieved) else None)
            for rule in ("always", "retrieved", "oracle"):
                tokens, price = np.sum([replay(f["depth"], f["retrieved"], rule, args.tree_price) for f in found],
                                       axis=0)
                row[f"tokens_per_price_{rule}"] = float(tokens / price)
            rows.append(row)
            table.append([name, f"{root_len}/{size}", f"{row['share_nothing_retrieved']:.2f}",
                          row["accepts_anything_where_nothing_retrieved"], row["mean_depth_where_retrieved"],
                          *(f"{row[f'tokens_per_price_{r}']:.2f}" for r in ("always", "retrieved", "oracle"))])
    print(format_table(["set", "L/N", "nothing retrieved", "accepts there", "depth where retrieved",
                        "always", "retrieved", "oracle"], table))
    if not args.smoke:
        write_json(args.out, dict(machine=machine_info(), new_tokens=new_tokens, prompts_per_set=prompts,
                                  tree_price=args.tree_price, rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
