"""Checking the options of Cascade Speculative Drafting (method "csd") that are not models:
lenience, Max-Gram's largest n-gram and its bigram table."""

from __future__ import annotations

import math
import os

import numpy as np

from ssd_jax.errors import CheckpointError, InputError
from ssd_jax.model import Model
from ssd_jax.sampling import SamplingParams

DEFAULT_MAX_NGRAM = 4
BUILD_HINT = ("build one for the target's tokenizer with `ssd-jax build-bigram --tokenizer ... --data ... "
              "--out table.npz` and pass bigram='table.npz' (or an int32 array [V])")


def default_lenience(sampling: SamplingParams) -> float:
    """2 at temperature 0, else 1. Greedy target verification keeps the output exact whatever
    the drafters keep, and a lenient drafter passes more tokens up to the target, so each target
    call emits more (`benchmarks/bench_cascade.py`; docs/benchmarks.md)."""
    return 2.0 if sampling.by_argmax else 1.0


def check_lenience(lenience, sampling: SamplingParams) -> float:
    """lenience: a finite number >= 1; above 1 only where reviews are argmaxes (temperature 0, or
    the Gumbel coupling's perturbed logits): lenient acceptance between drafters has no exact
    counterpart in rejection sampling. Returns it as a float."""
    if isinstance(lenience, bool) or not isinstance(lenience, (int, float, np.integer, np.floating)) \
            or not math.isfinite(lenience) or lenience < 1:
        raise InputError(f"lenience must be a finite number >= 1 (1 = plain argmax acceptance), got {lenience!r}")
    if lenience > 1 and not sampling.by_argmax:
        raise InputError(f"lenience={lenience} relaxes acceptance between drafters at temperature 0 or under "
                         f"coupling='gumbel' only; temperature={sampling.temperature} with rejection sampling "
                         f"needs lenience=1")
    return float(lenience)


def check_max_ngram(max_ngram) -> int:
    if isinstance(max_ngram, bool) or not isinstance(max_ngram, (int, np.integer)) or max_ngram < 1:
        raise InputError(f"max_ngram must be an integer >= 1, got {max_ngram!r}")
    return int(max_ngram)


def resolve_bigram(target: Model, bigram) -> np.ndarray:
    """Max-Gram's table for the target: int32 [V].

    bigram: an integer array [target vocab] with ids in range, the path of a table written by
    `ssd-jax build-bigram`, or None for the shipped table, which is used only when the target has
    the embedded tokenizer (checked by fingerprint). Raises InputError naming the problem otherwise.
    """
    vocab = target.config.vocab_size
    if isinstance(bigram, (str, os.PathLike)):
        from ssd_jax.draft.bigram import load_bigram

        try:
            bigram = load_bigram(os.fspath(bigram))
        except CheckpointError as err:
            raise InputError(str(err)) from None
    if bigram is None:
        from ssd_jax.draft.bigram import DEFAULT_BIGRAM_PATH, load_bigram, tokenizer_fingerprint

        if target.tokenizer is None:
            raise InputError(f"Max-Gram needs a bigram table and the target has no tokenizer to match the "
                             f"shipped one against; {BUILD_HINT}")
        try:
            table = load_bigram(DEFAULT_BIGRAM_PATH, tokenizer_fingerprint=tokenizer_fingerprint(target.tokenizer))
        except CheckpointError as err:
            raise InputError(f"Max-Gram needs a bigram table for the target's tokenizer ({err}); "
                             f"{BUILD_HINT}") from None
        bigram = table
    table = np.asarray(bigram)
    if table.ndim != 1 or table.shape[0] != vocab:
        raise InputError(f"bigram must be an int32 table [V={vocab}] (the target's vocabulary), "
                         f"got shape {table.shape}")
    if table.dtype.kind not in "iu":
        raise InputError(f"bigram must hold integer token ids, got dtype {table.dtype}")
    bad = np.flatnonzero((table < 0) | (table >= vocab))
    if bad.size:
        raise InputError(f"bigram maps token {int(bad[0])} to {int(table[bad[0]])}, outside [0, {vocab})")
    return table.astype(np.int32)
