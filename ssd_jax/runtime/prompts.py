"""Validation, padding and bucketing of ragged prompt batches, and per-row random keys."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.errors import InputError
from ssd_jax.models.config import ModelConfig

MIN_BUCKET = 16


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """The smallest power of two >= max(n, minimum): bounds recompiles to log2(max length)."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """Right-padded prompts. tokens: int32 [B, T_bucket]; lengths: int32 [B]."""

    tokens: np.ndarray
    lengths: np.ndarray

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_length(self) -> int:
        return int(self.lengths.max())


def _as_row(row, index: int) -> np.ndarray:
    if isinstance(row, (str, bytes)):
        raise InputError(f"prompt {index} is a string; pass token ids (encode with model.tokenizer first)")
    if isinstance(getattr(row, "ids", None), list) and not isinstance(row, (list, tuple, np.ndarray)):
        # A tokenizers.Encoding (what model.tokenizer.encode returns) is not itself a sequence.
        raise InputError(f"prompt {index} is of type {type(row).__name__}, not token ids; pass its .ids "
                         "(model.tokenizer.encode(text).ids)")
    try:
        array = np.asarray(row)
    except Exception:
        raise InputError(f"prompt {index} is not a sequence of token ids: {row!r:.80}") from None
    if array.ndim != 1:
        raise InputError(f"prompt {index} must be a flat list of token ids, got shape {array.shape}")
    if array.size == 0:
        raise InputError(f"prompt {index} is empty; every prompt needs at least one token")
    if not np.issubdtype(array.dtype, np.integer):
        raise InputError(f"prompt {index} holds non-integer values of dtype {array.dtype}")
    return array.astype(np.int64)


def prepare_prompts(prompt_ids: Sequence[Sequence[int]], config: ModelConfig, max_new_tokens: int) -> PromptBatch:
    """Checks ids and lengths against the model and right-pads to a length bucket."""
    if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__len__"):
        raise InputError(f"prompt_ids must be a list of token-id lists, got {type(prompt_ids).__name__}")
    if len(prompt_ids) == 0:
        raise InputError("prompt_ids is empty; pass at least one prompt")
    if isinstance(prompt_ids, np.ndarray) and prompt_ids.ndim == 1 or (
        len(prompt_ids) and isinstance(prompt_ids[0], (int, np.integer))
    ):
        raise InputError("prompt_ids must be a list of token-id lists (a batch); wrap a single prompt as [ids]")
    if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    rows = [_as_row(r, i) for i, r in enumerate(prompt_ids)]
    for i, row in enumerate(rows):
        bad = (row < 0) | (row >= config.vocab_size)
        if bad.any():
            raise InputError(
                f"prompt {i} has token id {int(row[bad][0])} outside the vocabulary [0, {config.vocab_size})"
            )
        total = len(row) + int(max_new_tokens)
        if total > config.max_position_embeddings:
            raise InputError(
                f"prompt {i} has {len(row)} tokens; with max_new_tokens={max_new_tokens} that is {total} "
                f"positions, beyond the model's max_position_embeddings={config.max_position_embeddings}"
            )
    lengths = np.array([len(r) for r in rows], np.int32)
    tokens = np.zeros((len(rows), bucket(lengths.max())), np.int32)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
    return PromptBatch(tokens=tokens, lengths=lengths)


def row_keys(key, batch_size: int, sampling=None) -> jax.Array:
    """Per-row raw keys uint32 [B, 2].

    A single key is given to every row (under the Gumbel coupling, `sampling.coupled`, row r gets
    fold_in(key, r), so equal prompts in one batch are independent draws), so a row's result does
    not depend on the other rows of its batch or their padding; pass B keys (shape [B] typed or
    [B, 2] raw) to choose every row's key.
    """
    if key is None:
        key = jax.random.PRNGKey(0)
    key = jnp.asarray(key)
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    if key.dtype != jnp.uint32 or key.ndim not in (1, 2) or key.shape[-1] != 2:
        raise InputError(f"key must be a PRNG key or a batch of {batch_size} keys, got shape {key.shape} {key.dtype}")
    if key.ndim == 1:
        if sampling is not None and sampling.coupled:
            return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(batch_size, dtype=jnp.uint32))
        return jnp.broadcast_to(key, (batch_size, 2))
    if key.shape[0] != batch_size:
        raise InputError(f"got {key.shape[0]} keys for a batch of {batch_size} prompts")
    return key
