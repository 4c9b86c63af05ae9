"""Autoregressive decoding: prefill, then one token per target call, the whole loop one
`lax.while_loop` on the device. The reference every speculative method must reproduce."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.engine.compiled import compiled
from ssd_jax.engine.output import FINISH_EOS, FINISH_LENGTH, GenerateOutput, rows_from_buffers
from ssd_jax.engine.prompts import PromptBatch, bucket, row_keys
from ssd_jax.engine.streaming import StreamSink, emit, streaming_to
from ssd_jax.model import Model
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import KVCache, commit, init_cache
from ssd_jax.models.transformer import decode_params, forward_cached
from ssd_jax.sampling import SamplingParams, sample_from_logits


def prefill(params: dict, config: ModelConfig, tokens: jax.Array, lengths: jax.Array, capacity: int):
    """Runs right-padded prompts through a fresh cache.

    tokens int32 [B, T]; lengths int32 [B]. Returns (float32 logits [B, V] at each row's last
    prompt token, cache with lengths = prompt lengths). Pad slots are written but not committed.
    With per-layer params (`decode_params`, `unstack_layers`) the cache is per-layer too.
    """
    b, t = tokens.shape
    per_layer = isinstance(params["layers"], (tuple, list))
    cache = init_cache(config, b, capacity, params["embed"].dtype, per_layer=per_layer)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, cache = forward_cached(params, config, tokens, positions, cache, logit_indices=(lengths - 1)[:, None])
    return logits[:, 0], cache.replace(lengths=lengths)


def sample_rows(sampling: SamplingParams, keys: jax.Array, logits: jax.Array) -> jax.Array:
    """One token per row with that row's key: keys uint32 [B, 2], logits [B, V] -> int32 [B]."""
    return jax.vmap(lambda k, l: sample_from_logits(k, l, sampling))(keys, logits)


def unroll_layers() -> bool:
    """Whether decode loops run on `decode_params` (layers unstacked and unrolled, see
    `ssd_jax.models.transformer`): on CPU, where the scan copies every layer's weights at every
    step. Elsewhere the scan stays (one layer in the program, no second copy of the weights)
    until measured there."""
    return jax.default_backend() == "cpu"


def _decode(params, tokens, lengths, keys, max_new, eos_ids, *, config, sampling, out_size, capacity, stream):
    b = tokens.shape[0]
    rows = jnp.arange(b)
    if unroll_layers():
        params = decode_params(params, config)
    logits, cache = prefill(params, config, tokens, lengths, capacity)

    def sample_step(state, logits):
        """Samples the next token of every active row from logits [B, V] and records it."""
        step_keys = jax.vmap(jax.random.fold_in)(keys, state["num_out"])
        token = sample_rows(sampling, step_keys, logits)
        active = ~state["done"]
        slot = jnp.where(active, state["num_out"], out_size)  # out of range -> dropped
        out = state["out"].at[rows, slot].set(token, mode="drop")
        num_out = state["num_out"] + active
        if stream:
            emit(token[:, None], active.astype(jnp.int32))
        is_eos = active & jnp.isin(token, eos_ids)
        cache: KVCache = state["cache"]
        full = (num_out >= max_new) | (cache.lengths + 1 > capacity)
        hit_length = active & ~is_eos & full
        finish = jnp.where(is_eos, FINISH_EOS, jnp.where(hit_length, FINISH_LENGTH, state["finish"]))
        done = state["done"] | is_eos | hit_length
        return dict(state, out=out, num_out=num_out, done=done, finish=finish, token=token)

    def cond(state):
        return ~jnp.all(state["done"])

    def body(state):
        # Entered only while some row is active, so every iteration needs this forward; no
        # lax.cond around it (a cond made XLA copy the whole cache at every step).
        cache: KVCache = state["cache"]
        logits, cache = forward_cached(params, config, state["token"][:, None], cache.lengths[:, None], cache)
        cache = commit(cache, (~state["done"]).astype(jnp.int32))
        return sample_step(dict(state, cache=cache, calls=state["calls"] + 1), logits[:, 0])

    state = dict(
        out=jnp.zeros((b, out_size), jnp.int32),
        num_out=jnp.zeros((b,), jnp.int32),
        done=jnp.zeros((b,), bool),
        finish=jnp.zeros((b,), jnp.int32),
        token=jnp.zeros((b,), jnp.int32),
        cache=cache,
        calls=jnp.ones((), jnp.int32),
    )
    state = jax.lax.while_loop(cond, body, sample_step(state, logits))
    return state["out"], state["num_out"], state["finish"], state["calls"]


def generate_ar(
    target: Model, batch: PromptBatch, max_new_tokens: int, sampling: SamplingParams, key,
    stream: StreamSink | None = None,
) -> GenerateOutput:
    """Autoregressive decoding of a prepared batch (see `ssd_jax.generate`)."""
    config = target.config
    out_size = bucket(max_new_tokens)
    capacity = batch.tokens.shape[1] + out_size
    eos = np.array(config.eos_token_ids or (-1,), np.int32)
    args = (
        target.params, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths), row_keys(key, batch.batch_size),
        jnp.asarray(max_new_tokens, jnp.int32), jnp.asarray(eos),
    )
    streaming = stream is not None
    fn = functools.partial(_decode, config=config, sampling=sampling, out_size=out_size, capacity=capacity,
                           stream=streaming)
    executable, compile_s = compiled(fn, ("ar", config, sampling, out_size, capacity, streaming), *args)
    start = time.perf_counter()
    with streaming_to(stream):
        out, num_out, finish, calls = jax.block_until_ready(executable(*args))
    wall = time.perf_counter() - start
    tokens, reasons = rows_from_buffers(np.asarray(out), np.asarray(num_out), np.asarray(finish))
    generated = int(np.sum(num_out))
    stats = dict(
        method="ar",
        batch_size=batch.batch_size,
        num_generated_tokens=generated,
        target_calls=int(calls),
        wall_time_s=wall,
        compile_time_s=compile_s,
        tokens_per_second=generated / wall if wall > 0 else float("inf"),
    )
    return GenerateOutput(tokens=tokens, finish_reasons=reasons, stats=stats)
