"""Calibrations of adaptive speculation recorded by one benchmark run and replayed in another.

Each process measures its own step prices (`ssd_jax.tuning.measure._calibrate`), and on a small
CPU they differ between processes enough to flip a near-tie between two caps: a cell of
`bench_adaptive.py` moves by +-0.05 between runs of the same code. To compare two variants of the
adaptive loop, one run records what it measured, in call order, and the other (on the other
variant) is handed the same prices instead of measuring: its choices then differ only where the
code does. The on-disk calibration store cannot do this, since it is keyed by the program's text,
which differs between variants.
"""

from __future__ import annotations

import json
from contextlib import contextmanager

from benchmarks.common import write_json
from ssd_jax.tuning import against_ar, cost_model, measure


class ReplayError(RuntimeError):
    """A replayed calibration file that does not fit the run (fewer entries than programs, or an
    entry of another length): the runs' programs differ, so their choices would not compare."""


@contextmanager
def calibrations(record: str | None = None, replay: str | None = None):
    """Within the block, `ssd_jax.tuning.measure._calibrate` records what it measures, in call
    order, to the JSON file `record` (rewritten whole after each), or returns the entries of the file
    `replay` in order instead of measuring (and no call is checked against AR's program) (ReplayError when they run out or differ in length
    from what the program's loop takes). Neither: measured as usual."""
    if record and replay:
        raise ValueError("record or replay calibrations, not both")
    measured_by = measure._calibrate
    entries: list[list[float]] = []
    if replay:
        with open(replay) as f:
            entries = json.load(f)
    used = [0]

    def calibrate(executable, args, costs, takes_cap, table_caps=()):
        index = used[0]
        used[0] += 1
        if replay:
            if index >= len(entries):
                raise ReplayError(f"{replay} holds {len(entries)} calibrations; this run needs more "
                                  f"(program {index + 1}): record it with the same options (method, sets, "
                                  f"temperatures, batch sizes, lengths)")
            size = cost_model.calibration_length(int(args[-1].shape[0]))
            if len(entries[index]) != size:
                raise ReplayError(f"calibration {index + 1} of {replay} has {len(entries[index])} entries, "
                                  f"the program takes {size}: recorded for another configuration")
            return tuple(entries[index])
        measured = measured_by(executable, args, costs, takes_cap, table_caps)
        if record:
            entries.append([float(x) for x in measured])
            write_json(record, entries)   # whole, after each: a run that stops keeps what it measured
        return measured

    measure._calibrate = calibrate
    # A replayed run measures nothing: nor AR's step against the loop's (`against_ar`), whose
    # verdicts would make the calls after a near tie differ between runs.
    ar_ratio = against_ar.ar_step_ratio
    if replay:
        against_ar.ar_step_ratio = lambda *args: None
    try:
        yield entries
    finally:
        measure._calibrate = measured_by
        against_ar.ar_step_ratio = ar_ratio
