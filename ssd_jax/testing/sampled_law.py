"""The sampled-law check: run a real jitted verifier on many independent speculative steps and
test the counts of the emitted sequences against an exact law.

Harness (`sampled_counts`). One jit, vmapped over n_keys keys, each key running `rows` steps
at once (N = n_keys * rows steps, float32 as in decoding): draft from the tables (one path, K
i.i.d. paths, a point-mass tree, a cascade, SSD's two steps), verify, extend the emission to n+1
tokens with target samples, and count each of the V^(n+1) outcomes. Keys are fixed by `seed`, so
a run is reproducible.

Test (`g_test`). The likelihood-ratio statistic S = N KL(empirical || law) = G / 2 over the k
outcomes of positive probability. Agrawal (2020, "Finite-sample concentration of the multinomial
in relative entropy") bounds the moment generating function of N KL by that of a
Gamma(k - 1, 1) variable for every N and law, so for t > k - 1

    P(S >= t) <= exp(-t) (e t / (k - 1))^(k - 1)

with no asymptotic approximation and no cell merging. The check fails when S reaches the t* at
which that bound equals alpha (default 1e-6), or when an outcome of probability zero occurs: a
correct verifier fails a check with probability at most alpha. t* is about 1.8 times the
asymptotic chi-square quantile (k = 81: t* = 137, against 78 for chi2(80)/2 at 1e-6), the price
of a bound that holds at every N. Power (`power`): an alternative law a is rejected with
probability about Phi((N KL(a || law) + (k - 1)/2 - t*) / sqrt(N Var_a[log(a / law)])), which
is above 1 - 1e-9 for every planted bug of `ssd_jax.testing.controls` at N = 200,000.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.errors import InputError
from ssd_jax.testing.device_tables import draw, emission, stack_levels
from ssd_jax.testing.tables import Tables, target_law

DEFAULT_ALPHA = 1e-6
MAX_OUTCOMES = 1 << 20


class Sample(NamedTuple):
    """counts int64 [V^(n+1)]: how often each extended sequence (flat index, base V) occurred;
    mean_emitted: mean number of tokens a step emitted before the extension."""

    counts: np.ndarray
    mean_emitted: float


class GTest(NamedTuple):
    """passed; statistic S = N KL(empirical || law); threshold t*; cells k (outcomes of positive
    probability); n draws; p_bound: the bound on P(S >= statistic) under the law (1 when
    statistic <= k - 1); impossible: draws on outcomes of probability zero."""

    passed: bool
    statistic: float
    threshold: float
    cells: int
    n: int
    p_bound: float
    impossible: int


def _bound_log(t: float, m: int) -> float:
    """log of exp(-t) (e t / m)^m, the tail bound of S at t > m (m = k - 1 >= 1)."""
    return -t + m * (1 + math.log(t / m))


def g_threshold(cells: int, alpha: float = DEFAULT_ALPHA) -> float:
    """t* for k = cells outcomes: the t > k - 1 with exp(-t) (e t / (k - 1))^(k - 1) = alpha
    (inf for one cell, where S is always 0)."""
    if not 0 < alpha < 1:
        raise InputError(f"alpha must be in (0, 1), got {alpha!r}")
    m = cells - 1
    if m < 1:
        return math.inf
    target = math.log(alpha)
    lo, hi = float(m), float(m) + 1.0
    while _bound_log(hi, m) > target:
        hi = m + 2 * (hi - m)
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _bound_log(mid, m) > target else (lo, mid)
    return hi


def g_test(counts, law, alpha: float = DEFAULT_ALPHA) -> GTest:
    """Tests counts of outcomes against an exact law (module docstring): fails with probability
    at most alpha when the counts are N independent draws from law."""
    counts = np.asarray(counts, np.float64).ravel()
    law = np.asarray(law, np.float64).ravel()
    if counts.shape != law.shape:
        raise InputError(f"counts have {counts.size} outcomes and the law {law.size}")
    if (counts < 0).any() or (law < 0).any() or abs(law.sum() - 1) > 1e-6:
        raise InputError(f"counts must be >= 0 and law a distribution (sums to {law.sum()!r})")
    n = counts.sum()
    support = law > 0
    cells = int(support.sum())
    impossible = int(counts[~support].sum())
    threshold = g_threshold(cells, alpha)
    seen = (counts > 0) & support
    statistic = float(np.sum(counts[seen] * np.log(counts[seen] / (n * law[seen])))) if n else 0.0
    m = cells - 1
    p_bound = math.exp(min(0.0, _bound_log(statistic, m))) if m >= 1 and statistic > m else 1.0
    passed = impossible == 0 and statistic < threshold
    return GTest(bool(passed), statistic, threshold, cells, int(n), 0.0 if impossible else p_bound, impossible)


def assert_sampled(counts, reference, alpha: float = DEFAULT_ALPHA) -> GTest:
    """Raises AssertionError unless `g_test(counts, law, alpha)` passes; reference: the law, or
    Tables (their target's law). Returns the GTest."""
    law = target_law(reference) if isinstance(reference, Tables) else reference
    result = g_test(counts, law, alpha)
    if not result.passed:
        raise AssertionError(
            f"the sampled law differs from the reference: N KL = {result.statistic:.1f} >= t* = {result.threshold:.1f} "
            f"over {result.cells} outcomes (N = {result.n}, bound on its probability {result.p_bound:.2e}), "
            f"{result.impossible} draws of impossible outcomes")
    return result


def power(alternative, law, n: int, alpha: float = DEFAULT_ALPHA) -> float:
    """Approximate probability that `g_test` rejects N = n draws from `alternative` tested
    against `law` (module docstring); exact for the part of the alternative's mass on outcomes
    the law never emits."""
    a = np.asarray(alternative, np.float64).ravel()
    law = np.asarray(law, np.float64).ravel()
    support = law > 0
    threshold = g_threshold(int(support.sum()), alpha)
    outside = float(a[~support].sum())
    hit_outside = 1 - (1 - outside) ** n
    a_in = a[support] / max(1e-300, a[support].sum())
    pos = a_in > 0
    log_ratio = np.log(a_in[pos] / law[support][pos])
    kl = float(np.sum(a_in[pos] * log_ratio))
    var = float(np.sum(a_in[pos] * log_ratio ** 2) - kl ** 2)
    mean = n * kl + (int(pos.sum()) - 1) / 2
    sd = math.sqrt(max(n * var, 0.0) + (int(pos.sum()) - 1) / 2)
    inside = 0.5 * math.erfc((threshold - mean) / (sd * math.sqrt(2))) if sd > 0 else float(mean >= threshold)
    return 1 - (1 - hit_outside) * (1 - inside)


# ------------------------------------------------------------------------------------- harness


def _result_fields(result, multi: bool):
    if hasattr(result, "num_accepted"):
        kept, nxt = result.num_accepted, result.next_token
        index = getattr(result, "path_index", None)
    else:
        kept, nxt, *rest = result
        index = rest[0] if rest else None
    if multi and index is None:
        raise InputError("a multi-path verifier must return path_index (the path whose tokens are kept)")
    return kept, nxt, index


def iid_sampler(t: Tables, verifier: Callable, K: int | None = None):
    """(arrays, step) drafting one path (K None: a single-path verifier f(key, draft_tokens
    [B, L], q [B, L, V], p [B, L+1, V])) or K i.i.d. paths (f(key, paths [B, K, L], q [B, K, L, V],
    p [B, K, L+1, V])) of length L = n from the draft tables, verified by `verifier`."""
    V, L = t.V, t.n
    k_paths = 1 if K is None else K
    arrays = {"P": [stack_levels([level]) for level in t.P], "Q": [stack_levels([level]) for level in t.Q]}

    def step(key, arrays, rows):
        k_draft, k_verify = jax.random.split(key)
        draft_keys = jax.random.split(k_draft, L)
        idx = jnp.zeros((rows, k_paths), jnp.int32)
        toks, q_rows, p_rows = [], [], []
        for d in range(L):
            q_d, p_d = arrays["Q"][d][idx], arrays["P"][d][idx]
            tok = draw(draft_keys[d], q_d)
            toks.append(tok)
            q_rows.append(q_d)
            p_rows.append(p_d)
            idx = idx * V + tok
        p_rows.append(arrays["P"][L][idx])
        paths = jnp.stack(toks, axis=-1)                  # [rows, K, L]
        q_in = jnp.stack(q_rows, axis=-2)                 # [rows, K, L, V]
        p_in = jnp.stack(p_rows, axis=-2)                 # [rows, K, L+1, V]
        if K is None:
            kept, nxt, _ = _result_fields(verifier(k_verify, paths[:, 0], q_in[:, 0], p_in[:, 0]), False)
            return emission(paths[:, 0], kept, nxt, L + 1)
        kept, nxt, index = _result_fields(verifier(k_verify, paths, q_in, p_in), True)
        chosen = jnp.take_along_axis(paths, index[:, None, None], axis=1)[:, 0]
        return emission(chosen, kept, nxt, L + 1)

    return arrays, step


def run_sampler(t: Tables, sampler, n_keys: int = 50, rows: int = 4000, seed: int = 0) -> Sample:
    """Runs a sampler (arrays, step) -- step(key, arrays, rows) -> (tokens int32 [rows, n+1],
    emitted int32 [rows]) -- for n_keys * rows steps, extends each emission with target samples
    and counts the outcomes."""
    for name, value in (("n_keys", n_keys), ("rows", rows)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise InputError(f"{name} must be an integer >= 1, got {value!r}")
    V, n = t.V, t.n
    if V ** (n + 1) > MAX_OUTCOMES:
        raise InputError(f"V^(n+1) = {V ** (n + 1)} outcomes (V={V}, n={n}); the sampled check counts at most "
                         f"{MAX_OUTCOMES}")
    arrays, step = sampler
    arrays = dict(arrays, _target=stack_levels(t.P))

    def one(key, arrays):
        k_step, k_ext = jax.random.split(key)
        tokens, emitted = step(k_step, arrays, rows)
        ext_keys = jax.random.split(k_ext, n + 1)
        flat = jnp.zeros((rows,), jnp.int32)
        offset = 0
        for j in range(n + 1):
            drawn = draw(ext_keys[j], arrays["_target"][offset + flat])
            tok = jnp.where(j < emitted, tokens[:, j], drawn)
            flat = flat * V + tok
            offset += V ** j
        return jnp.bincount(flat, length=V ** (n + 1)), jnp.sum(emitted)

    keys = jax.random.split(jax.random.PRNGKey(seed), n_keys)
    # The tables are arguments, not closed-over constants: XLA would constant-fold the gathers.
    counts, emitted = jax.jit(jax.vmap(one, in_axes=(0, None)))(keys, jax.tree_util.tree_map(jnp.asarray, arrays))
    return Sample(np.asarray(counts, np.int64).sum(0), float(np.asarray(emitted, np.float64).sum()) / (n_keys * rows))


def sampler_for(verifier, tables: Tables, K: int | None = None, **options):
    """The (arrays, step) of a verifier: a name of `ssd_jax.testing.exact_law.NAMES` (the
    library's verifier, with the same options as `exact_law`), or a callable with a library
    verifier's signature (single path when K is None, else K i.i.d. paths)."""
    from ssd_jax import verify
    from ssd_jax.testing.enumeration import check_paths
    from ssd_jax.testing.exact_law import MULTI_PATH, NAMES

    if not isinstance(tables, Tables):
        raise InputError(f"tables must be ssd_jax.testing.Tables, got {type(tables).__name__}")
    if callable(verifier):
        if options:
            raise InputError(f"a verifier callable takes no options, got {sorted(options)}")
        return iid_sampler(tables, verifier, None if K is None else check_paths(K))
    if verifier not in NAMES:
        raise InputError(f"unknown verifier {verifier!r}; give a callable or one of {', '.join(NAMES)}")
    if verifier in MULTI_PATH:
        K = check_paths(K)
    elif K is not None:
        raise InputError(f"{verifier} verifies one draft; K must be None, got {K!r}")
    if verifier in ("tokenwise", "block") or verifier in MULTI_PATH:
        allowed = ("unrolled",) if verifier == "spectr" else ()
        if set(options) - set(allowed):
            raise InputError(f"{verifier} takes the options {list(allowed) or 'none'}, got {sorted(options)}")
        fn = getattr(verify, verifier)
        if options.get("unrolled") is not None:
            from ssd_jax.verify._tree_walk import walk

            fn = jax.jit(functools.partial(walk, verify.spectr_node, unrolled=bool(options["unrolled"])))
        return iid_sampler(tables, fn, K)
    if verifier in ("point_tree", "point_chain"):
        from ssd_jax.testing.point_mass import draft_chain, draft_tree, point_mass_sampler

        if set(options) - {"tree"}:
            raise InputError(f"{verifier} takes the option tree, got {sorted(options)}")
        as_chain = verifier == "point_chain"
        tree = options.get("tree") or (draft_chain(tables) if as_chain else draft_tree(tables))
        return point_mass_sampler(tables, tree, as_chain=as_chain)
    if set(options) - {"setup"}:
        raise InputError(f"{verifier} takes the option setup, got {sorted(options)}")
    if verifier == "csd":
        from ssd_jax.testing.cascade import cascade_sampler

        return cascade_sampler(tables, options.get("setup"))
    from ssd_jax.testing.ssd import ssd_sampler

    if verifier == "ssd":
        return ssd_sampler(tables, options.get("setup"), steps=2)
    return ssd_sampler(tables, options.get("setup"), steps=1, hit=verifier == "ssd_hit")


def sampled_counts(verifier, tables: Tables, K: int | None = None, *, n_keys: int = 50, rows: int = 4000,
                   seed: int = 0, **options) -> Sample:
    """Counts of the extended emissions of n_keys * rows independent steps of `verifier` (a
    name of `exact_law.NAMES` or a callable with a library verifier's signature; see
    `sampler_for`) over `tables`."""
    return run_sampler(tables, sampler_for(verifier, tables, K, **options), n_keys, rows, seed)
