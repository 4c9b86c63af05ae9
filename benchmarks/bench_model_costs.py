"""Cost of one forward of the embedded target and draft through the KV cache (batch 1, CPU):
the ratio that decides whether speculation can pay. Writes benchmarks/results/model_costs.json."""

from __future__ import annotations

import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ssd_jax  # noqa: E402
from benchmarks.common import RESULTS_DIR, format_table, load_average, machine_info, write_json  # noqa: E402
from ssd_jax.models.kv_cache import init_cache  # noqa: E402
from ssd_jax.models.transformer import forward_cached  # noqa: E402


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


def main() -> int:
    info = machine_info()
    target, draft = ssd_jax.default_models()
    rows, results = [], []
    for new_tokens in (1, 6):
        t_ms, d_ms = forward_ms(target, new_tokens), forward_ms(draft, new_tokens)
        results.append(dict(new_tokens=new_tokens, target_ms=t_ms, draft_ms=d_ms, ratio=t_ms / d_ms))
        rows.append([new_tokens, t_ms, d_ms, t_ms / d_ms])
    info["load_average_at_end"] = load_average()
    write_json(os.path.join(RESULTS_DIR, "model_costs.json"), dict(
        benchmark="forward cost through the KV cache, batch 1, context 256, float32", machine=info,
        target_params=target.config.num_params, draft_params=draft.config.num_params, results=results))
    print(format_table(["new tokens", "target ms", "draft ms", "ratio"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
