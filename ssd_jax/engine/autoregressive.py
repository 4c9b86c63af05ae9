"""Autoregressive decoding: prefill, then one token per target call, the whole loop one
`lax.while_loop` on the device. The reference every speculative method must reproduce."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.backend import policy_for
from ssd_jax.engine.compiled import compiled
from ssd_jax.engine.emission import Outputs, append, stop_rows
from ssd_jax.engine.output import GenerateOutput, rows_from_buffers
from ssd_jax.engine.params_cache import ParamsCache
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
    policy = policy_for(params)
    fused = policy.prefill_attention != "reference" and t >= policy.fused_prefill_min_tokens
    logits, cache = forward_cached(params, config, tokens, positions, cache, logit_indices=(lengths - 1)[:, None],
                                   prefill_attention=policy.prefill_attention if fused else "reference")
    return logits[:, 0], cache.replace(lengths=lengths)


def sample_rows(sampling: SamplingParams, keys: jax.Array, logits: jax.Array) -> jax.Array:
    """One token per row with that row's key: keys uint32 [B, 2], logits [B, V] -> int32 [B]."""
    return jax.vmap(lambda k, l: sample_from_logits(k, l, sampling))(keys, logits)


def unroll_layers(model: Model | None = None) -> bool:
    """Whether decode loops on `model` run on `decode_params` (layers unstacked and unrolled, see
    `ssd_jax.models.transformer`): the backend policy's choice for the platform it lives on."""
    return policy_for(model).unroll_layers


_LOOP_PARAMS_KEPT = 4
_LOOP_PARAMS = ParamsCache(_LOOP_PARAMS_KEPT)


def loop_params(model: Model) -> dict:
    """The params a decode loop takes: with `unroll_layers`, `decode_params` of model.params,
    made once per params object and kept for the next call (the last few models); otherwise
    model.params. A call then no longer re-slices and re-fuses every weight (about 3 ms per call
    for the embedded 11M target on CPU)."""
    if not unroll_layers(model):
        return model.params
    make = lambda: jax.jit(decode_params, static_argnums=1)(model.params, model.config)  # noqa: E731
    return _LOOP_PARAMS.get(model.params, None, make)[0]


def _decode(params, tokens, lengths, keys, max_new, eos_ids, *, config, sampling, out_size, capacity, stream):
    b = tokens.shape[0]
    logits, cache = prefill(params, config, tokens, lengths, capacity)

    def sample_step(state, logits):
        """Samples the next token of every active row from logits [B, V] and records it."""
        outputs: Outputs = state["outputs"]
        step_keys = jax.vmap(jax.random.fold_in)(keys, outputs.num_out)
        token = sample_rows(sampling, step_keys, logits)
        outputs, appended = append(outputs, token[:, None], jnp.ones((b,), jnp.int32), max_new, eos_ids)
        if stream:
            emit(token[:, None], appended)
        # A row whose cache has no slot for this token's forward ends with reason "length".
        outputs = stop_rows(outputs, state["cache"].lengths + 1 > capacity)
        return dict(state, outputs=outputs, token=token)

    def cond(state):
        return ~jnp.all(state["outputs"].done)

    def body(state):
        # Entered only while some row is active, so every iteration needs this forward; no
        # lax.cond around it (a cond made XLA copy the whole cache at every step).
        cache: KVCache = state["cache"]
        logits, cache = forward_cached(params, config, state["token"][:, None], cache.lengths[:, None], cache)
        cache = commit(cache, (~state["outputs"].done).astype(jnp.int32))
        return sample_step(dict(state, cache=cache, calls=state["calls"] + 1), logits[:, 0])

    state = dict(outputs=Outputs.empty(b, out_size), token=jnp.zeros((b,), jnp.int32), cache=cache,
                 calls=jnp.ones((), jnp.int32))
    state = jax.lax.while_loop(cond, body, sample_step(state, logits))
    outputs = state["outputs"]
    return outputs.out, outputs.num_out, outputs.finish, state["calls"]


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
        loop_params(target), jnp.asarray(batch.tokens), jnp.asarray(batch.lengths), row_keys(key, batch.batch_size),
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
