"""Exact verifiers for speculative decoding: pure, jit-able, vmappable functions over static
shapes that decide what one speculative step emits.

Single path:  f(key, draft_tokens [B, L], q [B, L, V], p [B, L+1, V]) -> VerifyResult
    greedy, tokenwise, block
Multi-path:   f(key, paths [B, K, L], q [B, K, L, V], p [B, K, L+1, V]) -> VerifyResult
    greedy_multipath, specinfer, spectr, gbv

Every sampling verifier emits paths[path_index][:num_accepted] + [next_token] with exactly the
target's law (see `ssd_jax.testing`, the exact-law kit, and tests/test_law_kit.py).
The `*_tables`, `*_node` and `skewed_draft` functions expose each verifier's deterministic part.
"""

from ssd_jax.verify.block import block, block_tables
from ssd_jax.verify.gbv import gbv, skewed_draft
from ssd_jax.verify.greedy import greedy, greedy_multipath
from ssd_jax.verify.result import VerifyResult
from ssd_jax.verify.specinfer import specinfer, specinfer_node
from ssd_jax.verify.spectr import spectr, spectr_node, spectr_rho
from ssd_jax.verify.tokenwise import tokenwise, tokenwise_tables

SINGLE_PATH = {"greedy": greedy, "tokenwise": tokenwise, "block": block}
MULTI_PATH = {"greedy_multipath": greedy_multipath, "specinfer": specinfer, "spectr": spectr,
              "gbv": gbv}

__all__ = [
    "VerifyResult", "greedy", "tokenwise", "block", "greedy_multipath", "specinfer", "spectr",
    "gbv", "block_tables", "tokenwise_tables", "skewed_draft", "specinfer_node", "spectr_node",
    "spectr_rho", "SINGLE_PATH", "MULTI_PATH",
]
