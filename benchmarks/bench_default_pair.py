"""Quality of the embedded default pair on held-out stdlib text.

- held-out loss per token (nats) of the target and the draft;
- draft/target agreement per token: at temperature 0 the argmax match rate, at temperature 1
  alpha = E[sum_x min(p, q)] (the expected token-level acceptance);
- measured acceptance of `method="sd"` (L=5) on held-out prompts at temperature 0 and 1.
Writes benchmarks/results/default_pair_quality.json (`--draft draft_small`: ..._draft_small.json).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ssd_jax  # noqa: E402
from benchmarks.common import RESULTS_DIR, format_table, load_average, machine_info, write_json  # noqa: E402
from benchmarks.heldout_prompts import heldout_prompts  # noqa: E402
from ssd_jax.models.transformer import forward_full  # noqa: E402
from ssd_jax.train.corpus import collect_corpus  # noqa: E402
from ssd_jax.train.data import eval_batches, tokenize_files  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--windows", type=int, default=64, help="held-out windows of 256 tokens")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--draft", default=ssd_jax.defaults.DEFAULT_DRAFT, choices=("draft", "draft_small"),
                        help="which shipped draft (default: the one default_models() returns)")
    args = parser.parse_args(argv)
    info = machine_info()
    target, draft = ssd_jax.default_models(draft=args.draft)
    corpus = collect_corpus()
    eos = target.config.eos_token_ids[0]
    tokens = tokenize_files(target.tokenizer, corpus.heldout, eos)
    windows = eval_batches(tokens, 8, 256, args.windows // 8)

    @jax.jit
    def measures(tp, dp, w):
        p_log = jax.nn.log_softmax(forward_full(tp, target.config, w[:, :-1]), -1)
        q_log = jax.nn.log_softmax(forward_full(dp, draft.config, w[:, :-1]), -1)
        nxt = w[:, 1:, None]
        nll_t = -jnp.take_along_axis(p_log, nxt, -1).mean()
        nll_d = -jnp.take_along_axis(q_log, nxt, -1).mean()
        argmax_match = (jnp.argmax(p_log, -1) == jnp.argmax(q_log, -1)).mean()
        alpha = jnp.minimum(jnp.exp(p_log), jnp.exp(q_log)).sum(-1).mean()
        return jnp.stack([nll_t, nll_d, argmax_match, alpha])

    values = np.mean([np.asarray(measures(target.params, draft.params, jnp.asarray(w))) for w in windows], axis=0)
    quality = dict(heldout_tokens_scored=len(windows) * 8 * 256, target_heldout_loss=float(values[0]),
                   draft_heldout_loss=float(values[1]), argmax_agreement_t0=float(values[2]),
                   expected_acceptance_alpha_t1=float(values[3]))

    prompts = heldout_prompts(target.tokenizer, args.prompts)
    measured = {}
    for temperature in (0.0, 1.0):
        accepted = drafted = 0
        for i, prompt in enumerate(prompts):
            out = ssd_jax.generate(target, [prompt], max_new_tokens=args.new_tokens, method=ssd_jax.SD(draft_len=5),
                                   draft=draft, temperature=temperature, key=jax.random.PRNGKey(i))
            accepted += out.stats["num_accepted_tokens"]
            drafted += out.stats["num_draft_tokens"]
        measured[f"sd_acceptance_rate_t{temperature:g}"] = accepted / drafted
    quality.update(measured)
    info["load_average_at_end"] = load_average()
    result = dict(benchmark="embedded default pair quality on held-out stdlib text", machine=info,
                  target=dict(path=target.path, num_params=target.config.num_params),
                  draft=dict(path=draft.path, num_params=draft.config.num_params),
                  prompts=len(prompts), new_tokens=args.new_tokens, quality=quality)
    name = "default_pair_quality" + ("" if args.draft == "draft" else f"_{args.draft}")
    path = write_json(os.path.join(RESULTS_DIR, f"{name}.json"), result)
    print(format_table(["measure", "value"], [[k, round(v, 4) if isinstance(v, float) else v]
                                              for k, v in quality.items()]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
