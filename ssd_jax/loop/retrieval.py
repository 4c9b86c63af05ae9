"""Retrieval drafting's parts for the decode skeleton (prompt lookup, LogitSpec): no draft model.

Each step: build a static-shaped draft tree from the on-device context buffer (prompt + emitted
text) -> the target scores every node in one tree forward -> the point-mass tree walk decides
the accepted path and the next token -> the accepted path is compacted into the target cache and
the emitted tokens are appended to the context buffer.

Invariant at the top of a step, per row: the target cache holds every emitted token but the last,
`cur` (the tree root), which sits at position P = cache length; the context buffer holds the
prompt and every emitted token including cur; last_logits are the target logits cur was drawn
from (LogitSpec's next-next guesses; raw logits under the Gumbel coupling too: retrieval drafts
are unchanged by it). Random keys: the step key verifies; under the Gumbel coupling it is the row
key, the noise key of the target's perturbed logits.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.backend import policy_for
from ssd_jax.coupling import decision_logits
from ssd_jax.draft.logitspec import logitspec_tree
from ssd_jax.draft.ngram import append_tokens
from ssd_jax.draft.prompt_lookup import prompt_lookup_tree
from ssd_jax.draft.tree_layout import TreeLayout, linear_layout, logitspec_layout
from ssd_jax.loop.caps import at_narrowest, pending_width, switched_caps, unread_count_only, with_one
from ssd_jax.loop.autoregressive import ARParts
from ssd_jax.loop.emission import emitted_tokens
from ssd_jax.loop.skeleton import DecodeState, Verdict
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import commit, compact_path
from ssd_jax.models.transformer import forward_cached
from ssd_jax.sampling import SamplingParams, probabilities
from ssd_jax.verify.point_tree import point_mass_chain, point_mass_tree


def retrieval_layout(method, draft_len: int) -> TreeLayout:
    """The static tree of a PLD (one chain of draft_len nodes) or LogitSpec object whose root
    branch is draft_len tokens."""
    if method.name == "pld":
        return linear_layout(draft_len)
    return logitspec_layout(draft_len, method.topk, method.tree_size)


@dataclasses.dataclass(frozen=True)
class RetrievalParts:
    """method: a PLD or LogitSpec object; draft_len: its (planned, under "auto") root branch
    length; prompt_size / out_size: static buffer sizes. pending_width: > 0 under adaptive
    speculation (plain-decoding steps between speculative ones; nothing to resync, since
    retrieval keeps no draft model state). capped: PLD under "auto", each step's copy cut at the
    loop's cap and verified at the narrowest compiled width holding it (`takes_cap`). auto_tree:
    LogitSpec under "auto": a step at one row verifies its tree only where its root branch
    retrieved something (`gates`), and every step's tree keeps the nodes the target's cache has
    room for (`trims_to_room`). inner state: dict(context int32 [B, C], context_len int32 [B],
    last_logits float32 [B, V])."""

    method: object
    draft_len: int
    tparams: dict
    tcfg: ModelConfig
    sampling: SamplingParams
    prompt_size: int
    out_size: int
    pending_width: int = 0
    capped: bool = False
    auto_tree: bool = False

    @property
    def takes_cap(self) -> bool:
        """Whether `step` honours a per-step cap (the adaptive loop's choice): PLD under "auto"."""
        return self.capped

    @property
    def verify_caps(self) -> tuple[int, ...]:
        return switched_caps(self.draft_len, self.tparams) if self.takes_cap else (self.draft_len,)

    def dispatch_caps(self, batch: int) -> tuple[int, ...] | None:
        """The caps the adaptive loop compiles one PLD step for and dispatches on once per run of
        steps at that cap (`step(width=n)`: the chain verified at n whatever the copies' lengths),
        at batch >= 2 where verification has several compiled widths; None (batch 1, LogitSpec,
        one width) where each step picks its own width. A switch per step passes the target's KV
        cache through the conditional, which XLA:CPU copies every step. At batch 1 the per-step
        width keeps its worth: a step where the lookup found nothing costs a plain one."""
        if not self.takes_cap or batch < 2 or len(self.verify_caps) == 1:
            return None
        return with_one(self.verify_caps)

    def gates(self, batch: int) -> bool:
        """Whether `step(gate=)` runs a step whose root branch retrieved nothing as a plain one:
        LogitSpec under "auto" at one row, where the backend lets a step switch (CPU, TPU). Its
        tree then holds only the last logit's guesses at the next token, which the target took
        at 0-8% of such positions of held-out code and repetition at T=0, 14-15% of their
        positions (`benchmarks/logitspec_outcomes.py`), so a plain step makes nearly the same
        tokens for less than a tree's verification. At several rows a step verifies the tree
        wherever one row retrieved something, and a switch per step would copy the KV caches
        through the conditional for the rare step where none did."""
        return self.auto_tree and batch == 1 and policy_for(self.tparams).adaptive_switch_per_step

    @property
    def trims_to_room(self) -> bool:
        """Whether a step drops the tree nodes past the end of the target's cache (node j writes
        slot lengths + j), so a tree step runs in any room and the cache needs none past the
        prompt and the outputs (`ssd_jax.loop.skeleton.target_capacity`): LogitSpec under
        "auto". Its nodes come root branch first, so the nodes kept hold every ancestor of each
        (an exact walk over any such tree keeps the target's law), and the root branch's first
        r nodes, all a row with r tokens left can keep. Without it a tree lacking room decoded
        plainly, a call's last N - 1 tokens: on a held-out prose prompt (128 tokens, an 8-node
        tree) 27-29 target calls where trimmed trees make 23."""
        return self.auto_tree

    def retrieved(self, valid: jax.Array) -> jax.Array:
        """bool [B]: the rows whose tree (valid bool [B, N]) holds a retrieved root branch, what a
        gated step verifies (`gates`)."""
        return jnp.any(valid[:, 1:1 + self.layout.lengths[0]], axis=1)

    @functools.cached_property
    def layout(self) -> TreeLayout:
        return retrieval_layout(self.method, self.draft_len)

    drafts_with_model = False

    @property
    def capacity(self) -> int:
        return self.prompt_size + self.out_size + self.layout.num_nodes + 2

    @property
    def room(self) -> int:
        return self.layout.num_nodes

    @property
    def chain_writes(self) -> bool:
        """PLD's copy is verified as a causal block, LogitSpec's tree as a tree."""
        return self.method.name == "pld"

    @property
    def counter_width(self) -> int:
        return self.layout.max_depth

    @property
    def context_capacity(self) -> int:
        return self.prompt_size + self.out_size + self.layout.max_depth + 2

    def init(self, tokens, lengths, first, logits):
        b, width, size = tokens.shape[0], tokens.shape[1], self.context_capacity
        context = jnp.zeros((b, size), jnp.int32).at[:, :width].set(tokens)
        context = jnp.where(jnp.arange(size)[None, :] < lengths[:, None], context, 0)
        context, context_len = append_tokens(context, lengths, first[:, None], jnp.ones((b,), jnp.int32))
        return dict(context=context, context_len=context_len, last_logits=logits)

    def _draft_tree(self, inner):
        m = self.method
        if m.name == "pld":
            return prompt_lookup_tree(inner["context"], inner["context_len"], num_draft_tokens=self.draft_len,
                                      n_min=m.min_ngram, n_max=m.max_ngram)
        return logitspec_tree(inner["context"], inner["context_len"], inner["last_logits"], self.layout,
                              max_ngram=m.max_ngram)

    def step(self, state: DecodeState, keys: jax.Array, active: jax.Array, cap: jax.Array | None = None,
             width: int | None = None, gate: jax.Array | None = None) -> Verdict:
        """One speculative step; cap int32 []: the most tokens a row's copy keeps (`takes_cap`);
        width: the compiled cap (one of `dispatch_caps`, >= cap) the chain is verified at, None:
        chosen per step; gate bool [] (`gates`; None: never): whether a LogitSpec tree whose root
        branch retrieved nothing runs as a plain step (the loop's calibration, which times a
        tree's verification, passes False). The choice reads only the context, so each row's
        verdict stays exact."""
        if self.method.name == "pld":
            return self._chain_step(state, keys, active, cap, width)
        tree_tokens, valid = self._draft_tree(state.inner)
        if self.trims_to_room:
            room = state.tcache.capacity - state.tcache.lengths
            valid = valid & (jnp.arange(self.layout.num_nodes)[None, :] < room[:, None])
        if gate is None:
            return self._tree_step(state, keys, active, tree_tokens, valid)
        verifies = ~gate | jnp.any(active & self.retrieved(valid))

        def verified() -> Verdict:
            return self._tree_step(state, keys, active, tree_tokens, valid).replace(verified=jnp.ones((), bool))

        return jax.lax.cond(verifies, verified, lambda: self._as_plain_step(state, keys, active))

    def _as_plain_step(self, state: DecodeState, keys: jax.Array, active: jax.Array) -> Verdict:
        """A gated step that found nothing to verify: a plain step in a speculative step's form."""
        verdict = self.ar_step(state, keys, active)
        b = keys.shape[0]
        return verdict.replace(chosen=jnp.zeros((b, self.layout.max_depth), jnp.int32),
                               accepted=jnp.zeros((b,), jnp.int32), drafted=jnp.zeros((b,), jnp.int32),
                               token_law=None, verified=jnp.zeros((), bool))

    def _tree_step(self, state: DecodeState, keys: jax.Array, active: jax.Array, tree_tokens: jax.Array,
                   valid: jax.Array) -> Verdict:
        """A LogitSpec step verifying its tree (tree_tokens int32 [B, N], valid bool [B, N]) in one
        target forward."""
        layout, inner, tcache = self.layout, state.inner, state.tcache
        b, n_nodes = keys.shape[0], layout.num_nodes
        rows = jnp.arange(b)
        position = tcache.lengths  # of the root
        parents = np.asarray(layout.parents)
        greedy = self.sampling.by_argmax

        tree_mask = jnp.broadcast_to(jnp.asarray(layout.mask()), (b, n_nodes, n_nodes))
        node_positions = position[:, None] + jnp.asarray(layout.depth())[None, :]
        logits, tcache = forward_cached(self.tparams, self.tcfg, tree_tokens, node_positions, tcache,
                                        tree_mask=tree_mask)
        scores = self._scores(logits, keys, node_positions + 1)
        verdict = jax.vmap(lambda k, t, v, s: point_mass_tree(k, t[None], v[None], parents, s[None], greedy=greedy))(
            keys, tree_tokens, valid, scores)
        verdict = jax.tree.map(lambda x: x[:, 0], verdict)
        accepted, next_token, nodes = verdict.num_accepted, verdict.next_token, verdict.nodes

        tcache = compact_path(tcache, nodes, jnp.where(active, accepted + 1, 0))
        path_tokens = jnp.take_along_axis(tree_tokens, nodes[:, 1:], axis=1)
        return self._verdict(inner, tcache, path_tokens, accepted, next_token, logits[rows, nodes[rows, accepted]],
                             jnp.sum(valid, axis=1) - 1, active)

    def _scores(self, logits: jax.Array, keys: jax.Array, positions: jax.Array) -> jax.Array:
        """What the point-mass walk reads of the target's logits [B, N, V] at nodes whose tokens'
        positions are int32 [B, N]: logits (argmax decisions, perturbed under the Gumbel coupling)
        or the processed law."""
        if self.sampling.by_argmax:
            return decision_logits(logits, keys, positions, self.sampling)
        return probabilities(logits, self.sampling)

    def _verdict(self, inner, tcache, path_tokens, accepted, next_token, last_logits, drafted, active,
                 forwards=None) -> Verdict:
        """The step's verdict, its emitted tokens appended to the context."""
        context, context_len = append_tokens(inner["context"], inner["context_len"],
                                             emitted_tokens(path_tokens, accepted, next_token),
                                             jnp.where(active, accepted + 1, 0))
        inner = dict(context=context, context_len=context_len, last_logits=last_logits)
        return Verdict(tcache=tcache, inner=inner, chosen=path_tokens, accepted=accepted, next_token=next_token,
                       drafted=drafted, draft_forwards=forwards)

    def _chain_step(self, state: DecodeState, keys: jax.Array, active: jax.Array, cap: jax.Array | None,
                    width: int | None = None) -> Verdict:
        """A prompt-lookup step: one chain per row, verified as a causal block (`point_mass_chain`;
        its accepted nodes are its first tokens, so the cache needs no compaction).

        Capped (`takes_cap`): copies keep at most `cap` tokens and the chain verified is the
        narrowest compiled width holding every active row's copy (no token when no row found one:
        a plain step's cost; then 1 and `verify_caps`), a choice made from the copies alone, so
        each row's verdict stays exact, or where the loop dispatches caps (`dispatch_caps`), its
        `width`. At a batch of several rows a wide verification costs several narrow ones: with
        one static width PLD lost to plain decoding where few rows find a long match.
        draft_forwards counts the chain's tokens past the first (what the loop prices)."""
        L, inner = self.draft_len, state.inner
        b = keys.shape[0]
        rows = jnp.arange(b)
        tree_tokens, valid = self._draft_tree(inner)
        if self.takes_cap:
            valid = valid & (jnp.arange(L + 1)[None, :] <= jnp.clip(cap, 1, L))
        proposed = jnp.sum(valid, axis=1).astype(jnp.int32) - 1
        greedy = self.sampling.by_argmax

        def chain(n: int, tcache):
            """Verification of the first n copied tokens (every row copied at most n)."""
            tokens = tree_tokens[:, :n + 1]
            positions = tcache.lengths[:, None] + jnp.arange(n + 1, dtype=jnp.int32)[None, :]
            logits, tcache = forward_cached(self.tparams, self.tcfg, tokens, positions, tcache)
            scores = self._scores(logits, keys, positions + 1)
            verdict = jax.vmap(lambda k, t, v, s: point_mass_chain(k, t[None], v[None], s[None], greedy=greedy))(
                keys, tokens, valid[:, :n + 1], scores)
            accepted, next_token, _ = jax.tree.map(lambda x: x[:, 0], verdict)
            tcache = commit(tcache, jnp.where(active, accepted + 1, 0))
            return accepted, next_token, logits[rows, accepted], tcache, jnp.asarray(max(n - 1, 0), jnp.int32)

        if width is not None:
            accepted, next_token, last_logits, tcache, forwards = chain(width, state.tcache)
        elif self.takes_cap:
            caps = self.verify_caps
            widths = caps if len(caps) == 1 else (0,) + with_one(caps)
            accepted, next_token, last_logits, tcache, forwards = at_narrowest(
                widths, jnp.max(jnp.where(active, proposed, 0)), chain, state.tcache)
        else:
            (accepted, next_token, last_logits, tcache, _), forwards = chain(L, state.tcache), None
        return self._verdict(inner, tcache, tree_tokens[:, 1:], accepted, next_token, last_logits, proposed, active,
                             forwards)

    # ------------------------------------------------------------ adaptive speculation's fallback

    def ar_step(self, state: DecodeState, keys: jax.Array, active: jax.Array) -> Verdict:
        """A plain decoding step: the target reads cur, the token it samples joins the context."""
        plain = ARParts(tparams=self.tparams, tcfg=self.tcfg, sampling=self.sampling, capacity=self.capacity)
        logits, verdict = plain.logits_and_step(state, keys, active)
        inner = state.inner
        context, context_len = append_tokens(inner["context"], inner["context_len"], verdict.next_token[:, None],
                                             active.astype(jnp.int32))
        return verdict.replace(inner=dict(context=context, context_len=context_len, last_logits=logits))

    # Plain steps learn from shadow walks of the draft (`shadow_tree`), not from scoring a model.
    learns_while_plain = False

    def shadow_tree(self, inner) -> tuple[jax.Array, jax.Array, np.ndarray]:
        """The draft a speculative step would verify now, uncapped: (tokens int32 [B, N], valid
        bool [B, N], parents int [N]), for the loop's shadow evidence during plain decoding
        (`ssd_jax.loop.shadow`)."""
        tokens, valid = self._draft_tree(inner)
        return tokens, valid, np.asarray(self.layout.parents)

    def pending(self, inner) -> tuple[jax.Array, jax.Array]:
        """The missed tokens are in the context: the buffer only bounds plain phases."""
        return unread_count_only(inner["context_len"].shape[0], self.pending_width)

    def resync(self, inner, pending: jax.Array, pending_len: jax.Array):
        return inner

    def scored_resync(self, inner, pending: jax.Array, pending_len: jax.Array, laws: jax.Array, keys: jax.Array):
        """Never called: retrieval does not learn while plain by scoring (`learns_while_plain`)."""
        raise NotImplementedError("retrieval learns from shadow walks, not from scored_resync")


def retrieval_parts(method, tparams: dict, tcfg: ModelConfig, sampling: SamplingParams, prompt_width: int,
                    out_size: int, plan=None) -> RetrievalParts:
    """method: a PLD or LogitSpec object; plan: its `AutoPlan` when draft_len is "auto"."""
    return RetrievalParts(method=method, draft_len=plan.draft_len if plan is not None else method.draft_len,
                          tparams=tparams, tcfg=tcfg, sampling=sampling, prompt_size=prompt_width,
                          out_size=out_size, pending_width=pending_width(plan),
                          capped=plan is not None and plan.capped,
                          auto_tree=plan is not None and method.name == "logitspec")
