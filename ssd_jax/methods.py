"""Method objects: frozen, hashable dataclasses of a decoding method's static configuration.

`AR()`, `SD(draft_len)`, `BV(draft_len)`, `SpecInfer / SpecTr / GBV(draft_len, paths)`,
`PLD(draft_len, min_ngram, max_ngram)`, `LogitSpec(draft_len, topk, tree_size, max_ngram)`,
`CSD(k_matrix, lenience, max_ngram, max_draft_tokens)`, `EAGLE(draft_len, topk, tree_size)`,
`SSD(draft_len, fanout_budget, ...)`.
Being hashable, a method is a static argument of `jax.jit`; it holds no arrays (drafters are
models passed as `draft=`). Every field is checked in `__post_init__` by the rule named in the
class's `RULES` (an `InputError` names the field and the value) and normalised (NumPy integers
become Python ints, so `SD(draft_len=np.int64(4)) == SD(draft_len=4)` with equal hashes).
A rule is one function per field, so a field can later accept more (e.g. draft_len="auto").

`DEFAULTS` (method name -> field -> default) is the one table of defaults: the dataclass fields,
the CLI and the README read it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, ClassVar

import numpy as np

from ssd_jax.errors import InputError

# The one table of defaults. draft_len "auto" (every speculative method's default; an int fixes
# it): adaptive speculation (`ssd_jax.tuning.cost_model`): the cost model picks a length up to
# max_draft_len per call and falls back to plain decoding inside the loop when speculation does
# not pay; single-path drafts are capped per step at the length that pays best, and stop early
# per row when the draft's top probability falls below threshold (None: GREEDY_THRESHOLD at
# temperature 0 and no early stop at T > 0, where a flat draft law says little about acceptance
# and stopping early only adds target calls). A fixed length loses to plain decoding where the
# draft or retrieval guesses badly, which "auto" avoids by falling back; docs/adaptive.md has the
# design and docs/benchmarks.md the measurements. FIXED_PATHS (K = 2) is the best K of
# `benchmarks/bench_speculative.py --sweep`; SSD's budget of 10 speculations per step suits L = 4
# (`benchmarks/bench_ssd.py`).
AUTO = "auto"
_ADAPTIVE = dict(draft_len=AUTO, max_draft_len=8, threshold=None)
GREEDY_THRESHOLD = 0.02
DEFAULTS: dict[str, dict] = {
    "ar": {},
    "sd": dict(_ADAPTIVE),
    "bv": dict(_ADAPTIVE),
    # paths None: chosen per call under "auto" (`ssd_jax.tuning.auto_shape`: 1, 2 or 4 from the
    # measured costs and acceptance; 1 at temperature 0), FIXED_PATHS with a fixed draft_len.
    "specinfer": dict(_ADAPTIVE, paths=None),
    "spectr": dict(_ADAPTIVE, paths=None),
    "gbv": dict(_ADAPTIVE, paths=None),
    "pld": dict(draft_len=AUTO, min_ngram=1, max_ngram=3, max_draft_len=8),
    # tree_size None: under "auto" the largest of 8/16/32/64 nodes (at most the backend policy's)
    # whose target forward costs at most 1.1x one token's, measured (`ssd_jax.tuning.auto_shape`);
    # otherwise, and where nothing is measured, the backend policy's (`ssd_jax.backend`: 8 nodes
    # on CPU, 16 on GPU, 64 on TPU).
    "logitspec": dict(draft_len=AUTO, topk=16, tree_size=None, max_ngram=3, max_draft_len=8),
    "csd": dict(k_matrix=None, lenience=None, max_ngram=4, max_draft_tokens=AUTO),
    # A feature-level head: draft_len deep ("auto": the cost model's L* up to max_draft_len per
    # call, from the head's measured forward, and plain decoding where speculation does not pay);
    # topk nodes per depth of the greedy tree (EAGLE-2) and i.i.d. paths at T > 0; tree_size nodes
    # of the greedy tree verified (None: all drafted, 1 + draft_len * topk). On CPU a chain
    # (topk 1) ran fastest: a wide verification costs several tokens' time there
    # (`benchmarks/bench_eagle.py`; docs/benchmarks.md).
    "eagle": dict(draft_len=AUTO, max_draft_len=8, topk=1, tree_size=None),
    "ssd": dict(draft_len=AUTO, max_draft_len=6, fanout_budget=10, fanout="geometric", saguaro_c=1.0, fallback="jit",
                fanout_acceptance=None, fanout_exponent=None, target_devices=None, draft_devices=None),
}
# `generate` and `decode` default to AR (no draft needed); the `ssd-jax` command loads the
# embedded pair and defaults to SD to show speculation.
DEFAULT_METHOD = "ar"
FIXED_PATHS = 2
CLI_DEFAULT_METHOD = "sd"
FANOUTS = ("geometric", "uniform")
FALLBACKS = ("jit", "ngram", "auto")


# ----------------------------------------------------------------------------------- field rules

def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def positive_int(name: str, value):
    """An integer >= 1 (Python or NumPy; not bool) -> int."""
    if not _is_int(value) or value < 1:
        raise InputError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def draft_length(name: str, value):
    """An integer >= 1, or "auto" (adaptive speculation)."""
    if value == AUTO and isinstance(value, str):
        return AUTO
    if not _is_int(value) or value < 1:
        raise InputError(f"{name} must be an integer >= 1 or {AUTO!r} (adaptive), got {value!r}")
    return int(value)


def _optional(rule: Callable) -> Callable:
    def check(name: str, value):
        return None if value is None else rule(name, value)
    return check


def _choice(options: tuple) -> Callable:
    def check(name: str, value):
        if not isinstance(value, str) or value not in options:
            raise InputError(f"{name} must be one of {', '.join(map(repr, options))}, got {value!r}")
        return value
    return check


def _number_in(low: float, high: float, closed: bool) -> Callable:
    def check(name: str, value):
        if not _is_number(value) or math.isnan(value) or not (
                (low <= value <= high) if closed else (low < value < high)):
            brackets = f"[{low:g}, {high:g}]" if closed else f"({low:g}, {high:g})"
            raise InputError(f"{name} must be a number in {brackets}, got {value!r}")
        return float(value)
    return check


def _lenience(name: str, value):
    if not _is_number(value) or not math.isfinite(value) or value < 1:
        raise InputError(f"{name} must be a finite number >= 1 (1 = plain argmax acceptance), got {value!r}")
    return float(value)


def _k_matrix(name: str, value):
    """Nested rows of integers >= 0 -> a tuple of tuples (its shape is checked against the
    drafters at decode time, `ssd_jax.draft.cascade_schedule.parse_k_matrix`)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) == 0:
        raise InputError(f"{name} must be a nested list of integers >= 0, got {value!r}")
    rows = []
    for r, row in enumerate(value):
        if isinstance(row, (str, bytes)) or not hasattr(row, "__len__"):
            raise InputError(f"{name} row {r} must be a list of integers >= 0, got {row!r}")
        for c, entry in enumerate(row):
            if not _is_int(entry) or entry < 0:
                raise InputError(f"{name}[{r}][{c}] must be an integer >= 0, got {entry!r}")
        rows.append(tuple(int(entry) for entry in row))
    return tuple(rows)


def _devices(name: str, value):
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise InputError(f"{name} must be a sequence of jax devices or device ids, got {value!r}")
    return tuple(value)


# ---------------------------------------------------------------------------------- the methods

@dataclasses.dataclass(frozen=True)
class Method:
    """Base of every method object. name: the method's short name (`generate(method="sd")`);
    RULES: field -> rule(name, value) returning the normalised value or raising InputError."""

    name: ClassVar[str] = ""
    RULES: ClassVar[dict] = {}

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = self.RULES[field.name](field.name, getattr(self, field.name))
            object.__setattr__(self, field.name, value)
        self.check()

    def check(self) -> None:
        """Checks between fields (after each field's own rule)."""

    @property
    def drafts_with_model(self) -> bool:
        return False

    @property
    def adaptive(self) -> bool:
        """Whether "auto" chooses this method's draft length per call (a fixed method: False)."""
        return False


def _d(method: str, field: str):
    return dataclasses.field(default=DEFAULTS[method][field])


@dataclasses.dataclass(frozen=True)
class AR(Method):
    """Autoregressive decoding: one target call per token (the reference every method matches)."""

    name: ClassVar[str] = "ar"


_ADAPTIVE_RULES = dict(draft_len=draft_length, max_draft_len=positive_int,
                       threshold=_optional(_number_in(0.0, 1.0, closed=False)))


@dataclasses.dataclass(frozen=True)
class _AutoLength(Method):
    """A method with adaptive speculation: draft_len an int (fixed) or "auto" (the length chosen
    per call from measured costs, and plain decoding where speculation does not pay);
    max_draft_len: the static maximum "auto" may choose."""

    @property
    def adaptive(self) -> bool:
        return self.draft_len == AUTO

    @property
    def max_len(self) -> int:
        """The longest draft this method may propose (the static maximum under "auto")."""
        return self.max_draft_len if self.adaptive else self.draft_len


@dataclasses.dataclass(frozen=True)
class _Adaptive(_AutoLength):
    """A draft-model method with adaptive speculation; threshold in (0, 1): a single-path draft
    stops early when its top probability for the next token falls below it ("auto" only);
    None: GREEDY_THRESHOLD at temperature 0, no early stop at T > 0 (`early_stop`)."""

    def check(self) -> None:
        if self.threshold is not None and not self.adaptive:
            raise InputError(f"threshold={self.threshold} applies to draft_len=\"auto\" only (a fixed draft "
                             f"never stops early); got draft_len={self.draft_len}")

    def early_stop(self, greedy: bool) -> float:
        """The early-stop threshold a single-path "auto" draft uses (0.0: never stops early)."""
        if self.threshold is not None:
            return self.threshold
        return GREEDY_THRESHOLD if greedy else 0.0

    @property
    def drafts_with_model(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class _SinglePath(_Adaptive):
    draft_len: int | str = AUTO
    max_draft_len: int = 8
    threshold: float | None = None
    RULES: ClassVar[dict] = _ADAPTIVE_RULES

    @property
    def paths(self) -> int:
        return 1


@dataclasses.dataclass(frozen=True)
class SD(_SinglePath):
    """Speculative decoding with a draft model, tokenwise verification (Leviathan et al.)."""

    name: ClassVar[str] = "sd"
    draft_len: int | str = _d("sd", "draft_len")
    max_draft_len: int = _d("sd", "max_draft_len")
    threshold: float | None = _d("sd", "threshold")


@dataclasses.dataclass(frozen=True)
class BV(_SinglePath):
    """Speculative decoding with a draft model, block verification (Sun et al.)."""

    name: ClassVar[str] = "bv"
    draft_len: int | str = _d("bv", "draft_len")
    max_draft_len: int = _d("bv", "max_draft_len")
    threshold: float | None = _d("bv", "threshold")


@dataclasses.dataclass(frozen=True)
class _MultiPath(_Adaptive):
    """paths: K i.i.d. draft paths per row (None: chosen per call under "auto", 1, 2 or 4 from
    measured costs and acceptance, see `ssd_jax.tuning.auto_shape`; FIXED_PATHS with a fixed
    draft_len). Under "auto" the K paths of a row share one length, chosen before drafting (cost
    model); no early stop inside a step: stopping on what the paths drafted breaks GBV's
    exactness."""

    draft_len: int | str = AUTO
    paths: int | None = None
    max_draft_len: int = 8
    threshold: float | None = None
    RULES: ClassVar[dict] = dict(_ADAPTIVE_RULES, paths=_optional(positive_int))


@dataclasses.dataclass(frozen=True)
class SpecInfer(_MultiPath):
    """K i.i.d. draft paths in a token tree, recursive rejection sampling (SpecInfer)."""

    name: ClassVar[str] = "specinfer"
    draft_len: int | str = _d("specinfer", "draft_len")
    max_draft_len: int = _d("specinfer", "max_draft_len")
    threshold: float | None = _d("specinfer", "threshold")
    paths: int | None = _d("specinfer", "paths")


@dataclasses.dataclass(frozen=True)
class SpecTr(_MultiPath):
    """K i.i.d. draft paths in a token tree, k-sequential verification (SpecTr)."""

    name: ClassVar[str] = "spectr"
    draft_len: int | str = _d("spectr", "draft_len")
    max_draft_len: int = _d("spectr", "max_draft_len")
    threshold: float | None = _d("spectr", "threshold")
    paths: int | None = _d("spectr", "paths")


@dataclasses.dataclass(frozen=True)
class GBV(_MultiPath):
    """K i.i.d. draft paths in a token tree, greedy multi-path block verification."""

    name: ClassVar[str] = "gbv"
    draft_len: int | str = _d("gbv", "draft_len")
    max_draft_len: int = _d("gbv", "max_draft_len")
    threshold: float | None = _d("gbv", "threshold")
    paths: int | None = _d("gbv", "paths")


@dataclasses.dataclass(frozen=True)
class PLD(_AutoLength):
    """Prompt lookup: copy what followed the text's last n-gram (n = max_ngram..min_ngram).
    draft_len "auto": the copied length chosen per call (at most max_draft_len), and plain
    decoding while retrieval does not pay."""

    name: ClassVar[str] = "pld"
    draft_len: int | str = _d("pld", "draft_len")
    min_ngram: int = _d("pld", "min_ngram")
    max_ngram: int = _d("pld", "max_ngram")
    max_draft_len: int = _d("pld", "max_draft_len")
    RULES: ClassVar[dict] = dict(draft_len=draft_length, min_ngram=positive_int, max_ngram=positive_int,
                                 max_draft_len=positive_int)

    def check(self) -> None:
        if self.max_ngram < self.min_ngram:
            raise InputError(f"max_ngram={self.max_ngram} is below min_ngram={self.min_ngram}")


@dataclasses.dataclass(frozen=True)
class LogitSpec(_AutoLength):
    """Retrieval for the root and the last logit's top-k next-next guesses, a token tree of at
    most tree_size nodes (root included; None: under "auto" sized from the measured cost of
    wide target forwards, `ssd_jax.tuning.auto_shape`, else the backend policy's size for the
    target's platform, filled in by `for_target`); topk: the most next-next candidates (as many
    as the tree's nodes hold are used); draft_len: the root's retrieved branch ("auto": chosen
    per call, at most max_draft_len and tree_size - 2, and plain decoding while the tree does not
    pay)."""

    name: ClassVar[str] = "logitspec"
    draft_len: int | str = _d("logitspec", "draft_len")
    topk: int = _d("logitspec", "topk")
    tree_size: int | None = _d("logitspec", "tree_size")
    max_ngram: int = _d("logitspec", "max_ngram")
    max_draft_len: int = _d("logitspec", "max_draft_len")
    RULES: ClassVar[dict] = dict(draft_len=draft_length, topk=positive_int, tree_size=_optional(positive_int),
                                 max_ngram=positive_int, max_draft_len=positive_int)

    def check(self) -> None:
        if self.tree_size is not None and self.tree_size < 2:
            raise InputError(f"tree_size must be >= 2 (the root and one draft token), got {self.tree_size}")


@dataclasses.dataclass(frozen=True)
class CSD(Method):
    """Cascade Speculative Drafting over `draft=(model, ..., [MaxGram])`, largest first.

    k_matrix: (n+2) x (n+2) rows/columns target, drafters, Max-Gram (None: the default cascade
    for the temperature, `ssd_jax.draft.cascade_schedule.default_cascade`); lenience: > 1 only at
    temperature 0 (None: 2 there, else 1); max_ngram: Max-Gram's longest n-gram;
    max_draft_tokens: the most draft tokens the target verifies per step (None: the default
    cascade's cap without a k_matrix, else all; "auto": None's cap, and plain decoding while the
    cascade does not pay, `ssd_jax.loop.adaptive_loop`)."""

    name: ClassVar[str] = "csd"
    k_matrix: tuple | None = _d("csd", "k_matrix")
    lenience: float | None = _d("csd", "lenience")
    max_ngram: int = _d("csd", "max_ngram")
    max_draft_tokens: int | str | None = _d("csd", "max_draft_tokens")
    RULES: ClassVar[dict] = dict(k_matrix=_optional(_k_matrix), lenience=_optional(_lenience),
                                 max_ngram=positive_int, max_draft_tokens=_optional(draft_length))

    @property
    def adaptive(self) -> bool:
        return self.max_draft_tokens == AUTO

    @property
    def cap(self) -> int | None:
        """max_draft_tokens as the schedule takes it (None for "auto")."""
        return None if self.adaptive else self.max_draft_tokens

    @property
    def drafts_with_model(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class SSD(_AutoLength):
    """Speculative speculative decoding (Saguaro), host-driven across two device groups: only
    `generate` runs it. fanout_acceptance / fanout_exponent: Saguaro's a and r (None: estimated
    online); target_devices / draft_devices: None = the visible devices split in two.
    draft_len "auto": L chosen per call by the cost model (at most max_draft_len), and the call
    finishes by plain decoding once SSD measures slower than it (`ssd_jax.ssd.auto`)."""

    name: ClassVar[str] = "ssd"
    draft_len: int | str = _d("ssd", "draft_len")
    max_draft_len: int = _d("ssd", "max_draft_len")
    fanout_budget: int = _d("ssd", "fanout_budget")
    fanout: str = _d("ssd", "fanout")
    saguaro_c: float = _d("ssd", "saguaro_c")
    fallback: str = _d("ssd", "fallback")
    fanout_acceptance: float | None = _d("ssd", "fanout_acceptance")
    fanout_exponent: float | None = _d("ssd", "fanout_exponent")
    target_devices: tuple | None = _d("ssd", "target_devices")
    draft_devices: tuple | None = _d("ssd", "draft_devices")
    RULES: ClassVar[dict] = dict(
        draft_len=draft_length, max_draft_len=positive_int, fanout_budget=positive_int, fanout=_choice(FANOUTS),
        saguaro_c=_number_in(0.0, 1.0, closed=True), fallback=_choice(FALLBACKS),
        fanout_acceptance=_optional(_number_in(0.0, 1.0, closed=False)),
        fanout_exponent=_optional(_number_in(0.0, math.inf, closed=False)),
        target_devices=_optional(_devices), draft_devices=_optional(_devices))

    @property
    def drafts_with_model(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class EAGLE(_AutoLength):
    """A feature-level draft head (`draft=` an `ssd_jax.eagle.EagleHead`), draft_len deep ("auto":
    chosen per call up to max_draft_len, with plain decoding where speculation does not pay). At
    T = 0 (and under the Gumbel coupling) an EAGLE-2 tree: the topk best nodes (by cumulative
    draft probability) per depth while expanding, the tree_size best of those (root included;
    None: all, 1 + draft_len * topk) verified by the exact point-mass tree walk. At T > 0 topk
    i.i.d. paths drawn from the head's law, verified by SpecInfer's recursive rejection."""

    name: ClassVar[str] = "eagle"
    draft_len: int | str = _d("eagle", "draft_len")
    max_draft_len: int = _d("eagle", "max_draft_len")
    topk: int = _d("eagle", "topk")
    tree_size: int | None = _d("eagle", "tree_size")
    RULES: ClassVar[dict] = dict(draft_len=draft_length, max_draft_len=positive_int, topk=positive_int,
                                 tree_size=_optional(positive_int))

    def check(self) -> None:
        most = 1 + self.max_len * self.topk
        if self.tree_size is not None and not 2 <= self.tree_size <= most:
            longest = "max_draft_len" if self.adaptive else "draft_len"
            raise InputError(f"tree_size must be in [2, 1 + {longest} * topk = {most}] (the root and the drafted "
                             f"nodes), got {self.tree_size}")

    def nodes_at(self, draft_len: int) -> int:
        """The nodes verified (root included) at this depth: tree_size, at most all drafted."""
        most = 1 + draft_len * self.topk
        return most if self.tree_size is None else min(self.tree_size, most)

    @property
    def nodes(self) -> int:
        """The nodes a fixed-length tree verifies, root included."""
        return self.nodes_at(self.max_len)

    @property
    def drafts_with_model(self) -> bool:
        return True


METHOD_CLASSES: dict[str, type] = {cls.name: cls for cls in (AR, SD, BV, SpecInfer, SpecTr, GBV, PLD, LogitSpec,
                                                             CSD, EAGLE, SSD)}
METHODS = tuple(METHOD_CLASSES)
SYNCHRONOUS = tuple(name for name in METHODS if name != "ssd")


def for_target(method: Method, target) -> Method:
    """The method with the shape fields still None set: LogitSpec's tree_size to the backend
    policy's for the platform the target lives on, the multi-path methods' paths to FIXED_PATHS.
    (`generate` and `decode` first let "auto" choose them, `ssd_jax.tuning.auto_shape.shaped`.)"""
    if isinstance(method, LogitSpec) and method.tree_size is None:
        from ssd_jax.backend import policy_for

        return dataclasses.replace(method, tree_size=policy_for(target).logitspec_tree_size)
    if isinstance(method, _MultiPath) and method.paths is None:
        return dataclasses.replace(method, paths=FIXED_PATHS)
    return method


def as_method(method) -> Method:
    """A method object, or a method name for its default object (`"gbv"` -> `GBV()`)."""
    if isinstance(method, Method):
        return method
    if isinstance(method, str) and method in METHOD_CLASSES:
        return METHOD_CLASSES[method]()
    if isinstance(method, type) and issubclass(method, Method) and method.name:
        raise InputError(f"method must be a method object, got the class {method.__name__}; "
                         f"use method={method.__name__}()")
    if isinstance(method, str):
        raise InputError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
    raise InputError(f"method must be a method object (ssd_jax.{', ssd_jax.'.join(c.__name__ for c in METHOD_CLASSES.values())}) "
                     f"or one of the names {', '.join(METHODS)}; got {method!r:.80}")
