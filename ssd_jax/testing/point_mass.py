"""Point-mass drafts: deterministic draft trees and chains (prompt lookup, LogitSpec) verified by
the library's walks `ssd_jax.verify.point_tree.point_mass_tree` and `point_mass_chain`.

A `PointTree` is fixed before the step: tokens int32 [N] (node 0 is the root, the last emitted
token; its id is never read), parents int32 [N] (-1 at the root, parents before children),
valid bool [N] (an invalid node is never accepted). Node i conditions on the tokens on the path
from the root to it, so its target row is P[depth(i)][path] (depth <= n).

Exact law. The walk draws Y_d from the target at the node it stands on at depth d and descends
into the valid child equal to Y_d, else emits Y_d and stops. Given the draws y_0..y_D the verdict
is deterministic: the kit runs the library's walk with greedy=True on target rows that are the
one-hot rows of y_d (its argmax is then the draw), for every assignment y in V^(D+1), and weights
the verdict by prod_{d <= stop} P(y_d | node_d) times V^-(D - stop) for the draws it never used.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.errors import InputError
from ssd_jax.testing.device_tables import emission
from ssd_jax.testing.enumeration import Emissions, check_enumerable, rows
from ssd_jax.testing.tables import Tables


@dataclasses.dataclass(frozen=True, eq=False)
class PointTree:
    """A deterministic draft tree (module docstring); validated on construction."""

    tokens: np.ndarray
    parents: np.ndarray
    valid: np.ndarray

    def __post_init__(self):
        tokens, parents = np.asarray(self.tokens), np.asarray(self.parents)
        valid = np.ones(tokens.shape, bool) if self.valid is None else np.asarray(self.valid)
        if tokens.ndim != 1 or tokens.shape[0] < 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise InputError(f"tokens must be integer token ids [N >= 1], got shape {tokens.shape} {tokens.dtype}")
        n_nodes = tokens.shape[0]
        if parents.shape != (n_nodes,) or not np.issubdtype(parents.dtype, np.integer):
            raise InputError(f"parents must be integers [N] = [{n_nodes}], got shape {parents.shape} {parents.dtype}")
        if valid.shape != (n_nodes,) or valid.dtype != bool:
            raise InputError(f"valid must be booleans [N] = [{n_nodes}], got shape {valid.shape} {valid.dtype}")
        if parents[0] != -1:
            raise InputError(f"parents[0] must be -1 (node 0 is the root), got {int(parents[0])}")
        for i in range(1, n_nodes):
            if not 0 <= parents[i] < i:
                raise InputError(f"parents[{i}] = {int(parents[i])}: a parent must be an earlier node (0..{i - 1})")
        object.__setattr__(self, "tokens", tokens.astype(np.int32))
        object.__setattr__(self, "parents", parents.astype(np.int32))
        object.__setattr__(self, "valid", valid)

    @property
    def depth(self) -> np.ndarray:
        """int64 [N]: each node's depth (root 0)."""
        depth = np.zeros(self.tokens.shape[0], np.int64)
        for i in range(1, depth.shape[0]):
            depth[i] = depth[self.parents[i]] + 1
        return depth

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    @property
    def is_chain(self) -> bool:
        return bool(np.all(self.parents == np.arange(self.parents.shape[0]) - 1))

    def paths(self) -> np.ndarray:
        """int32 [N, max(D, 1)]: the tokens on the path from the root to each node (node's own
        token last, zeros after)."""
        depth = self.depth
        out = np.zeros((self.tokens.shape[0], max(self.max_depth, 1)), np.int32)
        for i in range(1, depth.shape[0]):
            out[i] = out[self.parents[i]]
            out[i, depth[i] - 1] = self.tokens[i]
        return out

    def node_rows(self, t: Tables) -> np.ndarray:
        """float64 [N, V]: the target's row after each node."""
        paths, depth = self.paths(), self.depth
        return np.stack([rows(t.P, paths[i:i + 1], int(depth[i]))[0] for i in range(depth.shape[0])])


def chain(tokens, valid=None) -> PointTree:
    """A chain root -> tokens[0] -> tokens[1] -> ... (prompt lookup's layout)."""
    tokens = np.concatenate([[0], np.asarray(tokens, np.int64)]).astype(np.int32)
    valid = None if valid is None else np.concatenate([[True], np.asarray(valid, bool)])
    return PointTree(tokens, np.arange(tokens.shape[0]) - 1, valid)


def draft_tree(t: Tables, width: int = 2, depth: int | None = None, invalid=()) -> PointTree:
    """The tree whose every node of depth < `depth` (default n) has as children the `width`
    most likely tokens of the draft law Q after it (ties to the lowest id), as a LogitSpec-style
    tree built from a model's top-k; nodes in breadth-first order. invalid: node indices marked
    invalid."""
    depth = t.n if depth is None else depth
    if not 1 <= width <= t.V or not 1 <= depth <= t.n:
        raise InputError(f"width must be in [1, V={t.V}] and depth in [1, n={t.n}], got width={width}, depth={depth}")
    tokens, parents, paths = [0], [-1], [()]
    frontier = [0]
    for d in range(depth):
        nxt = []
        for node in frontier:
            q = t.Q[d][paths[node]]
            for tok in np.argsort(-q, kind="stable")[:width]:
                tokens.append(int(tok))
                parents.append(node)
                paths.append(paths[node] + (int(tok),))
                nxt.append(len(tokens) - 1)
        frontier = nxt
    valid = np.ones(len(tokens), bool)
    valid[list(invalid)] = False
    return PointTree(np.array(tokens), np.array(parents), valid)


def draft_chain(t: Tables, depth: int | None = None) -> PointTree:
    """The chain of the draft law's argmax tokens (ties to the lowest id), `depth` (default n)
    long: a deterministic continuation, as prompt lookup copies one."""
    depth = t.n if depth is None else depth
    if not 1 <= depth <= t.n:
        raise InputError(f"depth must be in [1, n={t.n}], got {depth}")
    path: tuple = ()
    for d in range(depth):
        path += (int(np.argmax(t.Q[d][path])),)
    return chain(path)


def _check_tree(t: Tables, tree) -> PointTree:
    if not isinstance(tree, PointTree):
        raise InputError(f"tree must be an ssd_jax.testing.PointTree, got {type(tree).__name__}")
    if tree.tokens[1:].size and (tree.tokens[1:].min() < 0 or tree.tokens[1:].max() >= t.V):
        raise InputError(f"tree tokens must be ids in [0, V={t.V}), got {tree.tokens[1:].tolist()}")
    if tree.max_depth > t.n:
        raise InputError(f"a tree of depth {tree.max_depth} needs tables of depth n >= {tree.max_depth}, got n={t.n}")
    return tree


def point_mass_law(t: Tables, tree: PointTree, as_chain: bool = False) -> np.ndarray:
    """Exact law of the walk over `tree` (module docstring); as_chain: through
    `point_mass_chain` (tree must be a chain) instead of `point_mass_tree`."""
    from ssd_jax.verify.point_tree import point_mass_chain, point_mass_tree

    tree = _check_tree(t, tree)
    if as_chain and not tree.is_chain:
        raise InputError("point_chain needs a chain (parents[i] = i - 1); use point_tree for other trees")
    V, D, n_nodes = t.V, tree.max_depth, tree.tokens.shape[0]
    check_enumerable(t, V ** (D + 1) * n_nodes, "draw assignments x tree nodes")
    ys = np.array(list(itertools.product(range(V), repeat=D + 1)), np.int32)     # [B, D+1]
    b = ys.shape[0]
    onehot = np.eye(V, dtype=np.float32)[ys[:, tree.depth]]                     # [B, N, V]
    tokens = np.broadcast_to(tree.tokens, (b, n_nodes))
    valid = np.broadcast_to(tree.valid, (b, n_nodes))
    key = jax.random.PRNGKey(0)
    if as_chain:
        verdict = point_mass_chain(key, tokens, valid, onehot, greedy=True)
    else:
        verdict = point_mass_tree(key, tokens, valid, tree.parents, onehot, greedy=True)
    kept, nxt, nodes = (np.asarray(x) for x in verdict)
    ar = np.arange(b)
    if not np.array_equal(nxt, ys[ar, kept]):
        raise AssertionError("the walk's next token is not its draw at the stopping depth")
    node_p = tree.node_rows(t)
    step_p = node_p[nodes, ys]                                                  # [B, D+1]
    used = np.arange(D + 1)[None, :] <= kept[:, None]
    weight = np.prod(np.where(used, step_p, 1.0 / V), axis=1)
    emitted = Emissions(t)
    emitted.add(tree.tokens[nodes[:, 1:]], kept, np.eye(V)[nxt] * weight[:, None])
    return emitted.law()


def point_mass_sampler(t: Tables, tree: PointTree, as_chain: bool = False):
    """(arrays, step) for the sampled-law harness: the real jitted walk with greedy=False."""
    from ssd_jax.verify.point_tree import point_mass_chain, point_mass_tree

    tree = _check_tree(t, tree)
    if as_chain and not tree.is_chain:
        raise InputError("point_chain needs a chain (parents[i] = i - 1); use point_tree for other trees")
    arrays = {"node_p": tree.node_rows(t).astype(np.float32)}
    tokens_np, valid_np, parents_np = tree.tokens, tree.valid, tree.parents

    def step(key, arrays, rows):
        n_nodes = tokens_np.shape[0]
        tokens = jnp.broadcast_to(jnp.asarray(tokens_np), (rows, n_nodes))
        valid = jnp.broadcast_to(jnp.asarray(valid_np), (rows, n_nodes))
        p = jnp.broadcast_to(arrays["node_p"], (rows,) + arrays["node_p"].shape)
        if as_chain:
            kept, nxt, nodes = point_mass_chain(key, tokens, valid, p, greedy=False)
        else:
            kept, nxt, nodes = point_mass_tree(key, tokens, valid, parents_np, p, greedy=False)
        path = jnp.take_along_axis(tokens, nodes[:, 1:], axis=1)
        return emission(path, kept, nxt, t.n + 1)

    return arrays, step
