"""SSD (speculative speculative decoding, Saguaro): while the target verifies a speculation on
its device group, the draft predicts the verification outcomes on its own group and drafts the
next speculation for each of them, so that on a hit the next verify starts with no drafting.

Each verification step s queues three programs (in `ssd_jax.ssd.steps`) and waits for none:
  1. `draft_build(cur, d_s)` on the draft group: the speculation cache {(j, t): next L tokens +
     their q} for the fan-out's candidate outcomes;
  2. `target_verify(cur, d_s, q_s)` on the target group: the outcome (k, t, appended, done);
  3. `select_next` on the draft group, after both: each row's outcome looked up in the cache; a
     hit takes the cached speculation; if any row missed, the fallback ("jit": the draft model
     drafts from the new root; "ngram": prompt lookup) drafts every row in one call (under
     lax.cond) and the rows that missed take its speculation. The next speculation (cur, d, q)
     moves to the target group, and step s+1 reads it there.
The host reads step s's report (outcome, hits, emitted tokens: one small array) only after
queueing step s+1, so that its work (streaming, the counts, the fan-out estimate, the switch of
draft_len="auto", and dispatching itself: ~0.5 ms per program on CPU) overlaps the devices'
instead of lying between one verify and the next. It queues a step ahead only where some row
surely needs it (more than L+1 tokens to go after the steps it has not read); a step queued for
rows that all ended at an EOS meanwhile changes nothing. The fan-out of step s+1's cache is
therefore estimated from the steps up to s-1.
Both models' caches stay consistent after hits and misses: the target commits cur + accepted
tokens; the draft commits cur + d[:k], whose K/V its build already wrote. The target verifies
exactly (greedy at temperature 0, tokenwise rejection sampling otherwise) whichever speculation it
gets, with the q that speculation was sampled from, so SSD reproduces the target's law; greedy
output equals autoregressive output.

With colocated groups (one device) the build and the verify run one after the other; the stats
say so (`colocated`). `sync_timing=True` (benchmarks) waits for every program alone, to measure
each one's latency; it removes the overlap.

Concurrency. The draft group's programs are dispatched from their own thread, the target's verify from
the calling thread. On GPU/TPU each device runs its queue independently, so the two programs
overlap under plain asynchronous dispatch. XLA:CPU orders every asynchronously dispatched
single-device program after the previously enqueued one, whichever device it is on (the PjRt
CPU client's "last enqueue event"), so fake CPU devices never overlap that way; with
`jax.config.update("jax_cpu_enable_async_dispatch", False)` (set before the first computation)
each CPU program runs in the thread that dispatches it, and the two groups then compute at once
on different cores (benchmarks/bench_ssd.py measures both). The stats report the setting
(`cpu_async_dispatch`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.backend import devices_platform
from ssd_jax.draft.fanout import FanoutEstimator, max_budget
from ssd_jax.ssd import auto as ssd_auto
from ssd_jax.ssd import steps as steps
from ssd_jax.runtime.output import GenerateOutput, generate_output
from ssd_jax.runtime.prompts import PromptBatch, bucket, row_keys
from ssd_jax.ssd.placement import DeviceGroup, placed_model, resolve_groups
from ssd_jax.runtime.loop_params import placed_params
from ssd_jax.ssd.programs import Programs
from ssd_jax.ssd.stats import SSDTally, Stopwatch
from ssd_jax.runtime.streaming import StreamSink
from ssd_jax.model import Model
from ssd_jax.sampling import SamplingParams

from ssd_jax.methods import FALLBACKS  # noqa: E402,F401  (one list, in the method objects)
# fallback="auto" drafts misses by prompt lookup from this batch size on: a step misses when any
# row misses, so hits get rarer with the batch (p_hit^B) and a cheap fallback pays off.
AUTO_NGRAM_BATCH = 8


@dataclasses.dataclass(frozen=True)
class SSDPlan:
    """Static shape and options of an SSD decode (see `ssd_jax.generate` for their meaning)."""

    num_draft_tokens: int
    fanout_budget: int
    fanout: str
    saguaro_c: float
    fallback: str  # resolved: "jit" or "ngram"
    out_size: int
    prompt_size: int
    vocab: int

    @property
    def num_slots(self) -> int:
        return int(min(self.fanout_budget, max_budget(self.num_draft_tokens, self.vocab)))

    @property
    def rmax(self) -> int:
        """Static bound on any depth's fan-out (top-k width)."""
        return int(min(self.num_slots, self.vocab))

    @property
    def capacity(self) -> int:
        return self.prompt_size + self.out_size + 2 * self.num_draft_tokens + 4

    @property
    def draft_capacity(self) -> int:
        # Slot copies write up to 2L tokens past the committed text.
        return self.capacity + self.num_draft_tokens + 2


@dataclasses.dataclass(frozen=True)
class Flight:
    """A queued step, until the host reads it: its report (`ssd_steps.select_next`, int32
    [B, INFO_EMITTED + L + 1], on the draft group) and the fan-out F_0..F_L its cache was built with."""

    report: jax.Array
    fanout: np.ndarray


class _Decode:
    """One SSD decode: the two groups' states and the host-side loop state (module docstring).

    Host arrays, per row: cur int32 [B] (the root under verification), drafted int32 [B, L] (its
    speculation; q, float32 [B, L, V] on the draft group, None at temperature 0), emitted int32
    [B, L+1] and n_adv int32 [B] (the draft's pending catch-up), done bool [B].
    """

    def __init__(self, target: Model, draft: Model, batch: PromptBatch, max_new_tokens: int,
                 sampling: SamplingParams, key, plan: SSDPlan, estimator: FanoutEstimator, target_devices,
                 draft_devices, stream: StreamSink | None, sync_timing: bool, tuner=None,
                 verdict_key=None, prior_acceptance: float | None = None):
        b, length = batch.batch_size, plan.num_draft_tokens
        target_devs, draft_devs = resolve_groups(target_devices, draft_devices, target, draft)
        start = time.perf_counter()
        target, draft = placed_model(target, target_devs), placed_model(draft, draft_devs)
        t_place = time.perf_counter() - start
        self.tgroup = DeviceGroup(target.placement, b, target.config)
        self.dgroup = DeviceGroup(draft.placement, b, draft.config)
        self.tparams, t_loop = placed_params(target)
        self.dparams, d_loop = placed_params(draft)
        self.placement_s = t_place + t_loop + d_loop
        self.plan, self.sampling, self.estimator = plan, sampling, estimator
        self.stream, self.sync_timing = stream, sync_timing
        self.sink_s = 0.0   # seconds spent in the stream's sink (not SSD's: left out of its step times)
        self.tally = SSDTally(length)
        verifier = steps.verifier_for(sampling)
        self.run = Programs((target.config, draft.config, sampling, plan, verifier, self.tgroup.ids(),
                             self.dgroup.ids(), b))
        tcfg, dcfg, vocab = target.config, draft.config, plan.vocab
        drafting = dict(sampling=sampling, target_vocab=vocab, saguaro_c=plan.saguaro_c, rmax=plan.rmax)
        self.prefill_t = functools.partial(steps.target_prefill, tcfg=tcfg, sampling=sampling,
                                           capacity=plan.capacity, out_size=plan.out_size, num_draft_tokens=length)
        self.prefill_d = functools.partial(steps.draft_prefill, dcfg=dcfg, capacity=plan.draft_capacity,
                                           context_capacity=plan.capacity)
        self.verify = functools.partial(steps.target_verify, tcfg=tcfg, sampling=sampling, capacity=plan.capacity,
                                        verifier=verifier)
        self.build = functools.partial(steps.draft_build, dcfg=dcfg, **drafting)
        plain = functools.partial(steps.target_plain, tcfg=tcfg, sampling=sampling, capacity=plan.capacity)
        self.plain_chunk = ssd_auto.PLAIN_CHUNK
        self.plain = functools.partial(plain, chunk=self.plain_chunk)
        self.plain_rest = functools.partial(plain, chunk=plan.out_size, keep_law=False)   # no draft reads it
        self.read = functools.partial(steps.draft_read, dcfg=dcfg, sampling=sampling, target_vocab=vocab)
        self.tuner = tuner
        self.auto = None if tuner is None else tuner.ssd
        self.switch, self.measure_s, self.switched_at = None, 0.0, None
        self.resumes = 0   # plain stretches after which SSD resumed (`plain_stretch`)
        self.prior_acceptance = prior_acceptance
        self.plain_key = None   # what plain decoding's step is remembered under ("auto" with timings)
        # The config does not say the weights' dtype, nor a sharded target's mesh and rules:
        # a bfloat16 copy of a float32 target took the float32 one's plain step as its own.
        self.target_kind = (target.config, str(target.dtype), repr(target.placement.mesh.shape), target.placement.rules)
        self.verdict_key = verdict_key
        if plan.fallback == "jit":
            self.fallback = functools.partial(steps.fallback_model, dcfg=dcfg, num_draft_tokens=length, **drafting)
        else:
            self.fallback = functools.partial(steps.ngram_fallback, sampling=sampling, target_vocab=vocab,
                                              num_draft_tokens=length)
        self.select = functools.partial(steps.select_next, fallback=self.fallback, num_draft_tokens=length,
                                        target_vocab=vocab)
        self.keys = row_keys(key, b, sampling)
        eos = np.array(target.config.eos_token_ids or (-1,), np.int32)
        prompt = (jnp.asarray(batch.tokens), jnp.asarray(batch.lengths))
        self.t_inputs = self.tgroup.put(prompt + (self.keys, jnp.asarray(max_new_tokens, jnp.int32), jnp.asarray(eos)))
        self.max_new_tokens = max_new_tokens
        self.d_inputs = self.dgroup.put(prompt + (self.keys,))
        # The draft group's programs are dispatched from their own thread: on CPU with
        # jax_cpu_enable_async_dispatch=False each program runs in the thread that dispatches it,
        # so the two groups compute at once (module docstring).
        self.colocated = self.tgroup.devices == self.dgroup.devices
        self.worker = (ThreadPoolExecutor(1, thread_name_prefix="ssd-draft") if not self.colocated and not sync_timing
                       else None)
        self.rows = np.arange(b)
        self.produced = np.zeros((b,), np.int64)   # tokens appended to each row's output (steps read so far)
        self.dispatched = 0   # steps queued
        # The draft's catch-up, on the host until the first step (then on the draft group).
        self.emitted = np.zeros((b, length + 1), np.int32)
        self.n_adv = np.zeros((b,), np.int32)
        self.q = None

    def timed(self, field, fn):
        """Runs fn; in sync-timing mode waits for its outputs and records its latency under field
        (a name, or a callable naming it from the outputs)."""
        if not self.sync_timing:
            return fn()
        start, compile_start = time.perf_counter(), self.run.compile_s
        out = jax.block_until_ready(fn())
        seconds = time.perf_counter() - start - (self.run.compile_s - compile_start)
        self.tally.sync[field(out) if callable(field) else field].append(seconds)
        return out

    def start(self) -> None:
        """Prefills both groups; the first speculation comes from the fallback (nothing is cached)."""
        self.tstate, packed = self.run("ssd_target_prefill", self.prefill_t, self.tgroup, self.tparams, *self.t_inputs)
        packed = np.asarray(packed)
        self.cur = packed[:, steps.OUT_NEXT].astype(np.int32)
        self.done = packed[:, steps.OUT_DONE].astype(bool)
        self.emit(self.cur[:, None], packed[:, steps.OUT_APPENDED])
        self.produced += packed[:, steps.OUT_APPENDED]
        d_tokens, d_lengths, d_keys = self.d_inputs
        self.dstate = self.run("ssd_draft_prefill", self.prefill_d, self.dgroup, self.dparams, d_tokens, d_lengths,
                               self.cur, d_keys)
        self.layout = self.estimator.layout()
        self.step = 1
        if self.auto is not None and self.auto.measures and not self.done.all():
            start, compile_start = time.perf_counter(), self.run.compile_s
            # Plain decoding's step does not depend on the draft, and on the length only through
            # the cache's 2L spare slots: one measurement serves every length of these shapes
            # (measured per length, a probe that ran a new one spent ~110 plain steps on it, ~0.45 s
            # on CPU at batch 1).
            key = ("ssd_plain", self.tgroup.ids(), self.target_kind, self.sampling, self.plan.prompt_size,
                   self.plan.out_size, self.rows.size)
            self.plain_key = key
            prior, prior_steps = ssd_auto.switch_prior(self.auto, self.verdict_key, self.plan.num_draft_tokens)
            timed_on = self.timing_state()
            plain_s = ssd_auto.plain_step_seconds(
                self.auto, key, lambda state: self.run_plain(state, self.cur, 0)[1:], timed_on,
                retime=ssd_auto.near_break_even(prior), tuner=self.tuner,
                stored=ssd_auto.plain_step_path(self.tuner.store_dir(), key, (self.tparams, self.cur)),
                compile_seconds=lambda: self.run.compile_s)
            self.switch = ssd_auto.PlainSwitch(
                plain_s, call_tokens=self.max_new_tokens, prior_log_ratio=prior, prior_steps=prior_steps,
                prior_pace=ssd_auto.prior_pace(self.prior_acceptance, self.plan.num_draft_tokens))
            self.measure_s = time.perf_counter() - start - (self.run.compile_s - compile_start)
        # A step's seconds for the switch run from the previous step's read to its own, so that
        # they hold all of its work, the lookup and the fallback drafting of missed rows included:
        # timed from the verify's dispatch only, SSD at T=1 read 0.64-0.74 of plain decoding's
        # cost per token where whole calls ran at 0.9-1.0x AR.
        self.step_mark = (time.perf_counter(), self.run.compile_s, self.sink_s)
        if not self.done.all():
            self.restart(self.cur)

    def timing_state(self) -> dict:
        """The target state after prefill with no row's end in sight (max_new at the output
        buffer's size, no EOS id): what plain decoding's step is timed on, so that every timing
        run takes a whole chunk whatever this call's length and text. On the call's own max_new
        a call of 2 tokens timed runs of 1 step, each carrying the run's fixed cost (2.5-3.3 ms
        a step where 16-step runs read 0.2-0.3 ms, one CPU device), and its key's later calls
        judged SSD against that."""
        eos = self.tstate["eos"]
        unbounded = self.tgroup.put(dict(max_new=np.int32(self.plan.out_size),
                                         eos=np.full(eos.shape, -1, np.dtype(eos.dtype))))
        return dict(self.tstate, **unbounded)

    def emit(self, tokens, counts) -> None:
        """Hands new tokens to the stream's sink, if any: copies (the decode goes on reading its
        own arrays, and a sink may keep or change what it gets), timed apart (`sink_s`: a slow
        consumer's time is not SSD's, and priced in its steps it judged SSD slower than plain
        decoding for later unstreamed calls too)."""
        if self.stream is None:
            return
        start = time.perf_counter()
        self.stream(np.array(tokens), np.array(counts))
        self.sink_s += time.perf_counter() - start

    def run_plain(self, state, cur, step: int, rest: bool = False):
        """Plain decoding (`ssd_steps.target_plain`), one chunk or (rest) up to the end of the
        call: (state, emitted, appended, done, cur, chosen)."""
        # The chunk is in the name: the programs' key holds the plan, not the partial's arguments.
        name, program = (("ssd_target_plain_rest", self.plain_rest) if rest
                         else (f"ssd_target_plain_{self.plain_chunk}", self.plain))
        return self.run(name, program, self.tgroup, self.tparams, state, cur, np.int32(step), donate=(1,))

    def plain_stretch(self, cur) -> bool:
        """Decodes plainly from the root cur int32 [B] (on the target group; the switch found SSD slower): chunk by chunk while SSD
        may resume (`resumable`), the draft reading each chunk (`ssd_steps.draft_read`), until the
        reads predict that SSD pays again (`ssd_auto.ReadAcceptance`); then the fallback drafts
        the next speculation and True is returned. Otherwise to the end of the call (False): in
        one program where nothing is read or streamed. Each run that did not compile times plain
        decoding's step for the next calls (`ssd_auto.observe_plain_run`)."""
        if self.switched_at is None:
            self.switched_at = self.tally.steps
        step, root, length = self.step, np.asarray(cur), self.plan.num_draft_tokens
        reads = ssd_auto.ReadAcceptance.empty(self.rows.size)
        reading = True
        while not self.done.all():
            reading = reading and self.resumable()
            start, compile_start = time.perf_counter(), self.run.compile_s
            self.tstate, emitted, appended, done, cur, chosen = self.run_plain(
                self.tstate, cur, step, rest=self.stream is None and not reading)
            appended = np.asarray(appended)
            if self.plain_key is not None and self.run.compile_s == compile_start:
                ssd_auto.observe_plain_run(self.auto, self.plain_key, time.perf_counter() - start, int(np.max(appended)))
            self.emit(emitted, appended)
            self.produced += appended
            self.done = np.asarray(done).astype(bool)
            step += self.plain_chunk
            if not reading or self.done.all():
                continue
            self.dstate, agreement = self.run(
                "ssd_draft_read", self.read, self.dgroup, self.dparams, self.dstate, self.emitted, self.n_adv, root,
                np.asarray(emitted), np.asarray(chosen), appended.astype(np.int32), donate=(1,))
            self.emitted = np.zeros((self.rows.size, length + 1), np.int32)
            self.n_adv = np.zeros((self.rows.size,), np.int32)
            root = np.asarray(cur)
            reads.add(np.asarray(agreement), appended)
            pace = reads.resume_pays(~self.done, length, self.switch.judged_step_s(), self.switch.plain_step_s)
            if pace is not None and self.resumable():
                self.resumes += 1
                self.step = step
                self.switch.resume(pace)
                self.restart(root)
                self.step_mark = (time.perf_counter(), self.run.compile_s, self.sink_s)
                return True
        return False

    def resumable(self) -> bool:
        """Whether SSD may still resume in this call: fewer than MAX_RESUMES so far, every live row
        with RESUME_MIN_TOKENS to go, and a step at the time of the call's judged SSD steps able to
        pay at all (`ssd_auto.may_resume`)."""
        live = ~self.done
        return (self.switch is not None and self.resumes < ssd_auto.MAX_RESUMES and live.any()
                and int(np.min(self.max_new_tokens - self.produced[live])) >= ssd_auto.RESUME_MIN_TOKENS
                and ssd_auto.may_resume(self.switch.judged_step_s(), self.switch.plain_step_s,
                                        self.plan.num_draft_tokens))

    def draft_fallback(self, root):
        """The fallback's speculation for every row from root int32 [B] (a new cur): (tokens int32
        [B, L], q or None), both on the draft group."""
        with Stopwatch(self.tally, "fallback", self.run):
            tokens, q = self.timed("fallback_s", lambda: self.run(
                "ssd_fallback_" + self.plan.fallback, self.fallback, self.dgroup, self.dparams, self.dstate,
                self.emitted, self.n_adv, root, self.layout.fanout, np.int32(self.step)))
        self.tally.fallback_calls += 1
        return tokens, q

    def restart(self, root: np.ndarray) -> None:
        """The draft's side of a fresh start from root int32 [B] (after prefill, or SSD resuming
        after a plain stretch the draft read): no catch-up pending, the fallback drafts the
        speculation. Every array the next step reads is placed on its group."""
        b, length = self.rows.size, self.plan.num_draft_tokens
        self.cur = self.dgroup.put(np.asarray(root, np.int32))
        self.emitted = self.dgroup.put(np.zeros((b, length + 1), np.int32))
        self.n_adv = self.dgroup.put(np.zeros((b,), np.int32))
        self.done_rows = self.dgroup.put(np.asarray(self.done, bool))
        self.drafted, self.q = self.draft_fallback(self.cur)

    def to_target(self, x):
        """x (a draft-group array, or None) on the target group."""
        if x is None or self.colocated:
            return x
        return jax.device_put(x, self.tgroup.sharding_for(x))

    def on_draft(self, fn) -> Future:
        """Runs fn, a dispatch of draft-group programs, from the draft's own thread when the
        groups differ (after the first step, whose programs compile first), else right here."""
        if self.worker is not None and self.dispatched > 0:
            return self.worker.submit(fn)
        done: Future = Future()
        done.set_result(fn())
        return done

    def dispatch_step(self, observe=None) -> "Flight":
        """Queues one verification step (module docstring: build, verify, lookup) without waiting
        for it; the next step's speculation and the draft's catch-up stay on the devices."""
        layout, step, was_done = self.layout, self.step, self.done_rows
        cur, drafted, emitted, n_adv, dstate = self.cur, self.drafted, self.emitted, self.n_adv, self.dstate
        built = self.on_draft(lambda: self.timed("build_s", lambda: self.run(
            "ssd_build", self.build, self.dgroup, self.dparams, dstate, emitted, n_adv, cur, drafted,
            layout.depth, layout.rank, layout.fanout, np.int32(step), donate=(1,))))
        q_sent = self.to_target(self.q)
        self.tstate, packed = self.timed("verify_s", lambda: self.run(
            "ssd_verify", self.verify, self.tgroup, self.tparams, self.tstate, self.to_target(cur),
            self.to_target(drafted), q_sent, np.int32(step), donate=(1,)))
        outcome = packed if self.colocated else jax.device_put(packed, self.dgroup.sharding_for(packed))

        def select():
            new_dstate, candidates, spec_q = built.result()
            out = self.timed(self.select_field, lambda: self.run(
                "ssd_select", self.select, self.dgroup, self.dparams, new_dstate, outcome, candidates, spec_q,
                drafted, was_done, layout.depth, layout.fanout, np.int32(step + 1)))
            return (new_dstate, candidates, spec_q), out

        (self.dstate, candidates, spec_q), selected = self.on_draft(select).result()
        self.cur, self.drafted, self.q, self.emitted, self.n_adv, self.done_rows, report = selected
        if observe is not None and self.dispatched == 0:
            observe(dict(target_params=self.tparams, target_state=self.tstate, draft_params=self.dparams,
                         draft_state=self.dstate, cache=(candidates, spec_q), q=q_sent, target_group=self.tgroup,
                         draft_group=self.dgroup))
        self.dispatched += 1
        self.step += 1
        return Flight(report=report, fanout=layout.fanout)

    def select_field(self, selected) -> str:
        """Where a sync-timing run files the lookup's latency: apart on steps that drafted misses."""
        report = np.asarray(selected[-1])
        return "select_miss_s" if report[:, steps.INFO_MISSED].any() else "select_s"

    def surely_continues(self, unread: int) -> bool:
        """Whether some row needs another step after the `unread` queued steps whatever they
        accept: one with more than unread * (L+1) tokens to go (an EOS may still end it)."""
        live = ~self.done
        if not live.any():
            return False
        left = self.max_new_tokens - self.produced[live]
        return int(np.max(left)) > unread * (self.plan.num_draft_tokens + 1)

    def absorb(self, flight: "Flight") -> bool:
        """Step 3 for a queued step: waits for its report; streams its tokens; counts its lookups;
        feeds the fan-out estimate and the switch. Returns whether the switch finds SSD slower
        than plain decoding."""
        with Stopwatch(self.tally, "wait_steps", self.run):
            report = np.asarray(flight.report)
        accepted, appended = report[:, steps.OUT_ACCEPTED], report[:, steps.OUT_APPENDED]
        hit, missed = report[:, steps.INFO_HIT].astype(bool), report[:, steps.INFO_MISSED].astype(bool)
        was_live = ~self.done
        if not was_live.any():
            return False   # queued before the host knew every row had ended (at an EOS): a no-op
        self.emit(report[:, steps.INFO_EMITTED:], appended)
        self.produced += appended
        self.done = report[:, steps.OUT_DONE].astype(bool)
        live = ~self.done
        self.tally.steps += 1
        self.tally.record(accepted[live], hit[live])
        self.estimator.record(accepted[live], hit[live], flight.fanout)
        self.layout = self.estimator.layout()
        if missed.any():
            self.tally.fallback_calls += 1
            self.tally.fallback_rows += int(missed.sum())
        if self.switch is None or self.done.all():
            return False
        (mark_s, mark_compile_s, mark_sink_s), now = self.step_mark, time.perf_counter()
        self.step_mark = (now, self.run.compile_s, self.sink_s)
        self.switch.record(now - mark_s - (self.sink_s - mark_sink_s), accepted + 1, was_live,
                           compiled=self.run.compile_s != mark_compile_s)
        return self.switch.slower_than_plain()

    def loop(self, observe=None) -> None:
        """Queues each step before reading the one before it (module docstring)."""
        flights: collections.deque = collections.deque()
        while True:
            if not self.done.all() and (not flights or (len(flights) < 2 and self.surely_continues(len(flights)))):
                flights.append(self.dispatch_step(observe))
                continue
            if not flights:
                return
            if not self.absorb(flights.popleft()):
                continue
            while flights:   # the step queued ahead is SSD's too: it finishes before the switch
                self.absorb(flights.popleft())
            if self.done.all() or not self.plain_stretch(self.to_target(self.cur)):
                return

    def remember_verdict(self, call_s: float) -> None:
        """The call's verdict for the next calls of its program (`ssd_auto.remember`), "auto" with
        a key, once it ran MIN_STEPS SSD steps or switched; call_s: its seconds end to end, compiles,
        the plain step's timing and the stream's sink left out (what a probe like it costs,
        `PlainSwitch.probe_cost`: counted in, a sink taking 20 ms a piece spaced the probes 64
        calls apart where the same call unstreamed spaced them 11)."""
        switch = self.switch
        if self.verdict_key is not None and switch is not None and (
                self.switched_at is not None or switch.spent_steps >= ssd_auto.MIN_STEPS):
            ssd_auto.remember(self.auto, self.verdict_key, switch.call_ratio(),
                              switch.judged_ratio() if switch.steps >= ssd_auto.MIN_STEPS else None,
                              self.plan.num_draft_tokens, probe_cost=switch.probe_cost(call_s))


def generate_ssd(
    target: Model, draft: Model, batch: PromptBatch, max_new_tokens: int, sampling: SamplingParams, key, *,
    num_draft_tokens: int, fanout_budget: int, fanout: str, saguaro_c: float, fallback: str,
    target_devices=None, draft_devices=None, fanout_acceptance: float | None = None,
    fanout_exponent: float | None = None, stream: StreamSink | None = None, sync_timing: bool = False,
    observe=None, tuner=None, verdict_key=None, prior_acceptance: float | None = None,
) -> GenerateOutput:
    """SSD decoding of a prepared batch (see `ssd_jax.generate`, method "ssd").

    sync_timing: wait for every device program alone and report each one's mean latency
    (`stats["latency_s"]`; no overlap). observe: optional callable(dict) called once, after the
    first step's dispatches, with the live arrays (target/draft params and states, the speculation
    cache): tests check where they live. tuner: for draft_len "auto" (`ssd_jax.ssd.auto`), the
    `ssd_jax.Tuner` whose SSD memory decides: switch to plain decoding once SSD measures slower
    (a measuring tuner's), and remember the verdict under verdict_key (None: not remembered);
    its calibrations keep plain decoding's step timings; prior_acceptance: the
    per-position acceptance earlier calls of the pair measured (None: none), which a key's first
    judged call weighs its pace against (`ssd_auto.PlainSwitch`).
    """
    b = batch.batch_size
    resolved = fallback if fallback != "auto" else ("ngram" if b >= AUTO_NGRAM_BATCH else "jit")
    plan = SSDPlan(num_draft_tokens=num_draft_tokens, fanout_budget=fanout_budget, fanout=fanout,
                   saguaro_c=float(saguaro_c), fallback=resolved, out_size=bucket(max_new_tokens),
                   prompt_size=batch.tokens.shape[1], vocab=target.config.vocab_size)
    estimator = FanoutEstimator(fanout, num_draft_tokens, fanout_budget, plan.vocab, fanout_acceptance,
                                fanout_exponent)
    decode = _Decode(target, draft, batch, max_new_tokens, sampling, key, plan, estimator, target_devices,
                     draft_devices, stream, sync_timing, tuner=tuner, verdict_key=verdict_key,
                     prior_acceptance=prior_acceptance)
    start = time.perf_counter()
    try:
        decode.start()
        decode.loop(observe)
    finally:
        if decode.worker is not None:
            decode.worker.shutdown()
    outputs, counters = jax.device_get((decode.tstate["outputs"], decode.tstate["counters"]))
    jax.block_until_ready(decode.dstate)  # the last build: its work belongs to this call
    wall = time.perf_counter() - start - decode.run.compile_s - decode.measure_s
    decode.remember_verdict(wall - decode.sink_s)   # a slow consumer's time is no probe's cost

    extra = dict(num_draft_tokens_per_step=num_draft_tokens, fanout_budget=fanout_budget, fanout_strategy=fanout,
                 fanout=list(map(int, decode.layout.fanout)), fanout_acceptance_estimate=estimator.acceptance(),
                 fanout_exponent_estimate=estimator.miss_exponent(), saguaro_c=plan.saguaro_c, fallback=resolved,
                 colocated=decode.tgroup.devices == decode.dgroup.devices,
                 target_devices=[str(d) for d in decode.tgroup.devices],
                 draft_devices=[str(d) for d in decode.dgroup.devices], placement_time_s=decode.placement_s,
                 cpu_async_dispatch=(bool(jax.config.values["jax_cpu_enable_async_dispatch"])
                                     if devices_platform(decode.tgroup.devices) == "cpu" else None))
    if tuner is not None:
        extra.update(adaptive=True, planned_draft_len=num_draft_tokens, switched_to_plain_at_step=decode.switched_at,
                     ssd_resumed=decode.resumes,
                     plain_step_s=decode.switch.plain_step_s if decode.switch is not None else None,
                     judged_step_s=decode.switch.judged_step_s() if decode.switch is not None else None,
                     judged_pace_tokens=decode.switch.judged_pace() if decode.switch is not None else None,
                     call_pace_tokens=decode.switch.call_pace() if decode.switch is not None else None,
                     cost_measure_time_s=decode.measure_s)
    out = generate_output("ssd", outputs.out, outputs.num_out, outputs.finish, counters, wall,
                             decode.run.compile_s, extra)
    out.stats.update(decode.tally.stats(wall))
    return out
