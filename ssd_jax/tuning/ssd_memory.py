"""What SSD's draft_len="auto" remembers between calls (`ssd_jax.ssd.auto` decides with it; a
`ssd_jax.Tuner` owns one): per program key, the timed plain steps, the verdicts that calls
should start plainly, the lengths run, whether SSD ever paid, the acceptance its last judged call
started from, and the decayed means of the calls' cost ratios, step overheads, paces and cache hit
rates."""

from __future__ import annotations

import threading

from ssd_jax.tuning.memory import DecayedMeans, Recent
from ssd_jax.tuning.plain_verdicts import PlainVerdicts

VERDICT_WEIGHT = 0.25   # a judged call's weight in its key's mean log cost ratio (~4 calls' memory)
OVERHEAD_WEIGHT = 0.5   # a judged call's weight in its key's step overhead


class SSDMemory:
    """SSD's memories (module docstring). measures: False for a deterministic tuner, whose SSD
    calls neither time plain steps nor consult or keep verdicts."""

    def __init__(self, measures: bool):
        self.measures = measures
        self.plain_step_s = Recent()   # key -> recent timings of a plain step
        self.plain_runs = Recent()     # key -> recent switched calls' plain seconds per step
        self.verdicts = PlainVerdicts()
        self.lengths_run = Recent()    # key -> the lengths its calls ran SSD at
        self.paid = Recent()           # keys with a call where SSD paid (call ratio below 1)
        self.verdict_acceptance = Recent()   # key -> (the pair's acceptance, L) at its last judged call
        self.rise_probes = Recent()          # key -> (acceptance, length) of the rise that made its next call a probe
        self.plain_reads = Recent()          # key -> (seconds of calls started plain, of their reads)
        self.latest_read = Recent()          # key -> the acceptance its latest read since its last SSD call met
        self.lock = threading.Lock()
        # Recent judged calls' log cost ratios (> 0: SSD slower than plain decoding) over their
        # SSD steps (the verdict) and over their judged steps (the switch's prior), SSD's step
        # overhead in seconds, and the acceptance of its batch's pace.
        self.ratios = DecayedMeans(VERDICT_WEIGHT, running_start=True)
        self.steady_ratios = DecayedMeans(VERDICT_WEIGHT, running_start=True)
        self.overheads = DecayedMeans(OVERHEAD_WEIGHT, running_start=True)
        self.pace_acceptance = DecayedMeans(OVERHEAD_WEIGHT, running_start=True)
        self.hit_rates = DecayedMeans(OVERHEAD_WEIGHT, running_start=True)   # the cache's, per program
