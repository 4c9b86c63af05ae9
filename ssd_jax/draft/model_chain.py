"""Draft-model drafting: catch up on the tokens emitted last step, then L autoregressive draft
steps in `lax.scan`, for K independent paths at once (the draft cache holds K copies per row)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ssd_jax.backend import scan_unroll
from ssd_jax.coupling import decision_logits
from ssd_jax.draft.vocab import align_logits
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import KVCache, commit
from ssd_jax.models.transformer import forward_cached
from ssd_jax.sampling import SamplingParams, argmax_first, probabilities, sample


def catch_up(params: dict, config: ModelConfig, cache: KVCache, chunk: jax.Array,
             chunk_len: jax.Array) -> tuple[jax.Array, KVCache]:
    """The draft reads the tokens it has not seen. chunk int32 [N, C], chunk_len int32 [N] >= 1
    valid. Returns (float32 [N, V] logits after the last valid token, cache with them committed)."""
    positions = cache.lengths[:, None] + jnp.arange(chunk.shape[1], dtype=jnp.int32)[None, :]
    logits, cache = forward_cached(params, config, chunk, positions, cache, logit_indices=(chunk_len - 1)[:, None])
    return logits[:, 0], commit(cache, chunk_len)


def extend(params: dict, config: ModelConfig, cache: KVCache, token: jax.Array) -> tuple[jax.Array, KVCache]:
    """One draft forward: token int32 [N] is read and committed. Returns (logits [N, V], cache)."""
    logits, cache = forward_cached(params, config, token[:, None], cache.lengths[:, None], cache)
    return logits[:, 0], commit(cache, jnp.ones(token.shape, jnp.int32))


def draft_paths(
    params: dict,
    config: ModelConfig,
    cache: KVCache,
    chunk: jax.Array,
    chunk_len: jax.Array,
    keys: jax.Array,
    *,
    num_draft_tokens: int,
    sampling: SamplingParams,
    target_vocab: int,
    unroll: bool = False,
    branch: int = 1,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """Drafts num_draft_tokens (L) tokens per path (unroll: the L - 1 forwards as straight-line
    code instead of a `lax.scan`, the backend policy's `unroll_draft_steps`; the same values).
    Under the Gumbel coupling keys are the rows' noise keys and each token is the argmax of the
    perturbed draft law (`ssd_jax.coupling`); there, branch K > 1 makes the K copies of a row
    (consecutive rows) start with its K best first tokens under log q + G, a tree of the draft's
    top candidates instead of K equal paths.

    cache: draft cache of batch B*K (path k of row b at index b*K + k, all copies holding the
    same committed text). chunk int32 [B*K, C]: tokens not yet in the cache, chunk_len[i] of them
    valid (>= 1; the last valid one is the root of the new paths). keys uint32 [B*K, 2].
    Returns (paths int32 [B*K, L], q float32 [B*K, L, target_vocab] the processed draft
    probabilities each token was sampled from, cache with the chunk and the first L-1 path tokens
    committed).
    """
    logits, cache = catch_up(params, config, cache, chunk, chunk_len)
    base = cache.lengths   # the position of each path's first token
    rank = jnp.arange(base.shape[0]) % branch

    def step(carry, i):
        logits, cache = carry
        token, q = _draw(logits, keys, base + i, i, rank, branch, sampling, target_vocab)
        return extend(params, config, cache, token), (token, q)

    (logits, cache), (tokens, qs) = jax.lax.scan(
        step, (logits, cache), jnp.arange(num_draft_tokens - 1, dtype=jnp.int32),
        unroll=scan_unroll(unroll, num_draft_tokens - 1),
    )
    last, q_last = _draw(logits, keys, base + num_draft_tokens - 1, num_draft_tokens - 1, rank, branch, sampling,
                         target_vocab)
    paths = jnp.concatenate([tokens.T, last[:, None]], axis=1)
    q = jnp.concatenate([jnp.moveaxis(qs, 0, 1), q_last[:, None]], axis=1)
    return paths, q, cache


def _draw(logits, keys, positions, i, rank, branch: int, sampling: SamplingParams, target_vocab: int):
    """Draft token i of every path: logits [N, Vd] -> (token int32 [N], its law q float32 [N, V]):
    a draw from q with fold_in(keys, i), or where decisions are argmaxes (`by_argmax`) the argmax
    of the (perturbed, at positions int32 [N]) logits, path `rank` of a branching row taking its
    rank-th best first token (a branching row's copies share its key and positions, so their
    noise is drawn once)."""
    scores = decision_logits(align_logits(logits, target_vocab), keys, positions, sampling, copies=branch)
    q = probabilities(scores, sampling)
    if not sampling.by_argmax:
        return jax.vmap(sample)(jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, i), q), q
    token = argmax_first(scores)
    if branch > 1:
        ranked = jnp.take_along_axis(jax.lax.top_k(scores, branch)[1], rank[:, None], axis=1)[:, 0]
        token = jnp.where(i == 0, ranked.astype(jnp.int32), token)
        q = jax.nn.one_hot(token, q.shape[-1], dtype=jnp.float32)
    return token, q


def confidence(logits: jax.Array, q: jax.Array, sampling: SamplingParams, target_vocab: int) -> jax.Array:
    """The draft's confidence in its next token, float32 [N], from its logits [N, V] and processed
    law q [N, target_vocab]: the top of q at temperature > 0, of softmax(logits) at temperature 0
    (where q is one-hot)."""
    if not sampling.by_argmax:
        return jnp.max(q, axis=-1)
    return jnp.max(jax.nn.softmax(align_logits(logits, target_vocab).astype(jnp.float32), axis=-1), axis=-1)


def draft_path_until_unsure(
    params: dict,
    config: ModelConfig,
    cache: KVCache,
    chunk: jax.Array,
    chunk_len: jax.Array,
    keys: jax.Array,
    active: jax.Array,
    *,
    max_draft_tokens: int,
    threshold: float,
    sampling: SamplingParams,
    target_vocab: int,
    limit: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, KVCache]:
    """Drafts one path per row, each row stopping when the draft's top probability for its next
    token falls below threshold (or at max_draft_tokens L): a `lax.while_loop` that ends when
    every row has stopped.

    A row decides whether to draft token i+1 from the draft's law after its first i tokens, before
    sampling it, so the length is a stopping time of the draft's own process: token-wise and block
    verification of the proposed tokens stay exact (tests/test_adaptive.py). limit: int32 [] in
    1..L, a cap on every row's length decided before this step (adaptive speculation's choice
    from past steps; None: L). The confidence is
    the top of the processed law q at temperature > 0 and of softmax(logits) at temperature 0.

    cache: draft cache of batch B; chunk int32 [B, C] with chunk_len [B] valid (see
    `draft_paths`); keys uint32 [B, 2]; active bool [B] (inactive rows propose nothing).
    Returns (path int32 [B, L] (entries at or past a row's length are meaningless), q float32
    [B, L, target_vocab], lengths int32 [B] in [0, L], draft forwards run after the catch-up
    int32 [], cache with the chunk and the first forwards' tokens committed).
    """
    n, L = chunk.shape[0], max_draft_tokens
    logits, cache = catch_up(params, config, cache, chunk, chunk_len)
    base = cache.lengths   # the position of each row's first draft token
    no_rank = jnp.zeros_like(base)

    def propose(logits, i, going):
        token, q = _draw(logits, keys, base + i, i, no_rank, 1, sampling, target_vocab)
        aligned = align_logits(logits, target_vocab)
        going = going & (confidence(aligned, q, sampling, target_vocab) >= threshold)
        return token, q, going

    token, q0, going = propose(logits, 0, active)
    tokens = jnp.zeros((n, L), jnp.int32).at[:, 0].set(token)
    qs = jnp.zeros((n, L, q0.shape[-1]), jnp.float32).at[:, 0].set(q0)

    def body(carry):
        i, cache, tokens, qs, going, lengths = carry
        new_logits, cache = extend(params, config, cache, tokens[:, i - 1])
        token, q, going = propose(new_logits, i, going)
        tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, i))
        qs = jax.lax.dynamic_update_slice(qs, q[:, None], (0, i, 0))
        return i + 1, cache, tokens, qs, going, lengths + going.astype(jnp.int32)

    end = L if limit is None else jnp.clip(limit, 1, L)

    def more(carry):
        i, going = carry[0], carry[4]
        return (i < end) & jnp.any(going)

    i, cache, tokens, qs, _, lengths = jax.lax.while_loop(
        more, body, (jnp.ones((), jnp.int32), cache, tokens, qs, going, going.astype(jnp.int32)))
    return tokens, qs, lengths, i - 1, cache
