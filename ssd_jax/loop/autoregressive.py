"""Autoregressive decoding's parts for the decode skeleton (`ssd_jax.loop.skeleton`): one token
per target call. The reference every speculative method must reproduce. Also the layer-unrolling
decision and, inside a traced decode, the decode-layout weights every loop runs on (`in_loop_params`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ssd_jax.backend import policy_for
from ssd_jax.loop.skeleton import DecodeState, Verdict, draw_rows, prefill, sample_rows  # noqa: F401  (re-exported)
from ssd_jax.model import Model
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import commit
from ssd_jax.models.transformer import decode_params, forward_cached
from ssd_jax.sampling import SamplingParams, probabilities


def unroll_layers(model=None) -> bool:
    """Whether decode loops on `model` (a Model or its params; None: the default device) run on
    `decode_params` (layers unstacked and unrolled, see `ssd_jax.models.transformer`): the
    backend policy's choice for the platform it lives on. The one place this is decided."""
    return policy_for(model).unroll_layers


def in_loop_params(model: Model) -> dict:
    """Inside a traced decode: the params its loop runs on (`decode_params` with `unroll_layers`,
    unfused for a sharded model; a no-op on params already in that layout, e.g. from `loop_params`)."""
    if not unroll_layers(model.params):
        return model.params
    return decode_params(model.params, model.config, fuse=fusable(model))


def fusable(model: Model) -> bool:
    """Fused q/k/v and gate/up kernels suit a model whose heads and MLP are not split over devices."""
    return model.placement is None or not model.placement.tensor_parallel


@dataclasses.dataclass(frozen=True)
class ARParts:
    """Autoregressive step: the target runs on cur, commits it and samples the next token."""

    tparams: dict
    tcfg: ModelConfig
    sampling: SamplingParams
    capacity: int
    room: int = 1
    counter_width: int = 0
    chain_writes: bool = True
    pending_width: int = 0   # never run under the adaptive loop

    def init(self, tokens, lengths, first, logits):
        return ()

    def step(self, state: DecodeState, keys: jax.Array, active: jax.Array, with_law: bool = False) -> Verdict:
        """with_law: the verdict carries the target's probability of the token it drew
        (`Verdict.token_law`: 1 at T=0), for adaptive speculation's draft scoring."""
        logits, verdict = self.logits_and_step(state, keys, active)
        if not with_law:
            return verdict
        law = jnp.ones(verdict.next_token.shape, jnp.float32)
        if not self.sampling.by_argmax:
            law = jnp.take_along_axis(probabilities(logits, self.sampling), verdict.next_token[:, None], axis=1)[:, 0]
        return verdict.replace(token_law=law)

    def logits_and_step(self, state: DecodeState, keys: jax.Array, active: jax.Array,
                        feature_layers: tuple[int, ...] = ()) -> tuple:
        """`step`, also returning the target's logits float32 [B, V] the next token was drawn from:
        (logits, verdict), and with feature_layers (a feature-level head's plain steps) the target's
        features at cur [B, 1, K, D] after those layers (`forward_cached`) as a third."""
        # Entered only while some row is active, so every iteration needs this forward; no
        # lax.cond around it (a cond made XLA copy the whole cache at every step).
        cache = state.tcache
        logits, cache, *features = forward_cached(self.tparams, self.tcfg, state.cur[:, None], cache.lengths[:, None],
                                                  cache, feature_layers=feature_layers)
        token = draw_rows(self.sampling, keys, logits[:, 0], cache.lengths + 1)
        cache = commit(cache, active.astype(jnp.int32))
        b = token.shape[0]
        return (logits[:, 0], Verdict(tcache=cache, inner=(), chosen=jnp.zeros((b, 0), jnp.int32),
                                      accepted=jnp.zeros((b,), jnp.int32), next_token=token), *features)


def ar_parts(tparams: dict, tcfg: ModelConfig, sampling: SamplingParams, prompt_width: int, out_size: int) -> ARParts:
    return ARParts(tparams=tparams, tcfg=tcfg, sampling=sampling, capacity=prompt_width + out_size)
