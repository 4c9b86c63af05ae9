"""A feature-level head's parts for the decode skeleton (`ssd_jax.EAGLE`).

Each step: the head drafts (greedy, or Gumbel-coupled: an EAGLE-2 tree, `ssd_jax.eagle.tree.
draft_tree`; T > 0: `topk` i.i.d. paths drawn from its law, `sampled_paths`) -> the target scores
every node in one tree forward that also returns its features at the feature layers -> the
verifier decides the accepted path and the next token (the point-mass walk of the deterministic
tree, which at T = 0 keeps the target's argmax chain; SpecInfer's recursive rejection with the
head's q for sampled paths; both exact) -> the path is compacted into the target's cache, and
the head reads the accepted positions' real features (one forward over the path's static width,
committing accepted + 1 entries), whose last output is the next root's.

Under draft_len "auto" (`ssd_jax.loop.adaptive_loop`) the loop may decode plainly for a while:
each plain step keeps the fused features of the token it read (`ar_step`), and the head reads
them with the tokens that followed in one forward when the loop catches up (`resync`). The loop
learns the head's acceptance from its speculative steps alone (a head scored on plain text would
read the target's features at every depth, where drafting reads its own past depth 1).

Invariant at the top of a step, per row: the target's cache holds every emitted token but the
last, `cur`, at position P = its length; the head's cache holds its entries for positions < P
(entry t: the target's features at t plus the embedding of token t + 1, so the entry at P - 1
read cur), and root_hidden is the output of the entry at P - 1, whose logits are the law of the
first draft token. Keys: the step key s drafts with fold_in(s, 1) and verifies with fold_in(s, 2)
(T > 0); the greedy and coupled walks read s itself.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ssd_jax import verify
from ssd_jax.coupling import decision_logits
from ssd_jax.eagle.forward import fused_features, head_forward_cached
from ssd_jax.eagle.head import HeadConfig
from ssd_jax.eagle.tree import draft_tree, sampled_paths
from ssd_jax.loop.autoregressive import ARParts
from ssd_jax.loop.caps import pending_width, unread_count_only
from ssd_jax.loop.emission import emitted_tokens
from ssd_jax.loop.skeleton import DecodeState, Verdict, fold_rows
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import commit, compact_path, init_cache
from ssd_jax.models.transformer import forward_cached
from ssd_jax.sampling import SamplingParams, probabilities
from ssd_jax.tree import build_tree, gather_path_rows, path_nodes
from ssd_jax.verify.point_tree import point_mass_tree


# The verifier of sampled paths (a module attribute: tests/test_eagle.py swaps in a wrong one to
# show that its law check has power).
SAMPLED_VERIFIER = verify.specinfer


@dataclasses.dataclass(frozen=True)
class EagleParts:
    """draft_len: the tree's depth; topk: nodes per depth while expanding; tree_size: nodes the
    target verifies (root included); head_params, head_config: the head; tparams, tcfg: the
    target; prompt_size / out_size: static buffer sizes; pending_width: > 0 under "auto", the most
    tokens the head may lag behind after plain steps. inner state: dict(hcache: the head's KV
    cache, root_hidden [B, D]; under "auto" also plain_hidden [B, pending_width, D]: the fused
    features of the tokens plain steps read, plain_count int32 [B]: how many)."""

    draft_len: int
    topk: int
    tree_size: int
    head_params: dict
    head_config: HeadConfig
    tparams: dict
    tcfg: ModelConfig
    sampling: SamplingParams
    prompt_size: int
    out_size: int
    pending_width: int = 0

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs the prefill and every verification return."""
        return self.head_config.feature_layers

    @property
    def layer_config(self) -> ModelConfig:
        return self.head_config.layer_config(self.tcfg)

    @property
    def capacity(self) -> int:
        return self.prompt_size + self.out_size + self.room + 2 + self.pending_width

    @property
    def room(self) -> int:
        """Nodes a step writes past the committed text: the tree (T = 0), the sampled paths'
        tree (T > 0), the head's draft entries and its catch-up."""
        return max(self.tree_size, 1 + self.draft_len * self.topk)

    chain_writes = False
    drafts_with_model = True
    takes_cap = False          # every step drafts the tree of the plan's depth
    keeps_room = True          # under "auto" too (`ssd_jax.loop.skeleton.room_gated`)
    learns_while_plain = False
    shadow_tree = None

    @property
    def verify_caps(self) -> tuple[int, ...]:
        return (self.draft_len,)

    def dispatch_caps(self, batch: int) -> None:
        return None

    def gates(self, batch: int) -> bool:
        return False

    @property
    def counter_width(self) -> int:
        return self.draft_len

    def init(self, tokens, lengths, first, logits, features=None):
        """The head reads the prompt: entry t holds the features at t and token t + 1 (the first
        generated token after the last prompt token)."""
        b, width = tokens.shape
        nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
        nxt = jnp.where(jnp.arange(width)[None, :] == (lengths - 1)[:, None], first[:, None], nxt)
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (b, width))
        hcache = init_cache(self.layer_config, b, self.capacity, self.tparams["embed"].dtype)
        _, hcache, out = head_forward_cached(self.head_params, self.tparams, self.layer_config,
                                             fused_features(self.head_params, features), nxt, positions, hcache,
                                             logit_indices=jnp.zeros((b, 0), jnp.int32))
        root_hidden = jnp.take_along_axis(out, (lengths - 1)[:, None, None], axis=1)[:, 0]
        inner = dict(hcache=hcache.replace(lengths=lengths), root_hidden=root_hidden)
        if self.pending_width:
            inner.update(plain_hidden=jnp.zeros((b, self.pending_width, root_hidden.shape[-1]), root_hidden.dtype),
                         plain_count=jnp.zeros((b,), jnp.int32))
        return inner

    def step(self, state: DecodeState, keys: jax.Array, active: jax.Array, cap=None, width=None) -> Verdict:
        if not self.sampling.by_argmax:
            return self._sampled_step(state, keys, active)
        inner, tcache, cur = state.inner, state.tcache, state.cur
        b, depth = cur.shape[0], self.draft_len
        tree = draft_tree(self.head_params, self.tparams, self.layer_config, inner["hcache"], inner["root_hidden"],
                          cur, depth=depth, topk=self.topk, tree_size=self.tree_size)
        position = tcache.lengths
        node_positions = position[:, None] + tree.depth
        logits, tcache, features = forward_cached(self.tparams, self.tcfg, tree.tokens, node_positions, tcache,
                                                  tree_mask=tree.mask, feature_layers=self.feature_layers)
        # Greedy (or Gumbel-coupled: argmaxes of perturbed logits) walk of the deterministic tree.
        scores = decision_logits(logits, keys, node_positions + 1, self.sampling)
        valid = jnp.ones(tree.tokens.shape, bool)
        verdict = jax.vmap(lambda k, t, v, pa, s: point_mass_tree(k, t[None], v[None], pa[None], s[None], greedy=True))(
            keys, tree.tokens, valid, tree.parents, scores)
        verdict = jax.tree.map(lambda x: x[:, 0], verdict)
        nodes = verdict.nodes[:, :depth + 1]
        path_tokens = jnp.take_along_axis(tree.tokens, nodes[:, 1:], axis=1)         # [B, L]
        return self._after_verify(inner, tcache, features, nodes, path_tokens, verdict.num_accepted,
                                  verdict.next_token, active, tree.drafted)

    def _sampled_step(self, state: DecodeState, keys: jax.Array, active: jax.Array) -> Verdict:
        """T > 0 without the Gumbel coupling: topk i.i.d. paths drawn from the head's law
        (`sampled_paths`), verified by SpecInfer's recursive rejection with the head's q (a top-k
        tree's tokens are not draws from q, and a point-mass walk of one accepts only the target's
        mass on its nodes: 0.20 at depth 1 on the embedded target at T=1, where the head's law
        overlaps the target's by 0.84)."""
        inner, tcache, cur = state.inner, state.tcache, state.cur
        b, depth, k = cur.shape[0], self.draft_len, self.topk
        paths, q = sampled_paths(self.head_params, self.tparams, self.layer_config, inner["hcache"],
                                 inner["root_hidden"], fold_rows(keys, 1), depth=depth, paths=k,
                                 sampling=self.sampling)
        tree = build_tree(cur, paths)
        node_positions = tcache.lengths[:, None] + tree.depth
        logits, tcache, features = forward_cached(self.tparams, self.tcfg, tree.tokens, node_positions, tcache,
                                                  tree_mask=tree.mask, feature_layers=self.feature_layers)
        p = gather_path_rows(probabilities(logits, self.sampling), tree)
        verify_keys = fold_rows(keys, 2)
        result = jax.vmap(lambda key, *xs: SAMPLED_VERIFIER(key, *[x[None] for x in xs]))(verify_keys, paths, q, p)
        result = jax.tree.map(lambda x: x[:, 0], result)
        nodes = path_nodes(tree, result.path_index)                                     # [B, L+1]
        path_tokens = paths[jnp.arange(b), result.path_index]
        return self._after_verify(inner, tcache, features, nodes, path_tokens, result.num_accepted,
                                  result.next_token, active, jnp.full((b,), k * depth, jnp.int32))

    def _after_verify(self, inner, tcache, features, nodes, path_tokens, accepted, next_token, active,
                      drafted) -> Verdict:
        """The verdict of a step whose target forward (features [B, N, K, D] of its nodes) accepted
        `accepted` tokens along nodes int32 [B, L+1] (root first; path_tokens int32 [B, L]): the
        path compacted into the target's cache, and the head's reading of the accepted positions
        P..P+accepted with their real features (committed), whose last output is the next root's."""
        b, depth = nodes.shape[0], self.draft_len
        keep = jnp.where(active, accepted + 1, 0)
        position = tcache.lengths
        tcache = compact_path(tcache, nodes, keep)
        path_features = jnp.take_along_axis(features, nodes[:, :, None, None], axis=1)  # [B, L+1, K, D]
        nxt = emitted_tokens(path_tokens, accepted, next_token)
        entry_positions = position[:, None] + jnp.arange(depth + 1, dtype=jnp.int32)[None, :]
        _, hcache, out = head_forward_cached(self.head_params, self.tparams, self.layer_config,
                                             fused_features(self.head_params, path_features), nxt, entry_positions,
                                             inner["hcache"], logit_indices=jnp.zeros((b, 0), jnp.int32))
        hcache = commit(hcache, keep)
        root_hidden = jnp.where(active[:, None], out[jnp.arange(b), accepted], inner["root_hidden"])
        return Verdict(tcache=tcache, inner=dict(inner, hcache=hcache, root_hidden=root_hidden), chosen=path_tokens,
                       accepted=accepted, next_token=next_token, drafted=drafted,
                       draft_forwards=jnp.asarray(depth - 1, jnp.int32))

    # ------------------------------------------------------------ adaptive speculation's fallback

    def ar_step(self, state: DecodeState, keys: jax.Array, active: jax.Array) -> Verdict:
        """A plain step (the target alone) that keeps the fused features of the token it read, cur,
        for the head's catch-up (`resync`)."""
        plain = ARParts(tparams=self.tparams, tcfg=self.tcfg, sampling=self.sampling, capacity=self.capacity)
        _, verdict, features = plain.logits_and_step(state, keys, active, self.feature_layers)
        inner = state.inner
        rows = jnp.arange(active.shape[0])
        slot = jnp.where(active, inner["plain_count"], self.pending_width)
        hidden = inner["plain_hidden"].at[rows, slot].set(fused_features(self.head_params, features)[:, 0],
                                                          mode="drop")
        return verdict.replace(inner=dict(inner, plain_hidden=hidden,
                                          plain_count=inner["plain_count"] + active.astype(jnp.int32)))

    def pending(self, inner) -> tuple[jax.Array, jax.Array]:
        """The loop's pending buffer: plain steps append their tokens after slot 0 (the head keeps
        their features itself), see `resync`."""
        return unread_count_only(inner["plain_count"].shape[0], self.pending_width)

    def resync(self, inner, pending: jax.Array, pending_len: jax.Array):
        """The head reads what plain steps decoded: the entries at P..P+n-1 (P: its cache's length,
        n = pending_len - 1 plain steps) from their tokens' fused features and the tokens after
        them, pending[:, 1:n+1], in one forward; the last one's output is the next root's."""
        hcache, b, width = inner["hcache"], pending.shape[0], pending.shape[1] - 1
        read = pending_len - 1
        # Slots past a row's count hold padding, never committed; their positions are clamped so
        # learned position embeddings are never read past their table.
        positions = jnp.minimum(hcache.lengths[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :],
                                self.tcfg.max_position_embeddings - 1)
        _, hcache, out = head_forward_cached(self.head_params, self.tparams, self.layer_config,
                                             inner["plain_hidden"][:, :width], pending[:, 1:], positions, hcache,
                                             logit_indices=jnp.zeros((b, 0), jnp.int32))
        last = out[jnp.arange(b), jnp.maximum(read - 1, 0)]
        return dict(inner, hcache=commit(hcache, read), root_hidden=jnp.where((read > 0)[:, None], last,
                                                                            inner["root_hidden"]),
                    plain_count=jnp.zeros_like(inner["plain_count"]))


def eagle_parts(method, head, tparams: dict, tcfg: ModelConfig, sampling: SamplingParams, prompt_width: int,
                out_size: int, plan=None) -> EagleParts:
    """method: an EAGLE object; head: the `EagleHead`; plan: its `AutoPlan` when draft_len is
    "auto" (the depth the plan chose; the parts can fall back to plain decoding)."""
    depth = plan.draft_len if plan is not None else method.draft_len
    return EagleParts(draft_len=depth, topk=method.topk, tree_size=method.nodes_at(depth),
                      head_params=head.params, head_config=head.config, tparams=tparams, tcfg=tcfg,
                      sampling=sampling, prompt_size=prompt_width, out_size=out_size,
                      pending_width=pending_width(plan))
