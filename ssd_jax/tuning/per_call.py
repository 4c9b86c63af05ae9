"""draft_len="auto" chosen per call among fixed programs, where the adaptive loop's own steps cost
more than a fixed program's of the same length (the backend policy's `adaptive_per_call_below_rows`).

The adaptive loop decides inside the program, step by step; on XLA:GPU its control flow (a while
loop of runs, a `lax.switch` over caps, the plain fallback's checks) reads predicates back to the
host between kernels, which at one row costs a tenth of every step or more, and no choice of caps
wins that back (docs/benchmarks.md#the-backend-policy); its programs also compile far slower
than a fixed length's.

So a call here runs one program, chosen before it starts: the method at a fixed length L* (its
`Menu`: SD, BV, SpecInfer, SpecTr, GBV, PLD and EAGLE their draft_len, CSD its max_draft_tokens,
LogitSpec its root branch at the longest its tree allows) or AR's program (L* = 0), L* maximising
the predicted speedup

    tokens(L) price(0) / price(L)

price(L): the seconds per target call of length L's program, the cost model's step (`Menu.model_s`:
target(K L + 1) + L draft forwards at K paths' rows; retrieval and cascades draft inside the step,
target(width) alone) plus the part of it the model misses (sampling, verification, the cascade's
or lookup's drafting, bookkeeping, the launches), measured on the program's past calls of that
length (each call's seconds past its fixed part, which AR's program run to one token on the
call's inputs measures, over its target calls past the first: `PerCallMemory.record`), else of
the nearest measured one (`PerCallMemory.prices`; a program's own fixed part is measured after its
first call, a drafted one's holding its draft's prefill). The choice compares the steps alone.
tokens(L): the tokens per target call measured on that length's past calls, else
E(L, a) = (1 - a^(L+1)) / (1 - a) scaled by what the nearest measured length read against its own
E (a retrieval draft finds nothing on some steps, a cascade's lenient review accepts near misses:
the geometric law alone is off by a factor that a measured length shows), a the pair's remembered
per-position acceptance (`Tuner.acceptance`, which these calls update from their counters as the
loop's do). The choice depends only on past calls and timings, so each call keeps its fixed
program's exact law.

price(0), AR's program's, is timed on the call's own inputs before the first choice of a program
key (a run that is not the executable's first): priced as the drafted lengths' model plus their
surplus, AR's program would read as dear as the method's verification, and a multi-path method
that ran below AR would never choose AR's program.

A multi-path method whose paths "auto" left open (SpecInfer, SpecTr, GBV at T > 0) chooses its path
count here too, among `auto_shape.PATH_CHOICES` (`Shape`s, one per K): the cost model's forwards at
K L + 1 tokens cost about one token's on a GPU, so it takes the most paths, but their verification
and sampling, which it leaves out, grow with K. The first calls run one path; a shape not yet run
borrows the surplus measured on the shape of nearest K, scaled by K / K' (where positive), so more
paths are tried where their predicted gain outweighs that, one count at a time (2 paths before 4:
`shape_speedups`). A program never run is chosen only where it predicts EXPLORE_GAIN over the rest
(`choose_shape`). While AR's program wins, a call runs the best program already run anyway now and
then (a probe), so the acceptance stays current. A probe costs 1/s - 1 of an AR call where s is its
predicted speedup (< 1), so the calls between probes are as many as keep that under
PROBE_OVERHEAD of them (at least PROBE_EVERY_MIN), and each probe after which AR's program still
wins doubles them (up to PROBE_EVERY_MAX, as the loop's and SSD's plain verdicts back off). A near
tie probes within a few calls, so one poor call (a prompt that retrieval drafts badly) does not
hand the next several good ones to AR's program; a clear loss probes seldom. Each length run
compiles its program once (the compile cache keeps it). An executable's first run is slower than
later ones; where the backend policy's `warm_new_programs` says so (GPU), that run is made apart
before the call's own (`decode_program.first_run_s`), so the call that tried a program prices it;
elsewhere that call sets no price, and the next call of the program does.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
from typing import Callable, Sequence

import numpy as np

from ssd_jax.loop.caps import compiled_caps, with_one
from ssd_jax.runtime.processes import agreed
from ssd_jax.tuning import cost_model, measure
from ssd_jax.tuning.cost_model import StepCosts, expected_tokens
from ssd_jax.tuning.memory import DecayedMeans, Recent
from ssd_jax.tuning.plain_verdicts import calls_apart

# Methods whose fixed programs differ from "auto" only in a length (and the shapes "auto" fixed
# before the call: paths, tree size).
METHODS = ("sd", "bv", "specinfer", "spectr", "gbv", "pld", "logitspec", "csd", "eagle")
PRICE_WEIGHT = 0.5       # a call's weight in its length's remembered seconds and tokens per target call
EXPLORE_GAIN = 1.05      # a program never run is chosen only where it predicts this much more
PROBE_OVERHEAD = 0.01   # while AR's program wins, probes cost at most this share of the calls ...
PROBE_EVERY_MIN = 2      # ... and are at least this many calls apart at first ...
PROBE_EVERY_MAX = 64     # ... each probe that leaves AR's program winning doubles that, up to this
RETIME_EVERY_MAX = 1024  # the same for re-timing a winning program's runner-up (`_retimed_runner_up`)
FULL_SHARE_STEPS = 16    # a call of this many target calls after its first counts fully in prices and tokens

FIXED = "fixed"


@dataclasses.dataclass(frozen=True)
class Menu:
    """The fixed programs one call may run: lengths (>= 1, ascending), and model_s float64
    [max(lengths) + 1], the cost model's seconds per target call of AR's program (index 0) and of
    each length's (indices not in lengths unused)."""

    lengths: tuple[int, ...]
    model_s: np.ndarray

    @property
    def max_len(self) -> int:
        return self.lengths[-1]


@dataclasses.dataclass(frozen=True)
class Shape:
    """One shape of a method's fixed programs that a call may run (a multi-path method's path
    count): the key its prices and tokens are remembered under, its Menu, the per-position
    acceptance remembered for it, and its paths."""

    key: tuple
    menu: Menu
    acceptance: float
    paths: int = 1


@dataclasses.dataclass(frozen=True)
class Candidate:
    """What a call's choice weighs of one shape that does not change from call to call: the
    method at that shape (paths fixed), the key its acceptance is remembered under, the short
    key its prices are (`compact`), its Menu and its paths."""

    method: object
    memory_key: tuple
    key: tuple
    menu: Menu
    paths: int = 1


def applies(method, policy, rows: int) -> bool:
    """Whether an "auto" call of `method` on `rows` prompts runs a fixed program chosen per call:
    the backend policy says so below its `adaptive_per_call_below_rows`, for the METHODS."""
    return (method.adaptive and method.name in METHODS
            and rows < policy.adaptive_per_call_below_rows)


def model_seconds(costs: StepCosts, length: int, paths: int = 1, draft_s: float | None = None) -> float:
    """The cost model's seconds per target call of a length's program (0: AR's, one target
    token): target(paths L + 1) + L draft forwards (draft_s each: the draft at paths' rows;
    None: costs.draft)."""
    if length == 0:
        return costs.target(1)
    draft = costs.draft if draft_s is None else draft_s
    return costs.target(paths * length + 1) + length * draft


def menu_lengths(max_len: int) -> tuple[int, ...]:
    """The lengths a call may run up to max_len: 1, the powers of two below it, and max_len (the
    adaptive loop's caps, `adaptive_loop.with_one(compiled_caps)`): the first call at a length
    compiles its program (1-3 s on CPU or GPU, the time of 10-50 batch-1 decodes of the embedded
    pair), so the choice moves among a few programs, not every length up to max_len."""
    return with_one(compiled_caps(max_len))


def simple_menu(costs: StepCosts, max_len: int) -> Menu:
    """The `menu_lengths` of a single-path method drafting with `costs`' draft (or none)."""
    return Menu(menu_lengths(max_len), np.asarray([model_seconds(costs, n) for n in range(max_len + 1)]))


def menu_for(tuner, method, target, draft, sampling, batch: int, context: int) -> Menu:
    """The menu of an "auto" call of `method` (shaped: its paths and tree size fixed) on this
    pair, batch and context, priced by the measured costs (`measure.measure_costs` by the tuner, and for K > 1
    paths the draft's forward at K rows)."""
    from ssd_jax.loop.cascade import cascade_schedule
    from ssd_jax.loop.retrieval import retrieval_layout

    costs = measure.measure_costs(tuner, target, cost_model.cost_draft(method, draft, target), batch, context,
                                 cost_model.cost_width(method))
    if method.name == "csd":
        width = cascade_schedule(method, len(cost_model.draft_models(draft)), sampling).target_width
        return Menu(menu_lengths(width), np.asarray([costs.target(n + 1) for n in range(width + 1)]))
    if method.name in ("pld", "logitspec"):
        lengths = (menu_lengths(method.max_draft_len) if method.name == "pld"
                   else (cost_model.logitspec_branch(method),))
        model = np.zeros(lengths[-1] + 1)
        model[0] = costs.target(1)
        for n in lengths:
            model[n] = costs.target(retrieval_layout(method, n).num_nodes)
        return Menu(lengths, model)
    if method.name == "eagle":   # the head drafts depth L and the target verifies the tree's nodes
        return Menu(menu_lengths(method.max_draft_len),
                    np.asarray([costs.target(method.nodes_at(n) if n else 1) + n * costs.draft
                                for n in range(method.max_draft_len + 1)]))
    paths = getattr(method, "paths", 1)
    if paths == 1:
        return simple_menu(costs, method.max_draft_len)
    rows = measure.forward_seconds(tuner, draft, batch * paths, 1, context) if costs.measured else None
    return Menu(menu_lengths(method.max_draft_len),
                np.asarray([model_seconds(costs, n, paths, rows) for n in range(method.max_draft_len + 1)]))


def fixed(method, length: int):
    """The method at a fixed length (CSD: its max_draft_tokens; an early-stop threshold, which
    only "auto" takes, dropped)."""
    field = "max_draft_tokens" if method.name == "csd" else "draft_len"
    extra = {"threshold": None} if getattr(method, "threshold", None) is not None else {}
    return dataclasses.replace(method, **{field: int(length)}, **extra)


def _nearest(lengths, length: int) -> int:
    return min(lengths, key=lambda n: (abs(n - length), n))


def _carried(surplus: float, source_model_s: float, model_s: float) -> float:
    """A measured surplus carried to a program it was not measured on: as is where positive (the
    part the model misses: sampling, verification, launches), in proportion to the model's price
    where negative (forwards cheaper inside the program than timed alone: as a share of them,
    since an absolute one taken off a shorter length's smaller price left it at or below 0, and
    that length predicted 57x to 2e12x AR)."""
    if surplus >= 0 or source_model_s <= 0:
        return surplus
    return surplus * model_s / source_model_s


def probe_interval(best_speedup: float, probes_lost: int, most: int = PROBE_EVERY_MAX) -> int:
    """The calls of AR's program between probes while it wins: as many as keep a probe's predicted
    loss (1 / best_speedup - 1 of an AR call) within PROBE_OVERHEAD of them, at least
    PROBE_EVERY_MIN, doubled for each probe AR's program kept winning through, at most `most`."""
    loss = 1.0 / max(best_speedup, 1e-6) - 1.0
    first = max(PROBE_EVERY_MIN, calls_apart(loss, PROBE_OVERHEAD))
    return min(first * 2 ** min(probes_lost, 16), most)


def _place(table: Sequence[np.ndarray], flat_index: int) -> tuple[int, int]:
    """(shape index, length) of an index into the shapes' lengths laid end to end."""
    sizes = [t.shape[0] - 1 for t in table]
    index = int(np.searchsorted(np.cumsum(sizes), flat_index, side="right"))
    return index, 1 + flat_index - sum(sizes[:index])


def call_share(steps: int) -> float:
    """The share of one call that a call of `steps` target calls past its first counts as in what
    the calls remember (prices, tokens, acceptance): steps / FULL_SHARE_STEPS, at most 1, at
    least 1 / FULL_SHARE_STEPS."""
    return min(1.0, max(int(steps), 1) / FULL_SHARE_STEPS)


class PerCallMemory:
    """What per-call "auto" remembers (a `ssd_jax.Tuner` owns one): per program key and length,
    the seconds per target call past a call's fixed part and that fixed part (one table, so the
    two are dropped together), the tokens per target call over E(L, a), the probe and re-timing
    counts per group, and the short keys and layouts of the calls' programs. measures: False for a
    deterministic tuner, which remembers nothing and never probes."""

    def __init__(self, measures: bool):
        self.measures = measures
        # (program key, L) -> seconds per target call past a call's fixed part; (program key,
        # (FIXED, L)) -> that fixed part (`record_fixed`)
        self._prices = DecayedMeans(PRICE_WEIGHT, running_start=True)
        # (program key, L) -> tokens per target call over E(L, a) at the acceptance a the call observed
        self._tokens = DecayedMeans(PRICE_WEIGHT, running_start=True)
        self._ar_calls = Recent()   # group -> (calls of AR's program since the last probe, probes it kept winning through)
        # group -> (the winning program, calls of it since its runner-up was last re-timed, re-timings
        # it kept winning through)
        self._winner_calls = Recent()
        self._compact = Recent(1024)   # a program's or group's full key -> its short key (`compact`)
        self._layouts = Recent()       # (group, context bucket) -> its Candidates (`layout`)
        self._numbers = itertools.count()
        self._lock = threading.Lock()

    def compact(self, key) -> tuple:
        """A short key standing for `key` in the tables here. A call's full keys (the weights'
        identities, the method, sampling and shapes) are slow to hash and compare, and a call looks
        its programs up tens of times: a noticeable share of a short call's host time."""
        with self._lock:
            short = self._compact.lookup(key)
            if short is None:
                short = ("program", next(self._numbers))
                self._compact.store(key, short)
        return short

    def layout(self, group, context: int, build: Callable[[], list[Candidate]]) -> list[Candidate]:
        """The Candidates of a call of `group` at this context (bucketed as the costs are): built
        once (`build`, which measures the costs on a process's first call) and kept."""
        key = (group, cost_model.context_bucket(context))
        with self._lock:
            found = self._layouts.lookup(key)
        if found is None:
            found = build()
            with self._lock:
                self._layouts.store(key, found)
        return found

    def _surpluses(self, key, menu: Menu, memo: dict | None = None) -> dict[int, float]:
        """Measured seconds per target call over the model's, by length (0: AR's program), of the
        menu's programs measured under key (kept in memo, by key, where given: one choice reads each
        key's several times)."""
        if memo is not None and key in memo:
            return memo[key]
        found = {}
        if memo is not None:
            memo[key] = found
        if not self.measures:
            return found
        for length in (0,) + menu.lengths:
            measured = self._prices.lookup((key, length))
            if measured is not None:
                found[length] = measured - menu.model_s[length]
        return found

    def prices(self, key, menu: Menu, borrow: Sequence[tuple] = (), memo: dict | None = None) -> np.ndarray:
        """float64 [max_len + 1]: seconds per target call of AR's program (index 0) and of each menu
        length: the model's plus the surplus measured on that program; for a length not measured, the
        nearest measured length's surplus (the shorter on a tie); where no length of this key was
        measured, that of the first of borrow's (key, menu, scale) that has one, times scale where
        positive (another shape's: K / K' paths; a negative one, forwards that run faster inside the
        program than the model measured them alone, does not grow with the paths), else AR's, else
        none; for AR's program not measured, the shortest measured length's (priced bare against
        measured drafts, AR's program looked cheaper than it is, and a call that paid would hand the
        next one to it). Entries of lengths off the menu: inf. memo: as `_surpluses`'."""
        surplus = self._surpluses(key, menu, memo)
        drafted = [n for n in surplus if n > 0]
        borrowed = None
        if not drafted:
            for other_key, other_menu, scale in borrow:
                theirs = {n: extra for n, extra in self._surpluses(other_key, other_menu, memo).items() if n > 0}
                if theirs:
                    borrowed = theirs, scale, other_menu
                    break
        out = np.full(menu.max_len + 1, np.inf)
        for length in (0,) + menu.lengths:
            if length in surplus:
                extra = surplus[length]
            elif drafted:
                near = _nearest(drafted, length)
                extra = _carried(surplus[near], menu.model_s[near], menu.model_s[length])
            elif borrowed is not None and length > 0:
                theirs, scale, other_menu = borrowed
                near = _nearest(theirs, length)
                extra = theirs[near] * scale if theirs[near] > 0 else _carried(
                    theirs[near], other_menu.model_s[near], menu.model_s[length])
            else:
                extra = surplus.get(0, 0.0)
            price = menu.model_s[length] + extra
            if length and length not in surplus:
                # A speculative step verifies more than AR's and drafts besides: never predicted cheaper.
                price = max(price, out[0])
            out[length] = max(price, 1e-12)
        return out

    def tokens_per_call(self, key, menu: Menu, acceptance: float) -> np.ndarray:
        """float64 [max_len + 1]: tokens per target call of AR's program (1) and of each menu length:
        E(L, a) at the remembered acceptance a, times what that length's past calls read against E at
        the acceptance each observed (`record`), else the nearest measured length's (the shorter on a
        tie), else 1. So the lengths follow the text's acceptance, which every speculative call
        renews, while only a length's own calls say how far it reads from the geometric law (a
        retrieval draft that finds nothing on some steps; a length measured while the text was hard
        kept its few tokens when they were remembered as such, and lost to shorter ones for good:
        simulated, L=2 on 258 of 260 calls at 0.68 of L=8 after a 10-call dip). Entries off the
        menu: 0."""
        measured = {}
        if self.measures:
            for length in menu.lengths:
                value = self._tokens.lookup((key, length))
                if value is not None:
                    measured[length] = value
        out = np.zeros(menu.max_len + 1)
        out[0] = 1.0
        for length in menu.lengths:
            ratio = measured[length] if length in measured else (
                measured[_nearest(measured, length)] if measured else 1.0)
            out[length] = expected_tokens(acceptance, length) * ratio
        return out

    def predicted_speedups(self, key, menu: Menu, acceptance: float, borrow: Sequence[tuple] = (),
                           memo: dict | None = None) -> np.ndarray:
        """float64 [max_len + 1]: each program's predicted speedup over AR's (index 0: 1.0; lengths
        off the menu: 0). borrow: as `prices`'."""
        price = self.prices(key, menu, borrow, memo)
        return self.tokens_per_call(key, menu, acceptance) * price[0] / price

    def shape_speedups(self, shapes: Sequence[Shape], memo: dict | None = None) -> list[np.ndarray]:
        """Each shape's `predicted_speedups` (shapes in ascending paths), a shape not yet measured
        borrowing from the others, nearest path count first, at K / K'; a shape not yet measured is
        predicted (else 0: not chosen) only once the shape of the next fewer paths has a measured
        length, so paths are tried one count at a time from the first (the fewest paths: the
        cheapest program to compile). One path runs SD's programs, whose surplus says little of a
        multi-path verifier's: priced from one path's, many paths were tried too early and each
        cost a slow call; 2 paths, once priced, say what 4 will cost."""
        measured = [any(n > 0 for n in self._surpluses(shape.key, shape.menu, memo)) for shape in shapes]
        out = []
        for index, shape in enumerate(shapes):
            if index and not measured[index] and not measured[index - 1]:
                out.append(np.zeros(shape.menu.max_len + 1))
                continue
            others = sorted((o for o in shapes if o is not shape), key=lambda o: abs(math.log(o.paths / shape.paths)))
            borrow = [(o.key, o.menu, shape.paths / o.paths) for o in others]
            out.append(self.predicted_speedups(shape.key, shape.menu, shape.acceptance, borrow, memo))
        return out

    def _priced(self, shapes: Sequence[Shape], memo: dict | None = None) -> np.ndarray:
        """bool, every shape's lengths 1..max_len in turn: whether that program has a measured price."""
        out = []
        for shape in shapes:
            measured = self._surpluses(shape.key, shape.menu, memo)
            out += [n in measured for n in range(1, shape.menu.max_len + 1)]
        return np.asarray(out, dtype=bool)

    def choose_shape(self, group, shapes: Sequence[Shape]) -> tuple[int, int]:
        """(the shape's index, the length) this call runs (length 0: AR's program, the index then the
        shape a probe would run): the best predicted speedup over every shape's lengths (ties: the
        earlier shape, the shorter length), a program never run counted at 1 / EXPLORE_GAIN of its
        prediction; a speculative program over AR's only where that predicts a gain. A program never
        run costs a compile and a slow first run before its price is known (CPU, PLD at T=1, a near
        tie: L=1's compiling call took 0.36-0.43 s against AR's 0.26-0.31, set no price, and the next
        call ran it again; auto ran 0.96-0.99x AR), so it waits for a clear predicted gain, and where
        AR's program wins, a probe runs the best program already priced (any, where none is), once
        `probe_interval` calls of AR's program ran since speculation last won or the last probe,
        counted under group. Decided on process 0's prices on every process (`agreed`)."""
        memo = {}
        table = self.shape_speedups(shapes, memo)
        flat = agreed(np.concatenate([t[1:] for t in table]))
        priced = agreed(self._priced(shapes, memo).astype(np.float64)) > 0
        best = int(np.argmax(np.round(np.where(priced, flat, flat / EXPLORE_GAIN), 6)))
        if flat[best] > (1.0 if priced[best] else EXPLORE_GAIN):
            with self._lock:
                self._ar_calls.store(group, (0, 0))
            return self._retimed_runner_up(group, table, flat, priced, best)
        if priced.any():
            best = int(np.argmax(np.where(priced, np.round(flat, 6), -np.inf)))
        with self._lock:
            self._winner_calls.store(group, (None, 0, 0))
            since, probes_lost = self._ar_calls.lookup(group, (0, 0))
            since += 1
            probe = since >= probe_interval(float(flat[best]), probes_lost) and self.measures
            self._ar_calls.store(group, (0, probes_lost + 1) if probe else (since, probes_lost))
        index, length = _place(table, best)
        return index, (length if probe else 0)

    def _retimed_runner_up(self, group, table: Sequence[np.ndarray], flat: np.ndarray, priced: np.ndarray,
                           best: int) -> tuple[int, int]:
        """(shape index, length) of a call where a speculative program wins: that program, but for a
        re-timing of the runner-up (the best other priced program, or AR's), once `probe_interval`
        calls of the winner ran since it won or since the runner-up was last re-timed (at the
        runner-up's predicted speed relative to the winner's, doubled each re-timing the winner kept
        winning through, at most RETIME_EVERY_MAX: a runner-up far behind costs a re-timing within
        PROBE_OVERHEAD of the calls between, so it is re-timed seldom, but still is). A price is
        renewed only by running its program: without this one slow run of AR's program, or of a
        longer length when the text turned easier, kept it priced out for good (simulated: L=1 on 270
        of 270 calls at 0.91x AR after one AR run 2x slow; L=4 at 2.2x where L=8 paid 2.5x)."""
        others = np.where(priced & (np.arange(flat.shape[0]) != best), np.round(flat, 6), -np.inf)
        runner = int(np.argmax(others))
        ar_runs_up = not np.isfinite(others[runner]) or flat[runner] < 1.0
        runner_speedup = 1.0 if ar_runs_up else float(flat[runner])
        with self._lock:
            winner, since, kept = self._winner_calls.lookup(group, (None, 0, 0))
            if winner != best:
                since, kept = 0, 0
            since += 1
            interval = probe_interval(runner_speedup / float(flat[best]), kept, RETIME_EVERY_MAX)
            retime = since >= interval and self.measures
            self._winner_calls.store(group, (best, 0, kept + 1) if retime else (best, since, kept))
        if not retime:
            return _place(table, best)
        return (_place(table, best)[0], 0) if ar_runs_up else _place(table, runner)

    def choose(self, key, menu: Menu, acceptance: float) -> int:
        """The length this call runs (0: AR's program) for one shape: `choose_shape`'s."""
        return self.choose_shape(key, [Shape(key, menu, acceptance)])[1]

    def ar_unpriced(self, key) -> bool:
        """Whether AR's program was not referenced under key (timings allowed; its mark, the fixed
        part `record_fixed` keeps, dropped with the least recently used entries): the call then times
        it on its inputs before choosing (module docstring). A price kept without its fixed part
        would have AR's next call priced whole against steps priced past it."""
        return self.fixed_part_unknown(key, 0)

    def record_fixed(self, key, seconds: float, length: int = 0) -> None:
        """The fixed part of a call of key's program of `length` (0: AR's, which stands for every
        program of the key not measured itself): the seconds it takes on the call's inputs to one
        token (launch, prefill, setup and the outputs; a drafted program's draft prefill besides:
        CPU, embedded pair, AR 0.26 ms, SD at L=4 0.37, SpecTr at L=4 with 2 paths 0.48), which
        `record` takes off each call's seconds before pricing its target calls after the first.
        Recorded whatever the seconds, so that whether AR's reference ran (`ar_unpriced`) never
        depends on a timing: on a mesh spanning processes each runs the same programs."""
        if self.measures:
            self._prices.add((key, (FIXED, int(length))), max(float(seconds), 0.0))

    def fixed_part_unknown(self, key, length: int) -> bool:
        """Whether the fixed part of key's program of `length` was not measured itself (timings
        allowed): the call that ran it then measures it (`auto_call.fixed_seconds`)."""
        return self.measures and self._prices.lookup((key, (FIXED, int(length)))) is None

    def fixed_part(self, key, length: int) -> float | None:
        """The fixed part of a call of key's program of `length`: its own where measured, else AR's,
        else None."""
        own = self._prices.lookup((key, (FIXED, int(length))))
        return own if own is not None else self._prices.lookup((key, (FIXED, 0)))

    def price_table(self) -> dict:
        """(program key, length) -> the remembered seconds per target call (tests, reports)."""
        return {key: price for key, price in self._prices.means().items() if isinstance(key[1], int)}

    def record(self, key, length: int, seconds: float | None, target_calls: int, tokens: float | None = None,
               acceptance: float | None = None) -> None:
        """A finished call of length's program (0: AR's): its seconds per target call join that
        length's price (None: not timed, a streamed call's host copies would be in it), its tokens
        per target call (a speculative length's) over E(length, acceptance), the per-position
        acceptance the call observed (required with tokens), that length's ratio to the geometric law
        (`tokens_per_call`); neither for a deterministic tuner, nor for a call of no target
        call. Where the key's fixed part is known (`record_fixed`, `fixed_part`), the price is the
        seconds past it over the target calls past the first (which it holds), and a call of one
        target call (its rows all ended at their first token) records nothing: a call whose rows
        ended early is mostly that fixed part, and priced whole it made its length look several
        times dearer per target call, handing the next calls to AR's program. Such a call also counts as a share of one, its target
        calls past the first over FULL_SHARE_STEPS (at most 1), in both the price and the tokens."""
        if length and tokens is not None and acceptance is None:
            raise ValueError("per_call.record: tokens need the acceptance the call observed")
        if not self.measures or target_calls <= 0:
            return
        fixed = self.fixed_part(key, length)
        steps = int(target_calls) - (1 if fixed is not None else 0)
        if steps <= 0:
            return
        share = call_share(steps)
        if seconds is not None:
            steady = float(seconds) - (fixed or 0.0)
            if steady > 0:
                self._prices.add((key, int(length)), steady / steps, share)
        if length and tokens is not None and tokens > 0:
            self._tokens.add((key, int(length)), float(tokens) / expected_tokens(acceptance, int(length)), share)
