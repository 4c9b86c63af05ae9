"""Exact output laws of the library's verifiers, by enumeration in float64 (no sampling).

For tiny vocabularies (V <= 6) and depths, every draft (every K-tuple of paths, every point-mass
walk's draws, every branch of a cascade or of SSD's two steps) is enumerated with its
probability; each verifier's deterministic part is the library's own code run under float64
(`ssd_jax.verify.tokenwise_tables`, `block_tables`, `skewed_draft`, `specinfer_node`,
`spectr_node`, the point-mass walks, the cascade's schedule and Max-Gram, Saguaro's reshape and
fork tokens), so the kit checks the real code. The emitted sequence is extended to n+1 tokens with
the target's conditionals (`ssd_jax.testing.tables`); an exact verifier's law equals
`target_law(tables)` to float64 rounding.

`exact_law(name, tables, K=None, **options)` for name in NAMES:
    tokenwise, block                    single path, L = n
    specinfer, spectr, gbv              K i.i.d. paths (K required); spectr: unrolled=bool
    point_tree, point_chain             tree=PointTree (default `draft_tree` / `draft_chain`)
    csd                                 setup=CascadeSetup (default CascadeSetup())
    ssd, ssd_hit, ssd_miss              setup=SSDSetup (default SSDSetup())
"""

from __future__ import annotations

import functools

import numpy as np

from ssd_jax import verify
from ssd_jax.errors import InputError
from ssd_jax.testing.enumeration import (block_stop_prob, check_enumerable, check_paths, law_of_stops,
                                         multi_path_inputs, normalize_or, single_path_law, tokenwise_stop_prob,
                                         walk_law, x64)
from ssd_jax.testing.tables import Tables, law_distance, target_law

NAMES = ("tokenwise", "block", "specinfer", "spectr", "gbv", "point_tree", "point_chain", "csd", "ssd",
         "ssd_hit", "ssd_miss")
MULTI_PATH = ("specinfer", "spectr", "gbv")


def tokenwise_rule(drafts, q, p, lengths=None):
    """Token-wise verification's rule (`ssd_jax.testing.enumeration`) from `verify.tokenwise_tables`."""
    args = (drafts, q, p) if lengths is None else (drafts, q, p, lengths)
    accept, residual = x64(verify.tokenwise_tables, *args)
    return tokenwise_stop_prob(accept), normalize_or(residual, p)


def block_rule(drafts, q, p):
    """Block verification's rule from `verify.block_tables`."""
    h, residual = x64(verify.block_tables, drafts, q, p)
    return block_stop_prob(h), normalize_or(residual, p)


def greedy_rule(drafts, q, p):
    """Greedy verification's rule (`verify.greedy`, deterministic): point masses."""
    result = x64(lambda d, qq, pp: verify.greedy(None, d, qq, pp), drafts, q, p)
    kept, nxt = result.num_accepted, result.next_token
    n_rows, width = drafts.shape[0], drafts.shape[1] + 1
    stop = np.eye(width)[kept]
    next_law = np.broadcast_to(np.eye(p.shape[-1])[nxt][:, None, :], (n_rows, width, p.shape[-1])).copy()
    return stop, next_law


def tokenwise_law(t: Tables) -> np.ndarray:
    return single_path_law(t, tokenwise_rule)


def block_law(t: Tables) -> np.ndarray:
    return single_path_law(t, block_rule)


def gbv_law(t: Tables, K: int) -> np.ndarray:
    """GBV: the library's selection and skewed draft (`verify.skewed_draft`), then block
    verification of X* against q~."""
    paths, prob, q, p = multi_path_inputs(t, K)
    _, x_star, q_tilde, p_star = x64(verify.skewed_draft, paths, q, p)
    stop, next_law = block_rule(x_star, q_tilde, p_star)
    return law_of_stops(t, x_star, prob, stop, next_law)


def tree_walk_law(t: Tables, K: int, node_rule) -> np.ndarray:
    """A walk over K i.i.d. paths with a node rule (`specinfer_node`, `spectr_node`, ...)."""
    paths, prob, q, p = multi_path_inputs(t, K)
    return walk_law(t, paths, prob, q, p, node_rule)


def specinfer_law(t: Tables, K: int) -> np.ndarray:
    return tree_walk_law(t, K, verify.specinfer_node)


def spectr_law(t: Tables, K: int, unrolled: bool = False) -> np.ndarray:
    return tree_walk_law(t, K, functools.partial(verify.spectr_node, unrolled=unrolled))


def _options(name: str, options: dict, allowed: tuple) -> dict:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise InputError(f"{name} takes the options {list(allowed) or 'none'}, got {unknown}")
    return options


def exact_law(name: str, tables: Tables, K: int | None = None, **options) -> np.ndarray:
    """The exact law of verifier `name` (see NAMES and the module docstring) over `tables`:
    float64 (V,)*(n+1). Raises InputError for an unknown name, a missing or unexpected K, an
    unknown option, or tables too large to enumerate (V > 6, too many rows)."""
    if name not in NAMES:
        raise InputError(f"unknown verifier {name!r}; the kit knows {', '.join(NAMES)}")
    check_enumerable(tables)
    if name in MULTI_PATH:
        K = check_paths(K)
    elif K is not None:
        raise InputError(f"{name} verifies one draft; K must be None, got {K!r}")
    if name == "tokenwise":
        _options(name, options, ())
        return tokenwise_law(tables)
    if name == "block":
        _options(name, options, ())
        return block_law(tables)
    if name == "specinfer":
        _options(name, options, ())
        return specinfer_law(tables, K)
    if name == "spectr":
        return spectr_law(tables, K, **_options(name, options, ("unrolled",)))
    if name == "gbv":
        _options(name, options, ())
        return gbv_law(tables, K)
    if name in ("point_tree", "point_chain"):
        from ssd_jax.testing.point_mass import draft_chain, draft_tree, point_mass_law

        tree = _options(name, options, ("tree",)).get("tree")
        as_chain = name == "point_chain"
        if tree is None:
            tree = draft_chain(tables) if as_chain else draft_tree(tables)
        return point_mass_law(tables, tree, as_chain=as_chain)
    if name == "csd":
        from ssd_jax.testing.cascade import CascadeSetup, cascade_law

        setup = _options(name, options, ("setup",)).get("setup") or CascadeSetup()
        return cascade_law(tables, setup)
    from ssd_jax.testing.ssd import SSDSetup, ssd_law, ssd_step_law

    setup = _options(name, options, ("setup",)).get("setup") or SSDSetup()
    if name == "ssd":
        return ssd_law(tables, setup)
    return ssd_step_law(tables, setup, hit=name == "ssd_hit")


def assert_exact(law, tables: Tables, tol: float = 1e-9) -> float:
    """Raises AssertionError unless `law` is the target's law of `tables` to total variation
    `tol`; returns the distance."""
    want = target_law(tables)
    law = np.asarray(law, np.float64)
    if law.shape != want.shape:
        raise InputError(f"law has shape {law.shape}; tables of V={tables.V}, depth n={tables.n} need {want.shape}")
    distance = law_distance(law, want)
    if not distance <= tol:
        raise AssertionError(f"the law differs from the target's: total variation {distance:.3e} > {tol:.1e}")
    return distance
