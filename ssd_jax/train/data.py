"""Token streams and deterministic batches of windows for training."""

from __future__ import annotations

import numpy as np

from ssd_jax.errors import InputError
from ssd_jax.train.corpus import read_text


def tokenize_files(tokenizer, paths, eos_id: int) -> np.ndarray:
    """Concatenates the token ids of every file, each followed by EOS: int32 [N]."""
    if not paths:
        return np.zeros((0,), np.int32)
    texts = [read_text(p) for p in paths]
    encodings = tokenizer.encode_batch(texts)
    pieces = []
    for enc in encodings:
        pieces.append(np.asarray(enc.ids, np.int32))
        pieces.append(np.array([eos_id], np.int32))
    return np.concatenate(pieces)


def batch_at(tokens: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int) -> np.ndarray:
    """Random windows int32 [batch_size, seq_len + 1], a pure function of (seed, step): a resumed
    run sees exactly the batches it would have seen."""
    if len(tokens) < seq_len + 2:
        raise InputError(f"corpus has {len(tokens)} tokens, fewer than one window of seq_len={seq_len} + 1")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch_size)
    return np.stack([tokens[s: s + seq_len + 1] for s in starts])


def eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int) -> list[np.ndarray]:
    """Consecutive non-overlapping windows for a held-out loss: list of int32 [batch_size, seq_len + 1]."""
    window = seq_len + 1
    count = min(len(tokens) // window, batch_size * max_batches)
    windows = tokens[: count * window].reshape(count, window)
    return [windows[i: i + batch_size] for i in range(0, count - batch_size + 1, batch_size)]
