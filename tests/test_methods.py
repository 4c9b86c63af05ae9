"""Method objects: every field of every method, good values accepted, bad ones refused naming the field."""

from __future__ import annotations

import numpy as np
import pytest

import ssd_jax
from ssd_jax.errors import InputError
from ssd_jax.methods import DEFAULTS, METHOD_CLASSES, as_method

BAD_COUNTS = [0, -1, True, 2.0, "3", None]
GOOD_COUNTS = [1, 7, np.int64(4), np.int32(2)]
# Adaptive methods: draft_len may be "auto"; max_draft_len (and for draft models threshold) go with it.
ADAPTIVE = dict(draft_len=(GOOD_COUNTS + ["auto"], BAD_COUNTS + ["automatic", "AUTO"]),
                max_draft_len=(GOOD_COUNTS, BAD_COUNTS),
                threshold=([None, 0.02, 0.5, np.float32(0.9)], [0, 1, 1.5, -0.1, True, "0.5", float("nan")]))
# method class -> field -> (good values, bad values); every field of every class appears.
TABLE = {
    ssd_jax.AR: {},
    ssd_jax.SD: dict(ADAPTIVE),
    ssd_jax.BV: dict(ADAPTIVE),
    ssd_jax.SpecInfer: dict(ADAPTIVE, paths=([None] + GOOD_COUNTS, [c for c in BAD_COUNTS if c is not None])),
    ssd_jax.SpecTr: dict(ADAPTIVE, paths=([None] + GOOD_COUNTS, [c for c in BAD_COUNTS if c is not None])),
    ssd_jax.GBV: dict(ADAPTIVE, paths=([None] + GOOD_COUNTS, [c for c in BAD_COUNTS if c is not None])),
    ssd_jax.PLD: dict(draft_len=ADAPTIVE["draft_len"], max_draft_len=ADAPTIVE["max_draft_len"],
                      min_ngram=([1], BAD_COUNTS + [9]), max_ngram=([3, np.int64(5)], BAD_COUNTS)),
    ssd_jax.LogitSpec: dict(draft_len=ADAPTIVE["draft_len"], max_draft_len=ADAPTIVE["max_draft_len"],
                            topk=(GOOD_COUNTS, BAD_COUNTS),
                            tree_size=([None, 2, 64, np.int64(8)], BAD_COUNTS[:-1] + [1]), max_ngram=(GOOD_COUNTS, BAD_COUNTS)),
    ssd_jax.CSD: dict(k_matrix=([None, [[0, 3, 0], [0, 0, 2]], ((0, 1, 0), (0, 0, np.int64(1)), (0, 0, 0))],
                                ["abc", 3, [[0, -1, 0]], [[0, 1.5, 0]], [[0, True, 0]], [], [3]]),
                      lenience=([None, 1, 2.5, np.float32(3.0)], [0.5, 0, True, "2", float("inf"), float("nan")]),
                      max_ngram=(GOOD_COUNTS, BAD_COUNTS),
                      max_draft_tokens=([None] + GOOD_COUNTS, BAD_COUNTS[:-1])),
    ssd_jax.SSD: dict(draft_len=ADAPTIVE["draft_len"], max_draft_len=ADAPTIVE["max_draft_len"],
                      fanout_budget=(GOOD_COUNTS, BAD_COUNTS),
                      fanout=(["geometric", "uniform"], ["tree", 1, None]),
                      saguaro_c=([0, 0.3, 1.0, np.float64(0.5)], [-0.1, 1.5, True, "1", None, float("nan")]),
                      fallback=(["jit", "ngram", "auto"], ["model", 0, None]),
                      fanout_acceptance=([None, 0.5], [0.0, 1.0, 2, True, "x"]),
                      fanout_exponent=([None, 0.5, 3], [0, -1, float("inf"), True, "x"]),
                      target_devices=([None, ()], [3, "cpu"]), draft_devices=([None, ()], [3, "cpu"])),
    ssd_jax.EAGLE: dict(draft_len=ADAPTIVE["draft_len"], max_draft_len=ADAPTIVE["max_draft_len"],
                        topk=([1, 8], [0, None, "4"]), tree_size=([None, 2, 9], [1, 10, 0, "x"])),
}
CASES = [(cls, field, value, ok) for cls, fields in TABLE.items() for field, (good, bad) in fields.items()
         for ok, values in ((True, good), (False, bad)) for value in values]


def test_the_table_covers_every_field_of_every_method():
    assert set(TABLE) == set(METHOD_CLASSES.values())
    for cls, fields in TABLE.items():
        import dataclasses
        assert set(fields) == {f.name for f in dataclasses.fields(cls)}, cls
        assert set(fields) == set(DEFAULTS[cls.name]), cls


@pytest.mark.parametrize("cls, field, value, ok", CASES, ids=[f"{c.__name__}-{f}-{v!r}-{o}" for c, f, v, o in CASES])
def test_field_values(cls, field, value, ok):
    if ok:
        method = cls(**{field: value})
        assert hash(method) == hash(cls(**{field: getattr(method, field)}))
    else:
        with pytest.raises(InputError, match=field):
            cls(**{field: value})


@pytest.mark.parametrize("cls", [ssd_jax.SD, ssd_jax.BV, ssd_jax.SpecInfer, ssd_jax.SpecTr, ssd_jax.GBV])
def test_a_threshold_with_a_fixed_length_is_refused(cls):
    """The early stop is "auto"'s: with a fixed length a threshold would be ignored silently."""
    with pytest.raises(InputError, match=r"threshold=0.5 applies to draft_len=\"auto\" only.*draft_len=4"):
        cls(draft_len=4, threshold=0.5)
    from ssd_jax.tuning.per_call import fixed

    assert fixed(cls(threshold=0.5), 4) == cls(draft_len=4)   # the per-call choice's fixed programs


def test_numpy_and_python_integers_make_equal_objects():
    assert ssd_jax.SD(draft_len=np.int64(4)) == ssd_jax.SD(draft_len=4)
    assert hash(ssd_jax.SD(draft_len=np.int64(4))) == hash(ssd_jax.SD(draft_len=4))
    assert type(ssd_jax.GBV(paths=np.int32(3)).paths) is int
    assert ssd_jax.SD(draft_len=4) != ssd_jax.BV(draft_len=4)


def test_defaults_come_from_the_table_and_names_resolve():
    for name, cls in METHOD_CLASSES.items():
        method = as_method(name)
        assert method == cls() and method.name == name
        for field, default in DEFAULTS[name].items():
            assert getattr(method, field) == default
    with pytest.raises(InputError, match="use method=SD"):
        as_method(ssd_jax.SD)
    with pytest.raises(InputError, match="'beam'"):
        as_method("beam")


def test_cross_field_checks():
    with pytest.raises(InputError, match="max_ngram=2 is below min_ngram=3"):
        ssd_jax.PLD(min_ngram=3, max_ngram=2)
