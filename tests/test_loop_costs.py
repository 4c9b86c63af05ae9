"""The adaptive loop's named cost inputs (`ssd_jax.loop.costs`): the host builds them by name, the
program reads them back by name, eagerly and under jit; and every parts class declares what the
skeleton and the adaptive loop read of it (`Parts`, `AdaptiveParts`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ssd_jax
from ssd_jax.loop import skeleton
from ssd_jax.loop.costs import NUM_COST_INPUTS, LoopCosts, cost_vector, host_costs
from ssd_jax.loop.decoder import make_parts
from ssd_jax.tuning import cost_model
from spec_models import pair

NAMED = dict(ar_step=1.0, spec_step=1.5, draft_forward=0.25, acceptance=0.7, forced_cap=3.0)


def test_a_vector_built_by_name_reads_back_by_name_on_the_host_and_under_jit():
    vector = cost_vector(**NAMED, cap_seconds=[1.4, 0.0, 2.5])
    assert vector.dtype == np.float32 and vector.shape == (NUM_COST_INPUTS + 3,)
    for costs in (LoopCosts.from_vector(jnp.asarray(vector)), jax.jit(LoopCosts.from_vector)(jnp.asarray(vector)),
                  host_costs(vector)):
        assert {name: float(getattr(costs, name)) for name in NAMED} == pytest.approx(NAMED)
        np.testing.assert_allclose(np.asarray(costs.cap_seconds), [1.4, 0.0, 2.5], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(LoopCosts.from_vector(jnp.asarray(vector)).to_vector()), vector)
    assert host_costs(cost_vector(**NAMED)).cap_seconds is None


def test_the_host_s_cost_inputs_are_named_fields():
    costs = cost_model.StepCosts(target_fixed=1.0, target_per_token=0.1, draft=0.2)
    read = host_costs(cost_model.loop_inputs(costs, 0.6, verify_width=5, draft_len=4))
    assert (read.ar_step, read.spec_step, read.draft_forward) == pytest.approx((1.1, 1.7, 0.2))
    assert read.acceptance == pytest.approx(0.6) and read.forced_cap == 0.0 and list(read.cap_seconds) == [0] * 4
    assert host_costs(cost_model.force_cap(2)).forced_cap == 2.0
    assert host_costs(cost_model.FORCE_SPECULATION).forced_cap > 1e5
    assert host_costs(cost_model.FORCE_PLAIN).spec_step > host_costs(cost_model.FORCE_PLAIN).ar_step


@pytest.mark.parametrize("method", [ssd_jax.AR(), ssd_jax.SD(), ssd_jax.SpecInfer(paths=2), ssd_jax.PLD(),
                                    ssd_jax.LogitSpec(tree_size=8), ssd_jax.CSD()],
                         ids=["ar", "sd", "specinfer", "pld", "logitspec", "csd"])
def test_every_parts_class_declares_what_the_loops_read(method):
    target, draft = pair(vocab=64, seed=0, noise=0.3, layers=1)
    if method.name == "csd":
        draft = (draft, ssd_jax.MaxGram.for_target(target, np.roll(np.arange(64, dtype=np.int32), 1)))
    sampling = ssd_jax.SamplingParams()
    plan = cost_model.prior_plan(method, target, draft, sampling)[0] if method.adaptive else None
    parts = make_parts(method, target, draft if method.drafts_with_model else None, sampling, 8, 16, plan=plan)
    protocols = (skeleton.Parts, skeleton.AdaptiveParts) if method.adaptive else (skeleton.Parts,)
    members = {name for protocol in protocols for name in list(vars(protocol).get("__annotations__", {}))
               + [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]}
    missing = sorted({name for name in members if not hasattr(parts, name)})
    assert not missing, f"{type(parts).__name__} lacks {missing}"
    assert dataclasses.is_dataclass(parts)
