"""Tests written against the old keyword options build method objects through `make`."""

from ssd_jax.generate import OLD_OPTIONS
from ssd_jax.methods import METHOD_CLASSES

# The fixed lengths these tests were written for (the defaults before "auto" became every
# method's default): the mechanics they check (hits and misses, tree shapes, counters) need a
# length that does not move with timings. "auto" has its own tests (test_adaptive.py, test_ssd.py).
FIXED = {"sd": dict(draft_len=5), "bv": dict(draft_len=5), "specinfer": dict(draft_len=5),
         "spectr": dict(draft_len=5), "gbv": dict(draft_len=5), "csd": dict(max_draft_tokens=None),
         "ssd": dict(draft_len=4)}


def make(method: str, **options):
    """make("gbv", num_draft_tokens=4, num_paths=3) -> GBV(draft_len=4, paths=3); a length left
    out is the fixed one of FIXED."""
    fields = dict(FIXED.get(method, {}), **{OLD_OPTIONS[k]: v for k, v in options.items()})
    return METHOD_CLASSES[method](**fields)
