"""Tests written against the old keyword options build method objects through `make`."""

from ssd_jax.generate import OLD_OPTIONS
from ssd_jax.methods import METHOD_CLASSES


def make(method: str, **options):
    """make("gbv", num_draft_tokens=4, num_paths=3) -> GBV(draft_len=4, paths=3)."""
    return METHOD_CLASSES[method](**{OLD_OPTIONS[k]: v for k, v in options.items()})
