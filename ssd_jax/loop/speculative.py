"""Draft-model speculative decoding's parts for the decode skeleton, single-path and multi-path.

Each step: the draft catches up on last step's emitted tokens and drafts K paths of L tokens ->
the target scores them in one forward (a linear block for K = 1, a token tree otherwise) ->
a verifier decides (accepted count, next token, path) -> both caches are rolled back or the
accepted path compacted.

Invariant at the top of a step, per row: the target cache holds every emitted token but the last
one, `cur`, which sits at position P = target lengths. The draft cache holds the same text minus
the tokens in `chunk` (chunk[:chunk_len], ending with cur), which it processes first.
Random keys per step key s: draft fold_in(s, 1) split K ways, verify fold_in(s, 2). Under the
Gumbel coupling s is the row key, the noise key of every draft and verify decision.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from ssd_jax import verify
from ssd_jax.backend import policy_for
from ssd_jax.coupling import decision_logits
from ssd_jax.draft.model_chain import draft_path_until_unsure, draft_paths
from ssd_jax.draft.vocab import align_logits
from ssd_jax.loop.caps import at_narrowest, compiled_caps, pending_width, with_one
from ssd_jax.loop.autoregressive import ARParts
from ssd_jax.loop.emission import emitted_tokens
from ssd_jax.loop.shadow import scored_tokens
from ssd_jax.loop.skeleton import DecodeState, Verdict, fold_rows, prefill
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.kv_cache import commit, compact_path, rollback
from ssd_jax.models.transformer import forward_cached
from ssd_jax.sampling import SamplingParams, probabilities
from ssd_jax.tree import build_tree, gather_path_rows, path_nodes

# method name -> (verifier at temperature > 0, multi-path?)
SPECULATIVE_METHODS: dict[str, tuple[Callable, bool]] = {
    "sd": (verify.tokenwise, False),
    "bv": (verify.block, False),
    "specinfer": (verify.specinfer, True),
    "spectr": (verify.spectr, True),
    "gbv": (verify.gbv, True),
}


# A multi-path method with one path is its single-path counterpart: SpecInfer's recursive
# rejection and SpecTr's k-sequential rule with one candidate are token-level speculative
# sampling, and GBV with one path is block verification (`verify.gbv`). The tree walk verifies
# every drafted token; verified as a single path, a step whose draft was capped below the planned
# length (one path under "auto") masks the unproposed tail (`lengths=`), where the walk would
# verify padding as if it were drafted.
SINGLE_PATH_FORM = {"specinfer": "sd", "spectr": "sd", "gbv": "bv"}


def verifier_for(method: str, sampling: SamplingParams) -> Callable:
    multi = SPECULATIVE_METHODS[method][1]
    if sampling.by_argmax:
        return verify.greedy_multipath if multi else verify.greedy
    return SPECULATIVE_METHODS[method][0]


def _per_row(verifier: Callable, key, *arrays) -> verify.VerifyResult:
    """Runs a verifier row by row (each with its own key) so a row's verdict never depends on
    the batch it is in."""
    result = jax.vmap(lambda k, *xs: verifier(k, *[x[None] for x in xs]))(key, *arrays)
    return jax.tree.map(lambda x: x[:, 0], result)


@dataclasses.dataclass(frozen=True)
class SpeculativeParts:
    """Draft-model speculation: method name, draft length L, paths K; the draft's params and
    config; static buffer sizes. inner state: dict(dcache, chunk int32 [B, W], chunk_len [B]).
    threshold: None (every row drafts L tokens), or single-path early stop per row
    (`draft_path_until_unsure`). pending_width: > 0 under adaptive speculation, the most tokens
    the draft may lag behind after steps that fell back to plain decoding (`ar_step`, `resync`)."""

    method: str
    num_draft_tokens: int
    num_paths: int
    tparams: dict
    tcfg: ModelConfig
    dparams: dict
    dcfg: ModelConfig
    sampling: SamplingParams
    capacity: int
    threshold: float | None = None
    pending_width: int = 0

    @property
    def verify_method(self) -> str:
        """The method whose verifier this step runs: the method, or with one path its
        single-path form (`SINGLE_PATH_FORM`)."""
        return SINGLE_PATH_FORM.get(self.method, self.method) if self.num_paths == 1 else self.method

    @property
    def multi_path(self) -> bool:
        return SPECULATIVE_METHODS[self.verify_method][1]

    @property
    def room(self) -> int:
        return self.num_paths * self.num_draft_tokens + 1

    @property
    def chain_writes(self) -> bool:
        """One path is verified as a causal block; several as a tree (`ssd_jax.loop.skeleton`)."""
        return not self.multi_path

    @property
    def draft_len(self) -> int:
        return self.num_draft_tokens

    drafts_with_model = True

    @property
    def scan_caps_from_batch(self) -> int:
        """The batch from which a capped single-path step drafts in one `lax.scan` per compiled
        cap (`_per_cap_step`) instead of the early-stopping `while_loop` (the backend
        policy's `adaptive_scan_from_batch`)."""
        return policy_for(self.tparams).adaptive_scan_from_batch

    @property
    def unroll_draft_steps(self) -> bool:
        """Draft the L - 1 forwards unrolled (the backend policy's `unroll_draft_steps`)."""
        return policy_for(self.dparams).unroll_draft_steps

    @property
    def verify_caps(self) -> tuple[int, ...]:
        """The draft lengths verification is compiled for (`compiled_caps` when drafts vary in
        length, `takes_cap`; else L alone)."""
        return compiled_caps(self.num_draft_tokens) if self.takes_cap else (self.num_draft_tokens,)

    @property
    def takes_cap(self) -> bool:
        """Whether `step` honours a per-step cap on the draft length (single paths with the early
        stop: the adaptive loop's choice)."""
        return self.threshold is not None

    def dispatch_caps(self, batch: int) -> tuple[int, ...] | None:
        """The caps the adaptive loop compiles one step for and dispatches on once per run of steps
        at that cap (`step(width=n)`): 1 and `verify_caps` where a step drafts its cap in one scan
        (batch >= scan_caps_from_batch, single path); None where each step picks its own width."""
        if not self.takes_cap or batch < self.scan_caps_from_batch or self.multi_path:
            return None
        return with_one(self.verify_caps)

    def gates(self, batch: int) -> bool:
        """Never: every step drafts with the model."""
        return False

    @property
    def counter_width(self) -> int:
        return self.num_draft_tokens

    def init(self, tokens, lengths, first, logits):
        b, K = tokens.shape[0], self.num_paths
        _, dcache = prefill(self.dparams, self.dcfg, jnp.repeat(tokens, K, axis=0), jnp.repeat(lengths, K),
                            self.capacity)
        chunk_width = self.num_draft_tokens + 1 if self.multi_path else 2
        chunk = jnp.zeros((b, chunk_width), jnp.int32).at[:, 0].set(first)
        return dict(dcache=dcache, chunk=chunk, chunk_len=jnp.ones((b,), jnp.int32))

    def step(self, state: DecodeState, keys: jax.Array, active: jax.Array, cap: jax.Array | None = None,
             width: int | None = None) -> Verdict:
        """One speculative step; cap int32 []: the most tokens a row drafts (`takes_cap` parts);
        width: the compiled cap (one of `dispatch_caps`, >= cap) the step drafts and verifies at,
        None: chosen per step."""
        L, K, vocab = self.num_draft_tokens, self.num_paths, self.tcfg.vocab_size
        tcache, cur, inner = state.tcache, state.cur, state.inner
        b = cur.shape[0]
        if self.sampling.coupled:
            draft_keys, verify_keys = jnp.repeat(keys, K, axis=0), keys
        else:
            draft_keys = jax.vmap(lambda k: jax.random.split(jax.random.fold_in(k, 1), K))(keys).reshape(b * K, 2)
            verify_keys = fold_rows(keys, 2)
        position = tcache.lengths  # of cur

        if self.takes_cap and b >= self.scan_caps_from_batch and not self.multi_path:
            return self._per_cap_step(state, draft_keys, verify_keys, active, cap, width)
        if self.threshold is None:
            paths, q, dcache = draft_paths(
                self.dparams, self.dcfg, inner["dcache"], jnp.repeat(inner["chunk"], K, axis=0),
                jnp.repeat(inner["chunk_len"], K), draft_keys, num_draft_tokens=L, sampling=self.sampling,
                target_vocab=vocab, unroll=self.unroll_draft_steps, branch=K if self.sampling.coupled else 1,
            )
            lengths = jnp.full((b,), L, jnp.int32)
            forwards = jnp.asarray(L - 1, jnp.int32)
        else:
            paths, q, lengths, forwards, dcache = draft_path_until_unsure(
                self.dparams, self.dcfg, inner["dcache"], inner["chunk"], inner["chunk_len"], draft_keys, active,
                max_draft_tokens=L, threshold=self.threshold, sampling=self.sampling, target_vocab=vocab,
                limit=cap,
            )
        paths = paths.reshape(b, K, L)
        q = q.reshape(b, K, L, vocab)

        if self.multi_path:
            tree = build_tree(cur, paths)
            node_positions = position[:, None] + tree.depth
            logits, tcache = forward_cached(self.tparams, self.tcfg, tree.tokens, node_positions, tcache,
                                            tree_mask=tree.mask)
            logits = decision_logits(logits, verify_keys, node_positions + 1, self.sampling)
            p = gather_path_rows(probabilities(logits, self.sampling), tree)
            result = _per_row(verifier_for(self.verify_method, self.sampling), verify_keys, paths, q, p)
            keep = jnp.where(active, result.num_accepted + 1, 0)
            tcache = compact_path(tcache, path_nodes(tree, result.path_index), keep)
        else:
            def verify_block(n: int, tcache):
                """Verification of the first n draft tokens (every row proposed at most n)."""
                return self._verify_path(tcache, cur, paths[:, 0, :n], q[:, 0, :n], lengths, active, verify_keys)

            widths = with_one(self.verify_caps) if self.takes_cap else self.verify_caps
            result, tcache = at_narrowest(widths, jnp.max(jnp.where(active, lengths, 0)), verify_block, tcache)
            return self._after_single_path(position, paths[:, 0], lengths, result, tcache, dcache, forwards)

        accepted, next_token = result.num_accepted, result.next_token
        chosen = paths[jnp.arange(b), result.path_index]
        # Every path copy rolls back to just after cur and re-reads the accepted tokens.
        dcache = rollback(dcache, jnp.repeat(position + 1, K))
        chunk = emitted_tokens(chosen, accepted, next_token)
        chunk_len = accepted + 1
        inner = dict(dcache=dcache, chunk=chunk, chunk_len=chunk_len.astype(jnp.int32))
        return Verdict(tcache=tcache, inner=inner, chosen=chosen, accepted=accepted, next_token=next_token,
                       drafted=lengths, draft_forwards=forwards)

    def _per_cap_step(self, state: DecodeState, draft_keys: jax.Array, verify_keys: jax.Array,
                           active: jax.Array, cap: jax.Array, width: int | None) -> Verdict:
        """A single-path step with the loop's cap: one program per compiled cap n (`dispatch_caps`:
        the loop's `width`, else a `lax.switch` here), drafting n tokens in a `lax.scan` and
        verifying n + 1, the narrowest holding the cap (rows propose min(cap, n) tokens). A
        batch's draft forwards run until its last row stops, so the per-row early stop saves
        nothing in a batch, while its `while_loop` costs more than a fixed-length scan of the same
        cap. And the per-step verification switch of the `while_loop` path passes the target's KV
        cache through a conditional, which XLA:CPU copies in and out every step; one program per
        cap, dispatched per run of steps, does not."""
        L, vocab = self.num_draft_tokens, self.tcfg.vocab_size
        tcache, cur, inner = state.tcache, state.cur, state.inner
        b = cur.shape[0]
        limit = jnp.clip(cap, 1, L)

        def capped(n: int, tcache, dcache):
            paths, q, dcache = draft_paths(
                self.dparams, self.dcfg, dcache, inner["chunk"], inner["chunk_len"], draft_keys,
                num_draft_tokens=n, sampling=self.sampling, target_vocab=vocab, unroll=self.unroll_draft_steps)
            # Every row proposes all it drafted, up to the cap: the forwards and the verified
            # width are spent whatever the draft's confidence, and a proposal cut at its first
            # unsure token (`draft_path_until_unsure`'s rule) only gives up tokens.
            if width is None:
                proposed = jnp.where(active, jnp.minimum(limit, n), 0).astype(jnp.int32)
            else:
                # Dispatched per run of steps, the loop's caps are the dispatched widths, so every
                # row proposes n, a constant as in a fixed-length program (the verifier's masks and
                # gathers then fold as they do there); rows that are done are not counted.
                proposed = jnp.full((b,), n, jnp.int32)
            result, tcache = self._verify_path(tcache, cur, paths, q, proposed, active, verify_keys)
            padded = jnp.zeros((b, L), jnp.int32).at[:, :n].set(paths)
            return result, tcache, dcache, padded, proposed, jnp.asarray(n - 1, jnp.int32)

        result, tcache, dcache, paths, lengths, forwards = at_narrowest(
            (width,) if width is not None else with_one(self.verify_caps), limit, capped, tcache, inner["dcache"])
        return self._after_single_path(state.tcache.lengths, paths, lengths, result, tcache, dcache, forwards)

    def _verify_path(self, tcache, cur, paths, q, lengths, active, verify_keys):
        """Verifies one path per row in one target forward of cur and paths int32 [B, n] (q float32
        [B, n, V] their draft laws, lengths int32 [B] proposed); returns (VerifyResult, tcache with
        each active row's accepted tokens and cur committed)."""
        n = paths.shape[1]
        block = jnp.concatenate([cur[:, None], paths], axis=1)
        block_positions = tcache.lengths[:, None] + jnp.arange(n + 1, dtype=jnp.int32)[None, :]
        logits, tcache = forward_cached(self.tparams, self.tcfg, block, block_positions, tcache)
        logits = decision_logits(logits, verify_keys, block_positions + 1, self.sampling)
        result = _per_row(verifier_for(self.verify_method, self.sampling), verify_keys, paths, q,
                          probabilities(logits, self.sampling), lengths)
        return result, commit(tcache, jnp.where(active, result.num_accepted + 1, 0))

    def _after_single_path(self, position, paths, lengths, result, tcache, dcache, forwards) -> Verdict:
        """The verdict of a single-path step (paths int32 [B, L], lengths int32 [B] proposed):
        the draft cache rolled back to what was accepted, the next chunk."""
        accepted, next_token = result.num_accepted, result.next_token
        # The draft cache holds cur and paths[:n-1] (n = the row's length); when all n were
        # accepted it still lacks the last draft token, which joins the bonus token in the
        # next chunk. A row that proposed nothing is a rejection at 0.
        all_accepted = (accepted == lengths) & (lengths > 0)
        dcache = rollback(dcache, jnp.where(all_accepted, position + lengths, position + 1 + accepted))
        last = paths[jnp.arange(paths.shape[0]), jnp.maximum(lengths - 1, 0)]
        chunk = jnp.where(all_accepted[:, None], jnp.stack([last, next_token], 1),
                          jnp.stack([next_token, next_token], 1))
        chunk_len = jnp.where(all_accepted, 2, 1)
        inner = dict(dcache=dcache, chunk=chunk, chunk_len=chunk_len.astype(jnp.int32))
        return Verdict(tcache=tcache, inner=inner, chosen=paths, accepted=accepted, next_token=next_token,
                       drafted=lengths, draft_forwards=forwards)

    # ------------------------------------------------------------ adaptive speculation's fallback

    shadow_tree = None   # a draft model's proposals are not known during plain steps

    @property
    def learns_while_plain(self) -> bool:
        """Whether plain steps record their tokens' target probabilities for `scored_resync`: where
        a step's acceptance is token-wise, one path (SD), or any method at T=0, where every
        verifier accepts the draft's token exactly where it is the target's argmax."""
        return self.sampling.by_argmax or self.method == "sd"

    def ar_step(self, state: DecodeState, keys: jax.Array, active: jax.Array) -> Verdict:
        """A plain decoding step (the target alone); the draft is left behind, see `resync`."""
        plain = ARParts(tparams=self.tparams, tcfg=self.tcfg, sampling=self.sampling, capacity=self.capacity)
        return plain.step(state, keys, active, with_law=self.learns_while_plain).replace(inner=state.inner)

    def pending(self, inner) -> tuple[jax.Array, jax.Array]:
        """The tokens the draft has not read, int32 [B, pending_width] (the chunk, ending with
        cur), and their count int32 [B]: where plain-decoding steps append what they emit."""
        chunk = inner["chunk"]
        width = self.pending_width
        return jnp.zeros((chunk.shape[0], width), jnp.int32).at[:, :chunk.shape[1]].set(chunk), inner["chunk_len"]

    def resync(self, inner, pending: jax.Array, pending_len: jax.Array):
        """The draft reads every pending token but the last (cur), which becomes the chunk."""
        return self._read_pending(inner, pending, pending_len, all_logits=False)[0]

    def scored_resync(self, inner, pending: jax.Array, pending_len: jax.Array, laws: jax.Array, keys: jax.Array):
        """`resync`, scoring the draft on the tokens plain steps drew: laws float32 [B, W] (W =
        pending_width) holds each such token's target probability (`Verdict.token_law`; 0 where
        a slot's token was not drawn by a plain step); keys uint32 [B, 2]: the row keys. Returns
        (inner, acceptance, known) (`ssd_jax.loop.shadow.scored_tokens`, the draft's law after
        each slot)."""
        start = inner["dcache"].lengths[::self.num_paths]
        inner, logits = self._read_pending(inner, pending, pending_len, all_logits=True)
        logits = align_logits(logits[::self.num_paths, :-1], self.tcfg.vocab_size)
        slots = start[:, None] + 1 + jnp.arange(logits.shape[1], dtype=jnp.int32)[None, :]
        logits = decision_logits(logits, keys, slots, self.sampling)
        return (inner, *scored_tokens(logits, pending, laws, pending_len, self.sampling))

    def _read_pending(self, inner, pending: jax.Array, pending_len: jax.Array, all_logits: bool):
        """(inner after the draft read pending[:, :pending_len - 1], the draft's logits float32
        [B * K, W, Vd] after each slot where all_logits, else None)."""
        K = self.num_paths
        dcache = inner["dcache"]
        width = pending.shape[1]
        # Slots past pending_len hold padding that is never committed; their positions are
        # clamped so a model with learned position embeddings never reads past its table.
        positions = jnp.minimum(dcache.lengths[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :],
                                self.dcfg.max_position_embeddings - 1)
        indices = None if all_logits else jnp.zeros((dcache.lengths.shape[0], 1), jnp.int32)
        logits, dcache = forward_cached(self.dparams, self.dcfg, jnp.repeat(pending, K, axis=0), positions, dcache,
                                        logit_indices=indices)
        dcache = commit(dcache, jnp.repeat(pending_len - 1, K))
        cur = jnp.take_along_axis(pending, (pending_len - 1)[:, None], axis=1)[:, 0]
        chunk = jnp.zeros_like(inner["chunk"]).at[:, 0].set(cur)
        inner = dict(dcache=dcache, chunk=chunk, chunk_len=jnp.ones_like(inner["chunk_len"]))
        return inner, logits if all_logits else None


def speculative_parts(method, tparams: dict, tcfg: ModelConfig, dparams: dict, dcfg: ModelConfig,
                      sampling: SamplingParams, prompt_width: int, out_size: int, plan=None) -> SpeculativeParts:
    """method: an SD, BV, SpecInfer, SpecTr or GBV object; plan: its `AutoPlan` when draft_len
    is "auto" (then the parts can fall back to plain decoding, `ssd_jax.loop.adaptive_loop`)."""
    K = method.paths
    L = plan.draft_len if plan is not None else method.draft_len
    pending = pending_width(plan)
    return SpeculativeParts(method=method.name, num_draft_tokens=L, num_paths=K, tparams=tparams, tcfg=tcfg,
                            dparams=dparams, dcfg=dcfg, sampling=sampling,
                            capacity=prompt_width + out_size + 2 * K * L + 4 + pending,
                            threshold=plan.threshold if plan is not None else None, pending_width=pending)
