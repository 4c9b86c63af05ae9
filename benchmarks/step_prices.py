"""A call of adaptive speculation priced by its own step costs: each speculative step at the
seconds the loop's calibration gives its cap, each plain step at the AR step's.

`adaptive_steps.py --priced` compares "auto" with fixed draft lengths this way. At T=0 under one
replayed calibration the step counts are exact, so the comparison is free of the machine's noise
(a timed cell on the 2-core VM moves by +-0.05 between runs); what it leaves out is the loop's own
overhead over a fixed length's program, which only a timed run shows.
"""

from __future__ import annotations

from ssd_jax.engine.adaptive_loop import NUM_COST_INPUTS


def step_price(loop_costs: list[float], cap: int) -> float:
    """Seconds of one loop step at `cap` (0: a plain step). loop_costs: a call's `loop_costs` stat,
    the loop's cost inputs (AR step, speculative step without draft forwards, one draft forward,
    prior acceptance, forced cap, then the seconds of a step at each cap 1..L, 0 where the
    calibration did not time it): the timed seconds of the cap where there are some, else the
    speculative step plus cap - 1 draft forwards."""
    if cap == 0:
        return loop_costs[0]
    index = NUM_COST_INPUTS + cap - 1
    timed = loop_costs[index] if index < len(loop_costs) else 0.0
    return timed if timed > 0 else loop_costs[1] + (cap - 1) * loop_costs[2]


def priced_seconds(loop_costs: list[float], steps_by_cap: list[int], plain_steps: int) -> float:
    """A call's seconds at its loop's prices: its speculative steps by cap 1..L (the
    `steps_by_cap` stat) and its plain steps, each at `step_price` (not the prefill, which every
    configuration pays alike)."""
    return (sum(n * step_price(loop_costs, cap) for cap, n in enumerate(steps_by_cap, start=1))
            + plain_steps * step_price(loop_costs, 0))
