"""An exact-law test kit for speculative-decoding verifiers (docs/testing.md).

For tiny vocabularies it computes the exact output law of a verifier by enumeration in float64
(`exact_law`, `single_path_law`, `walk_law`) and checks it against the target's (`assert_exact`);
it runs real jitted verifiers on many vmapped keys and tests the counts against an exact law with
a stated false-failure rate (`sampled_counts`, `g_test`, `assert_sampled`); and it carries
planted bugs both checks must reject (`ssd_jax.testing.controls`). The library never imports it.
"""

from ssd_jax.testing.cascade import CascadeSetup
from ssd_jax.testing.controls import CONTROLS, Control
from ssd_jax.testing.enumeration import (Emissions, block_stop_prob, expected_accepted, law_of_stops,
                                         multi_path_inputs, single_path_inputs, single_path_law,
                                         tokenwise_stop_prob, walk_law, x64)
from ssd_jax.testing.exact_law import NAMES, assert_exact, block_rule, exact_law, greedy_rule, tokenwise_rule
from ssd_jax.testing.point_mass import PointTree, chain, draft_chain, draft_tree
from ssd_jax.testing.sampled_law import (DEFAULT_ALPHA, GTest, Sample, assert_sampled, g_test, g_threshold,
                                         iid_sampler, power, run_sampler, sampled_counts)
from ssd_jax.testing.ssd import SSDSetup, sigma_levels
from ssd_jax.testing.tables import Tables, extend, iid_tables, law_distance, processed_tables, random_tables, target_law
from ssd_jax.testing.widen import widen

__all__ = [
    # tables and laws
    "Tables", "random_tables", "iid_tables", "processed_tables", "target_law", "extend", "law_distance",
    # exact laws
    "NAMES", "exact_law", "assert_exact", "tokenwise_rule", "block_rule", "greedy_rule", "single_path_law",
    "walk_law", "single_path_inputs", "multi_path_inputs", "law_of_stops", "Emissions", "tokenwise_stop_prob",
    "block_stop_prob", "expected_accepted", "x64",
    # drafts and setups
    "PointTree", "chain", "draft_tree", "draft_chain", "CascadeSetup", "SSDSetup", "sigma_levels",
    # sampled laws
    "sampled_counts", "run_sampler", "iid_sampler", "Sample", "g_test", "g_threshold", "GTest",
    "assert_sampled", "power", "DEFAULT_ALPHA",
    # negative controls
    "CONTROLS", "Control",
    # cost-faithful targets (benchmarks)
    "widen",
]
