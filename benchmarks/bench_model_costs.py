"""Cost of the embedded models (target, draft, draft_small) at batch 1 on this CPU, and how often
each draft's greedy choice agrees with the target's: the numbers that decide whether speculation
(and a two-drafter cascade, draft_small drafting for the draft) can pay.

- one forward through the KV cache at context 256 with 1 and 6 new tokens (median of 5 x 40 calls);
- tokens/s of `ssd_jax.generate(model, ..., method="ar")` (greedy, 128 new tokens) on a held-out
  prompt, best of 5 runs;
- argmax agreement (T=0) on 64 held-out windows of 256 tokens: each draft with the target, and
  draft_small with the draft (the cascade's inner verification).
Writes benchmarks/results/model_costs.json.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ssd_jax  # noqa: E402
from benchmarks.common import RESULTS_DIR, format_table, load_average, machine_info, write_json  # noqa: E402
from benchmarks.heldout_prompts import heldout_prompts  # noqa: E402
from ssd_jax.defaults import shipped_draft  # noqa: E402
from ssd_jax.models.kv_cache import init_cache  # noqa: E402
from ssd_jax.models.transformer import forward_cached, forward_full  # noqa: E402
from ssd_jax.train.corpus import collect_corpus  # noqa: E402
from ssd_jax.train.data import eval_batches, tokenize_files  # noqa: E402


def forward_ms(model, new_tokens: int, context: int = 256, repeats: int = 200) -> float:
    config = model.config
    cache = init_cache(config, 1, context + 64, model.dtype).replace(lengths=jnp.array([context], jnp.int32))
    step = jax.jit(lambda p, t, pos, c: forward_cached(p, config, t, pos, c)[0])
    tokens = jnp.zeros((1, new_tokens), jnp.int32)
    positions = context + jnp.arange(new_tokens, dtype=jnp.int32)[None]
    step(model.params, tokens, positions, cache).block_until_ready()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats // 5):
            out = step(model.params, tokens, positions, cache)
        out.block_until_ready()
        times.append((time.perf_counter() - start) / (repeats // 5) * 1e3)
    return statistics.median(times)


def ar_tokens_per_second(model, prompt, new_tokens: int = 128, runs: int = 5) -> tuple[float, int]:
    """Best tokens/s of greedy `method="ar"` over `runs` (the first call compiles and is not
    counted) and the number of tokens generated (fewer than new_tokens if EOS came first)."""
    ssd_jax.generate(model, [prompt], max_new_tokens=new_tokens, method="ar")
    outs = [ssd_jax.generate(model, [prompt], max_new_tokens=new_tokens, method="ar") for _ in range(runs)]
    return max(o.stats["tokens_per_second"] for o in outs), len(outs[0].tokens[0])


def argmax_agreement(models: dict, pairs, windows) -> dict:
    """For each (a, b) in pairs, the fraction of held-out positions where the argmax of model a
    equals that of model b."""
    matches = {pair: [] for pair in pairs}
    greedy = {name: jax.jit(lambda p, w, config=m.config: jnp.argmax(forward_full(p, config, w), -1))
              for name, m in models.items()}
    for w in windows:
        w = jnp.asarray(w[:, :-1])
        choice = {name: greedy[name](m.params, w) for name, m in models.items()}
        for a, b in pairs:
            matches[(a, b)].append(float((choice[a] == choice[b]).mean()))
    return {f"{a}_vs_{b}": float(np.mean(m)) for (a, b), m in matches.items()}


def main() -> int:
    info = machine_info()
    target, draft = ssd_jax.default_models(draft="draft")
    draft_small = shipped_draft("draft_small")
    models = dict(target=target, draft=draft, draft_small=draft_small)
    rows, results = [], []
    for new_tokens in (1, 6):
        ms = {name: forward_ms(model, new_tokens) for name, model in models.items()}
        results.append(dict(new_tokens=new_tokens, target_ms=ms["target"], draft_ms=ms["draft"],
                            draft_small_ms=ms["draft_small"], ratio=ms["target"] / ms["draft"],
                            target_over_draft_small=ms["target"] / ms["draft_small"],
                            draft_over_draft_small=ms["draft"] / ms["draft_small"]))
        rows.append([f"forward, {new_tokens} new token(s), ms", *(f"{ms[n]:.3f}" for n in models),
                     f"{ms['draft'] / ms['draft_small']:.2f}x"])
    prompt = heldout_prompts(target.tokenizer, 1)[0]
    ar = {}
    for name, model in models.items():
        tps, generated = ar_tokens_per_second(model, prompt)
        ar[name] = dict(tokens_per_second=tps, generated_tokens=generated)
    rows.append(['generate(method="ar"), tokens/s', *(f"{ar[n]['tokens_per_second']:.0f}" for n in models),
                 f"{ar['draft_small']['tokens_per_second'] / ar['draft']['tokens_per_second']:.2f}x"])
    corpus = collect_corpus()
    heldout = tokenize_files(target.tokenizer, corpus.heldout, target.config.eos_token_ids[0])
    windows = eval_batches(heldout, 8, 256, 8)
    agreement = argmax_agreement(models, [("draft", "target"), ("draft_small", "target"), ("draft_small", "draft")],
                                 windows)
    rows.append(["argmax agreement with the target (T=0)", "1", f"{agreement['draft_vs_target']:.3f}",
                 f"{agreement['draft_small_vs_target']:.3f}", ""])
    rows.append(["argmax agreement with the draft (T=0)", "", "1", f"{agreement['draft_small_vs_draft']:.3f}", ""])
    info["load_average_at_end"] = load_average()
    write_json(os.path.join(RESULTS_DIR, "model_costs.json"), dict(
        benchmark="forward cost through the KV cache, batch 1, context 256, float32; greedy "
                  "generate(method='ar') tokens/s on a held-out prompt (128 new tokens, best of 5); "
                  "argmax agreement with the target on held-out windows",
        machine=info, target_params=target.config.num_params, draft_params=draft.config.num_params,
        draft_small_params=draft_small.config.num_params, results=results,
        ar_generate=dict(prompt_tokens=len(prompt), max_new_tokens=128, **ar),
        argmax_agreement_t0=dict(heldout_tokens_scored=len(windows) * 8 * 256, **agreement)))
    print(format_table(["measure", "target", "draft", "draft_small", "draft / draft_small"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
