"""Negative controls: planted bugs that the kit must reject, both by the exact check
(`ssd_jax.testing.assert_exact`) and by the sampled check (`ssd_jax.testing.assert_sampled`).

Each control is a verifier with a library verifier's signature (or a factory of one) plus its
exact law, computed the way the kit computes the real verifiers' laws. `CONTROLS` maps a name to
a `Control`, whose `exact_law(tables, K=None, **options)` and `sampled_counts(tables, K=None,
*, n_keys, rows, seed, **options)` mirror `exact_law` and `sampled_counts`.

- greedy_on_ssd_miss: SSD at temperature > 0 whose miss path accepts the sampled fallback
  speculation greedily (keep a token iff it is the target's argmax, emit the argmax): two SSD steps
  (`ssd_jax.testing.ssd`), the cache hits verified token-wise, the misses by `greedy_on_miss`.
- raw_logits_q: the draft samples from its processed law (temperature, top-k, top-p by
  `ssd_jax.sampling.probabilities`) but the verifier is handed softmax(raw logits)
  (`raw_logits_verifier(tables)`; tables from `processed_tables`).
- topk_tree_without_residual: a tree with K distinct children per node, drawn without
  replacement from q (Gumbel top-K), each child accepted with min(1, p/q) in turn with p never
  updated to the residual; all rejected: Y ~ norm((p - q)_+) (`topk_without_residual`).
- unnormalised_residual: token-wise verification that draws the correction by inverse CDF from
  (p - q)_+ without dividing by its mass r = sum (p - q)_+: u ~ U[0, 1) is compared with the
  cumulative sums of the unnormalised residual and an index past the end is clipped to the last
  token, so a correction is x with probability (p - q)_+(x) and the last token collects the
  missing 1 - r (`unnormalised_residual`). (Gumbel-max or `jax.random.categorical` over log
  weights normalise implicitly, which is why the bug lives in an inverse-CDF sampler.)
- argmax_acceptance: keep X_i while it equals argmax p, then sample the next token from p.
- gbv_unskewed: GBV that verifies the selected path with the draft law q instead of the skewed q~.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax import verify
from ssd_jax.errors import InputError
from ssd_jax.testing.device_tables import emission, prefix_rows, stack_levels
from ssd_jax.testing.enumeration import (check_enumerable, check_paths, law_of_stops, multi_path_inputs, rows,
                                         single_path_law, tokenwise_stop_prob, walk_law, x64)
from ssd_jax.testing.exact_law import block_rule, greedy_rule, tokenwise_rule
from ssd_jax.testing.sampled_law import Sample, iid_sampler, run_sampler
from ssd_jax.testing.tables import Tables
from ssd_jax.verify._common import accept_prob, leading_true_count, positive_part
from ssd_jax.verify.result import VerifyResult


# ------------------------------------------------------------------------------- the verifiers


def greedy_on_miss(key, draft_tokens, q, p) -> VerifyResult:
    """The miss path's verifier in the planted SSD bug: greedy acceptance (`verify.greedy`) of a
    speculation that was sampled."""
    return verify.greedy(key, draft_tokens, q, p)


def raw_logits_verifier(tables: Tables) -> Callable:
    """A single-path verifier that ignores the q it is given and verifies token-wise against
    softmax(raw draft logits) after the drafted prefix (tables.draft_logits): the draft's
    processing forgotten on the verifier's side."""
    raw = _softmax_levels(tables)
    stacked = jnp.asarray(stack_levels(raw))
    V = tables.V

    def verifier(key, draft_tokens, q, p) -> VerifyResult:
        del q
        seen = stacked[prefix_rows(draft_tokens, V)[:, :-1]]
        return verify.tokenwise(key, draft_tokens, seen, p)

    return verifier


def no_residual_node(p, q, candidates, alive, *, unrolled: bool = False):
    """A node rule (contract of `verify.specinfer_node`) over distinct children: the first alive
    occurrence of each token is accepted with min(1, p(x)/q(x)), p never updated; the residual
    when all are rejected is norm((p - q)_+)."""
    del unrolled
    k = candidates.shape[0]
    earlier = jnp.tril(jnp.ones((k, k), bool), -1)
    repeat = jnp.any(earlier & alive[None, :] & (candidates[None, :] == candidates[:, None]), axis=1)
    first = alive & ~repeat
    accept = jnp.where(first, accept_prob(p[candidates], q[candidates]), 0)
    residual = positive_part(p - q)
    return accept, jnp.where(jnp.sum(residual) > 0, residual, p)


@jax.jit
def topk_without_residual(key, paths, q, p) -> VerifyResult:
    """The library's tree walk (`ssd_jax.verify._tree_walk.walk`) with `no_residual_node`:
    paths int [B, P, L] of a top-K tree (every root-to-leaf path, children in rank order)."""
    from ssd_jax.verify._tree_walk import walk

    return walk(no_residual_node, key, paths.astype(jnp.int32), q, p)


@jax.jit
def unnormalised_residual(key, draft_tokens, q, p) -> VerifyResult:
    """Token-wise verification whose correction is drawn from (p - q)_+ by inverse CDF without
    normalising (module docstring)."""
    accept, residual = verify.tokenwise_tables(draft_tokens, q, p)
    k_accept, k_token = jax.random.split(key)
    b, length = draft_tokens.shape
    u = jax.random.uniform(k_accept, (b, length), dtype=p.dtype)
    kept = leading_true_count(u < accept)
    weights = residual[jnp.arange(b), kept]
    v = jax.random.uniform(k_token, (b,), dtype=p.dtype)
    nxt = jnp.minimum(jnp.sum(jnp.cumsum(weights, axis=-1) <= v[:, None], axis=-1), p.shape[-1] - 1)
    return VerifyResult(kept, nxt.astype(jnp.int32), jnp.zeros_like(kept))


@jax.jit
def argmax_acceptance(key, draft_tokens, q, p) -> VerifyResult:
    """Argmax acceptance at temperature > 0: keep X_i while it equals argmax p_{i-1}, then draw
    the next token from p."""
    del q
    top = jnp.argmax(p, axis=-1)
    match = draft_tokens == top[:, :-1]
    kept = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    p_kept = jnp.take_along_axis(p, kept[:, None, None], axis=1)[:, 0]
    logits = jnp.where(p_kept > 0, jnp.log(jnp.where(p_kept > 0, p_kept, 1)), -jnp.inf)
    return VerifyResult(kept, jax.random.categorical(key, logits).astype(jnp.int32), jnp.zeros_like(kept))


def gbv_unskewed(key, paths, q, p) -> VerifyResult:
    """GBV verifying the selected path X* with the draft law q instead of the skewed q~."""
    k_star, x_star, _, p_star = verify.skewed_draft(paths, q, p)
    q_star = jnp.take_along_axis(q, k_star[:, None, None, None], axis=1)[:, 0]
    result = verify.block(key, x_star, q_star, p_star)
    return VerifyResult(result.num_accepted, result.next_token, k_star)


# ------------------------------------------------------------------------------- exact laws


def _softmax_levels(tables: Tables) -> tuple:
    if tables.draft_logits is None:
        raise InputError("raw_logits_q needs tables with draft_logits (see ssd_jax.testing.processed_tables)")
    out = []
    for logits in tables.draft_logits:
        z = np.exp(logits - logits.max(axis=-1, keepdims=True))
        out.append(z / z.sum(axis=-1, keepdims=True))
    return tuple(out)


def unnormalised_rule(drafts, q, p):
    accept, residual = x64(verify.tokenwise_tables, drafts, q, p)
    n_draft = drafts.shape[1]
    missing = 1 - residual.sum(-1)
    next_law = residual.copy()
    next_law[:, :n_draft, -1] += missing[:, :n_draft]
    return tokenwise_stop_prob(accept), next_law


def argmax_rule(drafts, q, p):
    accept = (drafts == np.argmax(p[:, :-1], axis=-1)).astype(np.float64)
    return tokenwise_stop_prob(accept), p


def gbv_unskewed_law(t: Tables, K: int) -> np.ndarray:
    paths, prob, q, p = multi_path_inputs(t, K)
    k_star, x_star, _, p_star = x64(verify.skewed_draft, paths, q, p)
    stop, next_law = block_rule(x_star, q[np.arange(len(k_star)), k_star], p_star)
    return law_of_stops(t, x_star, prob, stop, next_law)


def _check_topk(t: Tables, K: int) -> int:
    K = check_paths(K)
    if K > t.V:
        raise InputError(f"a top-K tree needs K <= V={t.V} distinct children, got K={K}")
    for d, level in enumerate(t.Q):
        support = (level > 0).sum(-1)
        if support.min() < K:
            prefix = tuple(int(i) for i in np.argwhere(support < K)[0])
            raise InputError(f"Q[{d}] after prefix {prefix} has {int(support.min())} tokens of positive mass: "
                             f"K={K} distinct children cannot be drawn without replacement")
    return K


def topk_tree_inputs(t: Tables, K: int):
    """Every top-K tree of depth L = n (K distinct children per node, drawn without replacement
    from q: an ordered K-tuple x has probability prod_j q(x_j) / (1 - sum_{i<j} q(x_i))), as
    paths [N, K^L, L] (path r's child ranks are r's base-K digits), with prob [N], q, p."""
    K = _check_topk(t, K)
    V, L = t.V, t.n
    tuples = np.array(list(itertools.permutations(range(V), K)), np.int64)        # [T, K]
    internal = sum(K ** d for d in range(L))
    check_enumerable(t, tuples.shape[0] ** internal * K ** L, "top-K tree paths")
    levels = []                                    # levels[d]: tokens of the K^(d+1) nodes at depth d + 1
    prob = np.ones(1)
    for d in range(L):
        front = K ** d
        if d == 0:
            prefixes = np.zeros((1, 1, 0), np.int64)
        else:
            prefixes = np.stack([np.repeat(levels[j], K ** (d - 1 - j), axis=1) for j in range(d)], axis=-1)
        n_trees = prob.shape[0]
        q_front = rows(t.Q, prefixes.reshape(-1, d) if d else np.zeros((n_trees * front, 0), np.int64), d)
        q_front = q_front.reshape(n_trees, front, V)
        combos = np.array(list(itertools.product(range(tuples.shape[0]), repeat=front)), np.int64)  # [C, front]
        chosen = tuples[combos]                                                      # [C, front, K]
        picked = np.take_along_axis(q_front[:, None], chosen[None], axis=-1)         # [N, C, front, K]
        before = np.cumsum(picked, axis=-1) - picked
        tuple_prob = np.prod(picked / (1 - before), axis=-1)                         # [N, C, front]
        prob = (prob[:, None] * np.prod(tuple_prob, axis=-1)).reshape(-1)
        levels = [np.repeat(level, combos.shape[0], axis=0) for level in levels]
        levels.append(np.tile(chosen.reshape(combos.shape[0], front * K), (n_trees, 1)))
    n_paths = K ** L
    paths = np.stack([levels[d][:, np.arange(n_paths) // K ** (L - 1 - d)] for d in range(L)], axis=-1)
    flat = paths.reshape(-1, L)
    q = np.stack([rows(t.Q, flat, d) for d in range(L)], axis=1).reshape(prob.shape[0], n_paths, L, V)
    p = np.stack([rows(t.P, flat, d) for d in range(L + 1)], axis=1).reshape(prob.shape[0], n_paths, L + 1, V)
    return paths.astype(np.int32), prob, q, p


def topk_tree_law(t: Tables, K: int) -> np.ndarray:
    paths, prob, q, p = topk_tree_inputs(t, K)
    return walk_law(t, paths, prob, q, p, no_residual_node)


def topk_tree_sampler(t: Tables, K: int, verifier: Callable = topk_without_residual):
    """(arrays, step) drafting a top-K tree by Gumbel top-K at every node and verifying its
    paths [B, K^L, L] with `verifier` (a multi-path signature)."""
    K = _check_topk(t, K)
    V, L = t.V, t.n
    arrays = {"P": [stack_levels([level]) for level in t.P], "Q": [stack_levels([level]) for level in t.Q]}

    def step(key, arrays, rows_):
        k_draft, k_verify = jax.random.split(key)
        keys = jax.random.split(k_draft, L)
        idx = jnp.zeros((rows_, 1), jnp.int32)
        node_idx, tokens = [idx], []
        for d in range(L):
            q_d = arrays["Q"][d][idx]                                              # [B, K^d, V]
            logq = jnp.where(q_d > 0, jnp.log(jnp.where(q_d > 0, q_d, 1)), -jnp.inf)
            children = jax.lax.top_k(logq + jax.random.gumbel(keys[d], q_d.shape), K)[1].astype(jnp.int32)
            tokens.append(children.reshape(rows_, -1))
            idx = (idx[..., None] * V + children).reshape(rows_, -1)
            node_idx.append(idx)
        n_paths = K ** L
        r = np.arange(n_paths)
        paths = jnp.stack([tokens[d][:, r // K ** (L - 1 - d)] for d in range(L)], axis=-1)
        q = jnp.stack([arrays["Q"][d][node_idx[d][:, r // K ** (L - d)]] for d in range(L)], axis=2)
        p = jnp.stack([arrays["P"][d][node_idx[d][:, r // K ** (L - d)]] for d in range(L + 1)], axis=2)
        result = verifier(k_verify, paths, q, p)
        chosen = jnp.take_along_axis(paths, result.path_index[:, None, None], axis=1)[:, 0]
        return emission(chosen, result.num_accepted, result.next_token, L + 1)

    return arrays, step


# ------------------------------------------------------------------------------- the registry


def _no_k(name, K):
    if K is not None:
        raise InputError(f"{name} verifies one draft; K must be None, got {K!r}")


def _ssd_setup(options):
    from ssd_jax.testing.ssd import SSDSetup

    unknown = sorted(set(options) - {"setup"})
    if unknown:
        raise InputError(f"greedy_on_ssd_miss takes the option setup, got {unknown}")
    return options.get("setup") or SSDSetup()


def _ssd_law(t, K, **options):
    from ssd_jax.testing.ssd import ssd_law

    _no_k("greedy_on_ssd_miss", K)
    return ssd_law(t, _ssd_setup(options), miss_rule=greedy_rule)


def _ssd_sampler(t, K, **options):
    from ssd_jax.testing.ssd import ssd_sampler

    _no_k("greedy_on_ssd_miss", K)
    return ssd_sampler(t, _ssd_setup(options), steps=2, miss_verifier=greedy_on_miss)


def _single(name, rule, verifier_for, q_seen=None):
    """(law, sampler) of a single-path control: its rule, a factory of its verifier from the
    tables, and optionally the q it is handed as a function of the tables."""

    def law(t, K, **options):
        _no_k(name, K)
        if options:
            raise InputError(f"{name} takes no options, got {sorted(options)}")
        check_enumerable(t)
        return single_path_law(t, rule, q_seen=None if q_seen is None else q_seen(t))

    def sampler(t, K, **options):
        _no_k(name, K)
        if options:
            raise InputError(f"{name} takes no options, got {sorted(options)}")
        return iid_sampler(t, verifier_for(t))

    return law, sampler


def _gbv_law(t, K, **options):
    if options:
        raise InputError(f"gbv_unskewed takes no options, got {sorted(options)}")
    check_enumerable(t)
    return gbv_unskewed_law(t, check_paths(K))


def _gbv_sampler(t, K, **options):
    if options:
        raise InputError(f"gbv_unskewed takes no options, got {sorted(options)}")
    return iid_sampler(t, gbv_unskewed, check_paths(K))


def _topk_law(t, K, **options):
    if options:
        raise InputError(f"topk_tree_without_residual takes no options, got {sorted(options)}")
    check_enumerable(t)
    return topk_tree_law(t, K)


def _topk_sampler(t, K, **options):
    if options:
        raise InputError(f"topk_tree_without_residual takes no options, got {sorted(options)}")
    return topk_tree_sampler(t, K)


@dataclasses.dataclass(frozen=True)
class Control:
    """A planted bug: name; bug (one line); needs_K: whether it drafts K paths or children;
    law(tables, K, **options) -> exact law; sampler(tables, K, **options) -> (arrays, step)."""

    name: str
    bug: str
    needs_K: bool
    law: Callable
    sampler: Callable

    def exact_law(self, tables: Tables, K: int | None = None, **options) -> np.ndarray:
        """Its exact law over tables, float64 (V,)*(n+1)."""
        if not isinstance(tables, Tables):
            raise InputError(f"tables must be ssd_jax.testing.Tables, got {type(tables).__name__}")
        return self.law(tables, K, **options)

    def sampled_counts(self, tables: Tables, K: int | None = None, *, n_keys: int = 50, rows: int = 4000,
                       seed: int = 0, **options) -> Sample:
        """Counts of its extended emissions over n_keys * rows steps (`sampled_counts`)."""
        if not isinstance(tables, Tables):
            raise InputError(f"tables must be ssd_jax.testing.Tables, got {type(tables).__name__}")
        return run_sampler(tables, self.sampler(tables, K, **options), n_keys, rows, seed)


CONTROLS = {
    "greedy_on_ssd_miss": Control(
        "greedy_on_ssd_miss", "SSD at T > 0 verifies a cache miss's sampled speculation greedily", False,
        _ssd_law, _ssd_sampler),
    "raw_logits_q": Control(
        "raw_logits_q", "the verifier gets softmax(raw logits), not the processed q the draft sampled from", False,
        *_single("raw_logits_q", tokenwise_rule, raw_logits_verifier, q_seen=_softmax_levels)),
    "topk_tree_without_residual": Control(
        "topk_tree_without_residual", "min(1, p/q) per child of a top-K tree, p never updated to the residual",
        True, _topk_law, _topk_sampler),
    "unnormalised_residual": Control(
        "unnormalised_residual", "the correction drawn from (p - q)_+ by inverse CDF without normalising", False,
        *_single("unnormalised_residual", unnormalised_rule, lambda t: unnormalised_residual)),
    "argmax_acceptance": Control(
        "argmax_acceptance", "argmax acceptance at T > 0", False,
        *_single("argmax_acceptance", argmax_rule, lambda t: argmax_acceptance)),
    "gbv_unskewed": Control(
        "gbv_unskewed", "GBV verifies the selected path with q instead of the skewed q~", True,
        _gbv_law, _gbv_sampler),
}

PLANTED = ("greedy_on_ssd_miss", "raw_logits_q", "topk_tree_without_residual", "unnormalised_residual")
