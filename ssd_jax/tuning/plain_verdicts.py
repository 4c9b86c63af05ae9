"""Remembered verdicts that a program's calls under draft_len="auto" should decode plainly from the
start, with probes that renew them.

A verdict is kept per program key (the pair's weights, the method, sampling and the call's shapes):
after a call that found speculation not paying, the next calls of the key run AR's program (no
draft work, no speculative bookkeeping), all but a probe every `first` calls, which runs the
adaptive program again and renews the verdict. A probe that finds the same again may double the
calls between probes, up to `most`; any other verdict sets them back to `first`.

Two users: SSD (`ssd_jax.ssd.auto`: its host loop measures SSD slower than plain decoding)
and the jitted adaptive loop of the synchronous methods (`remember_share` below: a call whose
loop decoded at least PLAIN_SHARE of its steps plainly, about every one, or whose steps priced
above AR's program's, `ssd_jax.tuning.against_ar`). The loop's own fall
back already makes such calls nearly as fast as AR, but not quite: its plain steps keep a buffer
of the tokens the draft missed and check every PLAIN_BLOCK steps whether speculation pays
(retrieval also walks its drafts against the tokens drawn), which cost 1-4% of AR on CPU at
batch 8 (PLD and LogitSpec at T=1, where every step decoded plainly: 0.96-0.99x AR). A
deterministic `Tuner` remembers nothing (a call must not depend on the calls before it).
"""

from __future__ import annotations

import math
import threading

from ssd_jax.tuning.memory import Recent

# The jitted loop's verdicts: a call that decoded this share of its steps plainly (all but about
# one step in a hundred) makes the next calls of its key start plain; a probe every PROBE_EVERY
# calls, doubling while probes find the same, up to PROBE_EVERY_MAX (a probe costs the loop's
# 1-4% over AR on one call, so it may come often: a text that turns copyable is found within
# PROBE_EVERY_MAX calls). Not lower: LogitSpec on held-out code at T=0 and batch 8 decodes 90-95%
# of its steps plainly and gains from the rest (1.02x AR), and with 0.95 its calls that started
# plain read 0.97x.
PLAIN_SHARE = 0.99
PROBE_EVERY = 4
PROBE_EVERY_MAX = 16


def calls_apart(loss: float, overhead: float) -> int:
    """The calls between probes that keep a probe's loss (a share of a plain call; below 0:
    none) within `overhead` of them (rounded to 6 decimals first, so that 0.2 / 0.01 is 20).
    SSD's plain verdicts (`ssd_jax.ssd.auto.remember`) and the per-call choice
    (`ssd_jax.tuning.per_call.probe_interval`) space their probes by it."""
    return math.ceil(round(max(float(loss), 0.0) / overhead, 6))


class PlainVerdicts:
    """Per key: (decode plainly, calls started plain since the last probe, calls between probes);
    the most recent keys only."""

    def __init__(self, limit: int = 256):
        self._values = Recent(limit)
        self._lock = threading.Lock()

    def starts_plain(self, key) -> bool:
        """Whether a call of `key` decodes plainly from the start: the last call that ran the
        adaptive program judged it not paying, and this call is not a probe. Counts the call; a
        probe starts the count again, so that one that leaves no verdict (an SSD call too short
        to judge, one that raised) is not followed by another at every call: calls of 4 tokens
        after a plain verdict of 16-token calls ran SSD every time from the first probe on."""
        with self._lock:
            verdict = self._values.lookup(key)
            if verdict is None or not verdict[0]:
                return False
            probe = verdict[1] + 1 >= verdict[2]
            self._values.store(key, (True, 0 if probe else verdict[1] + 1, verdict[2]))
            return not probe

    def probe_now(self, key) -> None:
        """Counts a call of `key` that runs the adaptive program as a probe outside the count
        (its verdict's evidence changed): the count starts again."""
        with self._lock:
            verdict = self._values.lookup(key)
            if verdict is not None:
                self._values.store(key, (verdict[0], 0, verdict[2]))

    def is_plain(self, key) -> bool:
        """Whether key's verdict is "decode plainly" (a call that runs the adaptive program while
        it is, `starts_plain` having said no, is a probe). Counts nothing."""
        with self._lock:
            verdict = self._values.lookup(key)
            return verdict is not None and bool(verdict[0])

    def remember(self, key, plain: bool, back_off: bool, first: int, most: int) -> None:
        """The verdict of a call that ran the adaptive program: plain (it did not pay); back_off:
        a plain verdict that may double the calls between probes, when the verdict before was
        plain too (else they are `first`); never fewer than `first`, nor more than `most`."""
        with self._lock:
            before = self._values.lookup(key)
            doubled = plain and back_off and before is not None and before[0]
            interval = min(max(2 * before[2], first), most) if doubled else first
            self._values.store(key, (bool(plain), 0, interval))

    def forget(self) -> None:
        with self._lock:
            self._values.clear()


def starts_plain(tuner, key) -> bool:
    """Whether a synchronous method's "auto" call of `key` runs AR's program instead of the
    adaptive loop (see the module's docstring), by the tuner's verdicts; always False for a
    deterministic tuner."""
    return tuner.measures and tuner.loop_verdicts.starts_plain(key)


def remember_share(tuner, key, plain_share: float, lost: bool = False) -> None:
    """The verdict of an adaptive loop's call of `key` that decoded plain_share (float in [0, 1])
    of its steps plainly; lost: its steps, priced, came to more than AR's program would have taken
    (`ssd_jax.tuning.against_ar`), which also makes the next calls start plain. Kept by the tuner
    (nothing for a deterministic one)."""
    if not tuner.measures:
        return
    tuner.loop_verdicts.remember(key, plain_share >= PLAIN_SHARE or lost, back_off=True, first=PROBE_EVERY,
                                 most=PROBE_EVERY_MAX)
