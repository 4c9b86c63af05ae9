"""SSD (speculative speculative decoding, Saguaro) at temperature > 0: the laws of its hit and
miss paths, one step each and two steps joined by the cache lookup, exact and sampled.

What SSD does (`ssd_jax.ssd.steps`, `ssd_jax.ssd.host_loop`, `ssd_jax.draft.saguaro`). Every
speculation of L tokens is drafted from Saguaro's reshaped draft law sigma: at draft position i
the draft's top-F_i tokens (ranked by its logits) have their probability scaled by C
(`saguaro_reshape`), and sigma is the q handed to token-wise verification. While the target
verifies speculation d, the draft prepares the next speculation for the outcomes (k, t) it
predicts: at each depth k the top-F_k tokens of its logits after d[:k], d_k excluded
(`fork_tokens`). Hit: the outcome is one of them and the cached speculation, drafted from sigma
after d[:k] + [t], is verified. Miss: the fallback drafts it just in time: "jit" with the draft
model from sigma (`fallback_model` calls the same `draft_chain`), "ngram" a point mass (prompt
lookup; q = one-hot). Both are verified token-wise against the q they were drawn from, so each
path, and the two steps joined, emit the target's law.

Tables. The draft's logits are tables.draft_logits, or log Q. One step ("ssd_hit", "ssd_miss")
needs depth n >= L; two steps ("ssd") n >= 2L + 1 (the second starts after up to L + 1 tokens).
The kit's n-gram fallback drafts the draft law's argmax chain (a deterministic continuation, as a
lookup copies one: any point mass has the same check).
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.errors import InputError
from ssd_jax.testing.device_tables import draw, emission, prefix_rows, stack_levels
from ssd_jax.testing.enumeration import (Emissions, add_stops, check_enumerable, law_of_stops, rows, rows_at,
                                         single_path_law, x64)
from ssd_jax.testing.exact_law import tokenwise_rule
from ssd_jax.testing.tables import Tables

FALLBACKS = ("jit", "ngram")


@dataclasses.dataclass(frozen=True)
class SSDSetup:
    """draft_len: L; fanout: F_0..F_L (forks per outcome depth, and Saguaro's top-F_i at draft
    position i), default `ssd_jax.draft.fanout.uniform_fanout(L, L + 1, V)`; saguaro_c: C in
    [0, 1]; fallback: "jit" or "ngram" (the miss path's drafter)."""

    draft_len: int = 1
    fanout: tuple | None = None
    saguaro_c: float = 0.5
    fallback: str = "jit"


@dataclasses.dataclass(frozen=True)
class _Plan:
    L: int
    fanout: tuple
    c: float
    fallback: str
    rmax: int
    logits: tuple


def _plan(t: Tables, setup: SSDSetup, steps: int) -> _Plan:
    from ssd_jax.draft.fanout import fanout_caps, uniform_fanout

    if not isinstance(setup, SSDSetup):
        raise InputError(f"setup must be an ssd_jax.testing.SSDSetup, got {type(setup).__name__}")
    L = setup.draft_len
    if isinstance(L, bool) or not isinstance(L, (int, np.integer)) or L < 1:
        raise InputError(f"draft_len must be an integer >= 1, got {L!r}")
    need = L if steps == 1 else 2 * L + 1
    if t.n < need:
        raise InputError(f"{'one SSD step' if steps == 1 else 'two SSD steps'} with draft_len={L} need tables of "
                         f"depth n >= {need}, got n={t.n}")
    fanout = uniform_fanout(L, L + 1, t.V) if setup.fanout is None else tuple(int(f) for f in setup.fanout)
    caps = fanout_caps(L, t.V)
    if len(fanout) != L + 1 or any(f < 0 or f > cap for f, cap in zip(fanout, caps)) or sum(fanout) < 1:
        raise InputError(f"fanout must be L+1 = {L + 1} counts F_k in [0, {caps.tolist()}] with a positive sum, "
                         f"got {setup.fanout!r}")
    c = setup.saguaro_c
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= c <= 1:
        raise InputError(f"saguaro_c must be a number in [0, 1], got {c!r}")
    if setup.fallback not in FALLBACKS:
        raise InputError(f"fallback must be one of {FALLBACKS}, got {setup.fallback!r}")
    if t.draft_logits is not None:
        logits = t.draft_logits
    else:
        with np.errstate(divide="ignore"):
            logits = tuple(np.log(q) for q in t.Q)
    return _Plan(L, fanout, float(c), setup.fallback, int(min(sum(fanout), t.V)), logits)


def _sigma(plan: _Plan, q: np.ndarray, logits: np.ndarray, position: int) -> np.ndarray:
    """Saguaro's sigma (`ssd_jax.draft.saguaro.saguaro_reshape`, float64) at draft position
    `position`: q, logits [N, V] -> [N, V]."""
    from ssd_jax.draft.saguaro import saguaro_reshape

    if q.shape[0] == 0:
        return q
    num_top, c, rmax = plan.fanout[position], plan.c, plan.rmax
    return x64(lambda qq, lg: saguaro_reshape(qq, lg, num_top, c, rmax), q, logits)


def sigma_levels(t: Tables, setup: SSDSetup) -> tuple:
    """The Q-like levels of sigma for a speculation drafted at the root: level i (i < L) is the
    law draft position i is drawn from."""
    plan = _plan(t, setup, steps=1)
    V = t.V
    out = []
    for i in range(plan.L):
        shape = (V,) * (i + 1)
        flat = _sigma(plan, t.Q[i].reshape(-1, V), plan.logits[i].reshape(-1, V), i)
        out.append(flat.reshape(shape))
    return tuple(out)


def _argmax_chain(t: Tables, seqs: np.ndarray, start: np.ndarray, L: int) -> np.ndarray:
    """The draft law's argmax chain (ties to the lowest id) after seqs[:, :start]: writes L
    tokens at start.. of a copy of seqs [N, W] and returns it."""
    seqs = seqs.copy()
    ar = np.arange(seqs.shape[0])
    for i in range(L):
        seqs[ar, start + i] = np.argmax(rows_at(t.Q, seqs, start + i), axis=-1)
    return seqs


def ssd_step_law(t: Tables, setup: SSDSetup | None = None, hit: bool = True, rule=None) -> np.ndarray:
    """Exact law of one SSD verification at the root: hit=True a cached speculation (drafted from
    sigma, verified with q = sigma); hit=False the fallback's (jit: the same; ngram: the argmax
    chain, q one-hot). rule: the verification's rule (default token-wise, the library's at T > 0)."""
    setup = SSDSetup() if setup is None else setup
    check_enumerable(t)
    plan = _plan(t, setup, steps=1)
    rule = tokenwise_rule if rule is None else rule
    if hit or plan.fallback == "jit":
        return single_path_law(t, rule, Q=sigma_levels(t, setup), L=plan.L)
    drafts = _argmax_chain(t, np.zeros((1, plan.L), np.int64), np.zeros(1, np.int64), plan.L).astype(np.int32)
    q = np.eye(t.V)[drafts]
    p = np.stack([rows(t.P, drafts, d) for d in range(plan.L + 1)], axis=1)
    stop, next_law = rule(drafts, q, p)
    return law_of_stops(t, drafts, np.ones(1), stop, next_law)


def ssd_law(t: Tables, setup: SSDSetup | None = None, miss_rule=None) -> np.ndarray:
    """Exact law of two SSD steps from the root: the first speculation drafted from sigma and
    verified; its outcome (k, t) looked up in the forks (`fork_tokens` along the draft, with the
    slot layout of `fanout`); the second speculation from the cache (hit) or the fallback (miss),
    verified. miss_rule: the miss path's verification rule (default token-wise)."""
    from ssd_jax.draft.fanout import SlotLayout
    from ssd_jax.draft.saguaro import fork_tokens

    setup = SSDSetup() if setup is None else setup
    check_enumerable(t, t.V ** (2 * setup.draft_len + 1) if isinstance(setup, SSDSetup) else None)
    plan = _plan(t, setup, steps=2)
    miss_rule = tokenwise_rule if miss_rule is None else miss_rule
    L, V = plan.L, t.V
    drafts = np.array(list(itertools.product(range(V), repeat=L)), np.int64).reshape(-1, L)
    sigma = np.stack([_sigma(plan, rows(t.Q, drafts, i), rows(plan.logits, drafts, i), i) for i in range(L)], axis=1)
    prob = np.prod(np.take_along_axis(sigma, drafts[..., None], axis=-1)[..., 0], axis=1)
    p = np.stack([rows(t.P, drafts, i) for i in range(L + 1)], axis=1)
    stop, next_law = tokenwise_rule(drafts.astype(np.int32), sigma, p)
    logits = np.stack([rows(plan.logits, drafts, i) for i in range(L + 1)], axis=1)
    layout = SlotLayout.from_fanout(plan.fanout, sum(plan.fanout))
    forks = x64(lambda lg, d: fork_tokens(lg, d, layout.depth, layout.rank, rmax=plan.rmax),
                logits, drafts.astype(np.int32))

    prefixes, lengths, weights, hits = [], [], [], []
    for k in range(L + 1):
        for y in range(V):
            w = prob * stop[:, k] * next_law[:, k, y]
            sel = np.flatnonzero(w > 0)
            z = np.zeros((sel.size, 2 * L + 1), np.int64)
            z[:, :k] = drafts[sel, :k]
            z[:, k] = y
            prefixes.append(z)
            lengths.append(np.full(sel.size, k + 1))
            weights.append(w[sel])
            hits.append(np.any((layout.depth[None, :] == k) & (forks[sel] == y), axis=1))
    z, zlen, w, hit = (np.concatenate(a) for a in (prefixes, lengths, weights, hits))

    emitted = Emissions(t)
    for branch_hit in (True, False):
        sel = hit == branch_hit
        if not sel.any():
            continue
        zb, lb, wb = z[sel], zlen[sel], w[sel]
        rule = tokenwise_rule if branch_hit else miss_rule
        if branch_hit or plan.fallback == "jit":
            second = np.array(list(itertools.product(range(V), repeat=L)), np.int64).reshape(-1, L)
            m, s = zb.shape[0], second.shape[0]
            seqs = np.repeat(zb, s, axis=0)
            start = np.repeat(lb, s)
            ar = np.arange(m * s)
            for i in range(L):
                seqs[ar, start + i] = np.tile(second[:, i], m)
            q = np.stack([_sigma(plan, rows_at(t.Q, seqs, start + i), rows_at(plan.logits, seqs, start + i), i)
                          for i in range(L)], axis=1)
            weight = np.repeat(wb, s)
        else:
            seqs, start = _argmax_chain(t, zb, lb, L), lb
            ar = np.arange(zb.shape[0])
            q = np.stack([np.eye(V)[seqs[ar, start + i]] for i in range(L)], axis=1)
            weight = wb
        ar = np.arange(seqs.shape[0])
        second_tokens = np.stack([seqs[ar, start + i] for i in range(L)], axis=1)
        weight = weight * np.prod(np.take_along_axis(q, second_tokens[..., None], axis=-1)[..., 0], axis=1)
        live = weight > 0
        seqs, start, q, second_tokens, weight = seqs[live], start[live], q[live], second_tokens[live], weight[live]
        p2 = np.stack([rows_at(t.P, seqs, start + i) for i in range(L + 1)], axis=1)
        stop2, next2 = rule(second_tokens.astype(np.int32), q, p2)
        add_stops(emitted, seqs, weight, stop2, next2, before=start)
    return emitted.law()


# ------------------------------------------------------------------------------------- sampled


def ssd_sampler(t: Tables, setup: SSDSetup | None = None, steps: int = 2, hit: bool = True, miss_verifier=None):
    """(arrays, step) for the sampled-law harness. steps=2: two SSD steps as `ssd_law`; steps=1:
    one verification at the root, of a cached speculation (hit=True) or the fallback's. The
    speculations are drawn from the library's sigma (`saguaro_reshape`) by a categorical draw
    (the law of the library's `sample_blocked`), forks come from `fork_tokens`, and verification
    is the library's jitted verifier at T > 0 (`ssd_jax.ssd.steps.verifier_for`); miss_verifier
    replaces it on the miss path."""
    from ssd_jax.draft.fanout import SlotLayout
    from ssd_jax.draft.saguaro import fork_tokens, saguaro_reshape
    from ssd_jax.sampling import SamplingParams
    from ssd_jax.ssd.steps import verifier_for

    setup = SSDSetup() if setup is None else setup
    plan = _plan(t, setup, steps=steps)
    verifier = verifier_for(SamplingParams(temperature=1.0))
    miss_verifier = verifier if miss_verifier is None else miss_verifier
    L, V, n = plan.L, t.V, t.n
    width = 2 * L + 1
    layout = SlotLayout.from_fanout(plan.fanout, sum(plan.fanout))
    arrays = {"Q": stack_levels(t.Q), "logits": stack_levels(plan.logits), "P": stack_levels(t.P)}

    def gather(table, text, depth):
        prefixes = prefix_rows(text, V)
        return table[jnp.take_along_axis(prefixes, depth[:, None], axis=1)[:, 0]]

    def sigma_chain(key, arrays, text, start):
        """L tokens drawn from sigma after text[:, :start]: (text with them, tokens [B, L], q [B, L, V])."""
        rows_ = text.shape[0]
        ar = jnp.arange(rows_)
        tokens, qs = [], []
        for i, k in enumerate(jax.random.split(key, L)):
            q = gather(arrays["Q"], text, start + i)
            logits = gather(arrays["logits"], text, start + i)
            s = saguaro_reshape(q, logits, plan.fanout[i], plan.c, plan.rmax)
            tok = draw(k, s)
            text = text.at[ar, start + i].set(tok)
            tokens.append(tok)
            qs.append(s)
        return text, jnp.stack(tokens, axis=1), jnp.stack(qs, axis=1)

    def argmax_chain(arrays, text, start):
        ar = jnp.arange(text.shape[0])
        tokens = []
        for i in range(L):
            tok = jnp.argmax(gather(arrays["Q"], text, start + i), axis=-1).astype(jnp.int32)
            text = text.at[ar, start + i].set(tok)
            tokens.append(tok)
        tokens = jnp.stack(tokens, axis=1)
        return text, tokens, jax.nn.one_hot(tokens, V, dtype=jnp.float32)

    def target_rows(arrays, text, start):
        return jnp.stack([gather(arrays["P"], text, start + i) for i in range(L + 1)], axis=1)

    def fallback(key, arrays, text, start):
        if plan.fallback == "jit":
            return sigma_chain(key, arrays, text, start)
        return argmax_chain(arrays, text, start)

    def step(key, arrays, rows_):
        keys = jax.random.split(key, 5)
        text = jnp.zeros((rows_, width), jnp.int32)
        root = jnp.zeros((rows_,), jnp.int32)
        if steps == 1:
            draft = sigma_chain if hit else fallback
            text, tokens, q = draft(keys[0], arrays, text, root)
            result = (verifier if hit else miss_verifier)(keys[1], tokens, q, target_rows(arrays, text, root))
            return emission(tokens, result.num_accepted, result.next_token, n + 1)
        text, tokens, q = sigma_chain(keys[0], arrays, text, root)
        first = verifier(keys[1], tokens, q, target_rows(arrays, text, root))
        k, y = first.num_accepted, first.next_token
        logits = jnp.stack([gather(arrays["logits"], text, root + i) for i in range(L + 1)], axis=1)
        forks = fork_tokens(logits, tokens, jnp.asarray(layout.depth), jnp.asarray(layout.rank), rmax=plan.rmax)
        is_hit = jnp.any((jnp.asarray(layout.depth)[None, :] == k[:, None]) & (forks == y[:, None]), axis=1)
        j = jnp.arange(width)[None, :]
        text = jnp.where(j < k[:, None], text, jnp.where(j == k[:, None], y[:, None], 0)).astype(jnp.int32)
        start = k + 1
        hit_text, hit_tokens, hit_q = sigma_chain(keys[2], arrays, text, start)
        miss_text, miss_tokens, miss_q = fallback(keys[3], arrays, text, start)
        text = jnp.where(is_hit[:, None], hit_text, miss_text)
        tokens = jnp.where(is_hit[:, None], hit_tokens, miss_tokens)
        q = jnp.where(is_hit[:, None, None], hit_q, miss_q)
        p = target_rows(arrays, text, start)
        hit_result = verifier(keys[4], tokens, q, p)
        miss_result = miss_verifier(keys[4], tokens, q, p)
        kept = jnp.where(is_hit, hit_result.num_accepted, miss_result.num_accepted)
        nxt = jnp.where(is_hit, hit_result.next_token, miss_result.next_token)
        return emission(text, start + kept, nxt, n + 1)

    return arrays, step
