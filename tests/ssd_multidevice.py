"""Multi-device SSD checks, run by tests/test_ssd.py in a subprocess whose XLA_FLAGS fake N CPU
devices (`--xla_force_host_platform_device_count=N`, read when jax starts; the rest of the suite
runs with one device, hence a separate process). Prints one JSON line with the findings.

  python tests/ssd_multidevice.py split    # N=2: default groups [0] / [1], CPU programs run inline
                                           # in the dispatching threads (async dispatch off), so
                                           # the draft's thread really computes beside the target's
  python tests/ssd_multidevice.py groups   # N=4: default groups [0, 1] / [2, 3], async dispatch
  python tests/ssd_multidevice.py plain    # N=2: target_devices [1], draft_devices [0], an "auto"
                                           # call that a remembered verdict decodes plainly
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import ssd_jax  # noqa: E402
from spec_models import llama, noisy_copy  # noqa: E402


def _devices_of(tree) -> set[int]:
    return {d.id for leaf in jax.tree.leaves(tree) for d in leaf.sharding.device_set}


def _placements(seen: dict) -> dict:
    """Which device ids hold each kind of array (every leaf of the group's trees)."""
    return dict(
        target_params=sorted(_devices_of(seen["target_params"])),
        target_state=sorted(_devices_of(seen["target_state"])),
        draft_params=sorted(_devices_of(seen["draft_params"])),
        draft_state=sorted(_devices_of(seen["draft_state"])),
        speculation_cache=sorted(_devices_of([x for x in seen["cache"] if x is not None])),
        q_for_verify=sorted(_devices_of(seen["q"])) if seen["q"] is not None else None,
        target_cache_rows_split=not seen["target_state"]["cache"].lengths.sharding.is_fully_replicated,
    )


def run(check: str) -> dict:
    from ssd_jax.runtime.prompts import prepare_prompts
    from ssd_jax.ssd.host_loop import generate_ssd
    from ssd_jax.ssd.call import ssd_engine_options
    from ssd_jax.sampling import SamplingParams

    target = llama(64, 64, 2, seed=0)
    draft = noisy_copy(target, 0.03, 5)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, 64, n).tolist() for n in ((6, 13) if check == "groups" else (6, 1, 13))]
    reference = ssd_jax.generate(target, prompts, max_new_tokens=32)
    seen: dict = {}

    def decode(temperature: float, observe=None, **options):
        batch = prepare_prompts(prompts, target.config, 32)
        kwargs = ssd_engine_options(ssd_jax.SSD(**options), draft_len=4)   # placement, not "auto"
        return generate_ssd(target, draft, batch, 32, SamplingParams(temperature=temperature), jax.random.PRNGKey(2),
                            observe=observe, **kwargs)

    out = decode(1.0, observe=seen.update)
    greedy = decode(0.0)
    ids = jax.devices()
    result = dict(devices=len(ids), colocated=out.stats["colocated"], cpu_async_dispatch=out.stats["cpu_async_dispatch"],
                  target_devices=sorted(int(s.split(":")[1]) for s in out.stats["target_devices"]),
                  draft_devices=sorted(int(s.split(":")[1]) for s in out.stats["draft_devices"]),
                  equal_to_ar=greedy.tokens == reference.tokens, cache_hit_rate=greedy.stats["cache_hit_rate"],
                  placements=_placements(seen))
    t_ids, d_ids = result["target_devices"], result["draft_devices"]
    p = result["placements"]
    result["placements_ok"] = (
        p["target_params"] == t_ids and p["target_state"] == t_ids and p["q_for_verify"] == t_ids
        and p["draft_params"] == d_ids and p["draft_state"] == d_ids and p["speculation_cache"] == d_ids
        and p["target_cache_rows_split"] == (check == "groups"))
    if check == "split":
        # The same programs on one device: identical samples (placement changes nothing but speed).
        colocated = decode(1.0, target_devices=[0], draft_devices=[0])
        result["sampled_equal_to_colocated"] = colocated.tokens == out.tokens and colocated.stats["colocated"]
    return result


def run_plain() -> dict:
    """Where an SSD "auto" call that a remembered verdict decodes plainly runs AR's loop: the
    devices its target's params live on, and whether its tokens are AR's."""
    generate_module = sys.modules["ssd_jax.generate"]
    from ssd_jax.ssd import auto as ssd_auto

    target = llama(64, 64, 2, seed=0)
    draft = noisy_copy(target, 0.03, 5)
    prompts = [[5, 9, 2, 7], [3]]
    reference = ssd_jax.generate(target, prompts, max_new_tokens=16)
    seen = []
    original = generate_module._run

    def spy(call, method):
        seen.append(sorted({d.id for leaf in jax.tree.leaves(call.target.params) for d in leaf.sharding.device_set}))
        return original(call, method)

    generate_module._run = spy
    ssd_auto.starts_plain = lambda memory, key, *acceptance: True   # the verdict: SSD was slower for this program
    method = ssd_jax.SSD(draft_len="auto", target_devices=[1], draft_devices=[0])
    out = ssd_jax.generate(target, prompts, max_new_tokens=16, method=method, draft=draft)
    return dict(plain_from_start=bool(out.stats.get("plain_from_start")), target_params_on=seen,
                equal_to_ar=out.tokens == reference.tokens)


if __name__ == "__main__":
    if sys.argv[1] == "split":
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    print(json.dumps(run_plain() if sys.argv[1] == "plain" else run(sys.argv[1])))
