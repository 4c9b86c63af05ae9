"""Static tree layouts for drafters whose tree shape is fixed ahead of time (prompt lookup,
LogitSpec): which node hangs under which is decided at trace time, only the tokens and which
nodes are valid change from step to step.

Node 0 is the root (the last emitted token, not yet in the target cache). A layout is a list of
branches hanging under the root; branch b is a chain of `lengths[b]` nodes stored consecutively
from `starts[b]`. Invalid nodes (a short retrieval) stay in the static tree, are scored by the
target like any other node, and can never be accepted.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ssd_jax.errors import InputError


@dataclasses.dataclass(frozen=True)
class TreeLayout:
    """parents int32 [N] (-1 at the root); depth int32 [N]; mask bool [N, N] (node j is node i
    or one of its ancestors); starts, lengths: int per branch."""

    parents: tuple[int, ...]
    starts: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.lengths, default=0)

    def depth(self) -> np.ndarray:
        depth = np.zeros(self.num_nodes, np.int32)
        for node in range(1, self.num_nodes):
            depth[node] = depth[self.parents[node]] + 1
        return depth

    def mask(self) -> np.ndarray:
        n = self.num_nodes
        mask = np.eye(n, dtype=bool)
        for node in range(1, n):
            mask[node] |= mask[self.parents[node]]
        return mask


def chain_layout(branch_lengths: list[int]) -> TreeLayout:
    """Branches of the given lengths (each >= 1) under one root, stored one after another."""
    parents, starts = [-1], []
    for length in branch_lengths:
        if length < 1:
            raise InputError(f"a tree branch needs at least one node, got length {length}")
        starts.append(len(parents))
        parents += [0] + [len(parents) + i for i in range(length - 1)]
    return TreeLayout(parents=tuple(parents), starts=tuple(starts), lengths=tuple(branch_lengths))


def linear_layout(num_draft_tokens: int) -> TreeLayout:
    """One chain of L nodes: the single draft path of prompt lookup."""
    return chain_layout([num_draft_tokens])


def rank_branch_length(rank: int) -> int:
    """LogitSpec's branch length for the candidate of rank `rank` (0 = most likely after the
    root), the candidate token included: rank < 8 -> 4, rank < 32 -> 3, else 1."""
    return 4 if rank < 8 else 3 if rank < 32 else 1


def logitspec_layout(root_length: int, topk: int, capacity: int) -> TreeLayout:
    """Branch 0: the root's own retrieved continuation (root_length nodes); then one branch per
    next-next candidate rank 0..topk-1 ([candidate] + its retrieved continuation, length by
    rank), as many as fit in `capacity` nodes (root included). Ranks that do not fit are
    dropped; a rank whose full length does not fit is shortened to what is left."""
    if capacity < 2:
        raise InputError(f"tree_capacity must be >= 2 (the root and one draft node), got {capacity}")
    if root_length < 1:
        raise InputError(f"num_draft_tokens must be >= 1, got {root_length}")
    root_length = min(root_length, capacity - 1)
    lengths = [root_length]
    used = 1 + root_length
    for rank in range(topk):
        room = capacity - used
        if room < 1:
            break
        length = min(rank_branch_length(rank), room)
        lengths.append(length)
        used += length
    return chain_layout(lengths)
