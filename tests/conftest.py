"""Shared fixtures: tiny random Hugging Face checkpoints per family, made once per session."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# The suite compiles hundreds of small programs that then run for milliseconds, so LLVM's
# optimizations cost more than they save (about a fifth of the suite's time), and XLA:CPU's MLIR
# fusion emitters compile slower than its older elemental ones (a quarter of the backend compile
# time of the decode loops' tests: 83 s against 60 s on three of their modules). XLA reads the
# flags when jax starts its backend, i.e. after this; subprocesses inherit them
# (subprocess_env.py). Exactness tests compare programs built with the same flags.
# SSD_JAX_TEST_XLA_DEFAULTS=1 keeps XLA's defaults.
if os.environ.get("SSD_JAX_TEST_XLA_DEFAULTS") != "1":
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0",
                                        "--xla_llvm_disable_expensive_passes=true",
                                        "--xla_cpu_use_fusion_emitters=false"]).strip()

# The default tuner is deterministic: "auto" decides from fixed relative costs, not timings
# (`ssd_jax.Tuner(deterministic=True)`): exactness never depends on the costs, and measuring them
# for every new program would add minutes to the suite. The tests of the measurements install a
# measuring tuner of their own (`tuning_helpers.measuring`).
os.environ["SSD_JAX_DETERMINISTIC_AUTO"] = "1"
# Calibrations stay in memory (`ssd_jax.runtime.calibration_store`): a test of the measurements
# must measure, not find a file an earlier run left in ~/.cache.
os.environ["SSD_JAX_CALIBRATION_DIR"] = ""
# The command line's default compile cache (~/.cache/ssd_jax/xla) is not the tests' to fill: the
# command lines they run use the run's own cache below, or none.
os.environ.setdefault("SSD_JAX_COMPILE_CACHE", "")
# One persistent XLA compilation cache per run, shared by the xdist workers and the tests'
# subprocesses (they inherit the variable; the process that made the folder removes it): many
# tests compile the same program through closures of their own, and the subprocesses (notebook,
# main job, meshes) compile what a worker already did. A new folder each run, so no run reads
# another's programs. SSD_JAX_TEST_XLA_CACHE=0 turns it off.
if os.environ.get("SSD_JAX_TEST_XLA_CACHE") != "0" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _xla_cache = tempfile.mkdtemp(prefix="ssd_jax_test_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _xla_cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
    atexit.register(shutil.rmtree, _xla_cache, ignore_errors=True)

from hf_models import FAMILY_CONFIGS, make_hf_model  # noqa: E402

from ssd_jax.tuning import measure  # noqa: E402

# The tests that measure (with a measuring tuner) check what is measured and what
# the loop decides from it, not how steady the prices are: 3 calibration rounds (their trimmed
# mean is the median) instead of 7. The embedded target's SD program calibrated in 16 s instead
# of 27 s under the suite's XLA flags (test_a_random_draft_falls_back_to_plain_decoding).
measure._CALIBRATION_ROUNDS = 3

_MADE: dict = {}


@pytest.fixture(autouse=True)
def loop_every_call(monkeypatch):
    """Every "auto" call runs its adaptive loop: a verdict that a program's calls start plainly
    (`ssd_jax.tuning.plain_verdicts`) is a memory across calls, which would make a test that
    measures depend on how the calls before it (its own) happened to decide.
    test_calls_whose_loop_decoded_plainly_start_plain sets the threshold it tests."""
    from ssd_jax.tuning import plain_verdicts

    monkeypatch.setattr(plain_verdicts, "PLAIN_SHARE", float("inf"))


@pytest.fixture(scope="session")
def hf_family(tmp_path_factory):
    """family name -> (directory, torch model); each made on first use."""

    def get(family: str):
        if family not in _MADE:
            directory = str(tmp_path_factory.mktemp(f"hf_{family}"))
            _MADE[family] = (directory, make_hf_model(family, directory))
        return _MADE[family]

    return get


@pytest.fixture(params=sorted(FAMILY_CONFIGS))
def family(request):
    return request.param


# The default run (`pytest -q`, CI's command) keeps one or two cases of each large matrix below;
# `pytest -q -m slow` runs the rest (every method x temperature of decode-in-jit, every bf16
# method, every family's parity and lossless case). The multi-device SSD scripts (8-9 s each) stay
# in the default run: slow-marked, their script went stale against an engine signature unnoticed.
# Entries are node ids relative to tests/, or a test function's id to mark all its cases.
SLOW = {
    "test_decode.py::test_decode_in_user_jit_equals_generate_and_greedy_ar": {
        "ar-0.0", "ar-1.0", "sd-0.0", "bv-0.0", "bv-1.0", "specinfer-0.0", "specinfer-1.0", "spectr-0.0",
        "spectr-1.0", "gbv-0.0", "gbv-1.0", "pld-0.0", "pld-1.0", "logitspec-0.0", "logitspec-1.0", "csd-0.0",
        "csd-1.0"},
    "test_backend.py::test_bfloat16_greedy_identity_with_bfloat16_ar": {
        "bv", "specinfer", "spectr", "gbv", "pld", "csd", "logitspec"},
    "test_ssd.py::test_greedy_equals_autoregressive_batched_and_alone": {"options1", "options3", "options4"},
    "test_ssd.py::test_speculation_cache_equals_a_synchronous_draft": {"1.0-1.0", "0.8-0.4"},
    "test_ssd.py::test_sampled_law_equals_target_law": {"options1"},
    "test_speculative.py::test_greedy_equals_autoregressive_batched_and_alone": {"gbv-options5"},
    "test_speculative.py::test_target_cache_equals_fresh_prefill_of_the_emitted_text": {"bv-options1-0.0"},
    "test_cascade.py::test_greedy_equals_autoregressive_batched_and_alone": {"1-options0-True", "2-options2-True"},
    "test_cascade.py::test_drafters_equal_to_the_target_get_every_draft_token_accepted": None,
    "test_cascade.py::test_sampled_law_equals_target_law": {"2-options1"},
    "test_cascade.py::test_default_lenience_depends_on_temperature": {"1.0-1.0"},
    "test_retrieval.py::test_greedy_equals_autoregressive_batched_and_alone": {"logitspec-options3", "pld-options1"},
    "test_convert.py::test_round_trip_through_ours_gives_same_logits": {"qwen2", "mistral", "llama_mqa_tied"},
    "test_parity.py::test_ragged_batch_equals_rows_alone": {"gpt2"},
    "test_families.py::test_family_matches_transformers_and_converts_both_ways": {"gemma", "gemma3_text", "phi3"},
    "test_families_lossless.py::test_greedy_equals_autoregressive": {
        "gemma-gemma-sd", "gemma2-gemma2-bv", "gemma3_text-gemma3_text-gbv", "phi3-phi3-specinfer", "mixtral-mixtral-spectr",
        "gemma2-mixtral-csd",
        "gemma3_text-None-pld", "phi3-None-logitspec"},
    "test_ssd.py::test_embedded_pair_greedy_equals_autoregressive": None,
    "test_ssd.py::test_sampled_law_with_top_k": None,
    "test_pallas_attention.py::test_greedy_decoding_through_the_kernel_equals_the_reference": {"sd", "logitspec"},
    "test_ssd.py::test_auto_remembers_that_ssd_was_slower": {"True"},
    "test_adaptive.py::test_speculation_up_to_the_end_of_a_cache_without_room": {"sd", "specinfer"},
    "test_adaptive.py::test_sampled_law_with_adaptive_lengths": {"csd-chosen-caps", "sd-early-stop"},
    "test_adaptive.py::test_speculation_that_never_pays_never_probes": {"specinfer", "csd-lenience-1"},
    "test_adaptive.py::test_gpu_loop_choices_are_exact_greedy": {"1-pld", "1-csd", "1-sd"},
    "test_streaming.py::test_streamed_auto_is_greedy_exact": {"csd"},
    # EAGLE: the default run keeps two tree shapes, and decode-in-jit fixed at T=0/1 and auto at T=1;
    # the command line's training is the library's train_head behind argparse (one case kept:
    # test_training_lowers_the_loss_and_raises_acceptance).
    "test_eagle.py::test_greedy_equals_autoregressive_batched_and_alone": {"chain1", "d2k4n9"},
    "test_eagle.py::test_decode_in_user_jit_equals_generate": {"auto-0.0"},
    "test_eagle_training.py::test_the_command_line_trains_a_head": None,
    "test_auto_shape.py::test_chosen_paths_keep_greedy_output": {"specinfer", "spectr"},
    "test_verify_api.py::test_large_vocabulary_many_paths_long_drafts": None,
    "test_cascade.py::test_embedded_models_greedy_equals_autoregressive": None,
    # Each case measures and calibrates with a tuner of its own: the default run keeps four (CSD's
    # plan is replayed in the default run by the deterministic tuner's case).
    "test_plan.py::test_decode_replays_the_plan_of_a_measuring_generate": {
        "ar-0.0", "ar-1.0", "sd-0.0", "bv-0.0", "bv-1.0", "specinfer-0.0", "spectr-0.0", "gbv-0.0", "gbv-1.0",
        "pld-1.0", "logitspec-0.0", "csd-0.0", "spectr-1.0", "csd-1.0", "specinfer-1.0"},
    "test_plan.py::test_decode_without_a_plan_is_a_deterministic_tuner_s_generate": {"sd"},
    # Each case compiles and measures its method: the default run keeps one method of each kind
    # at T=1 (a draft chain, a tree: EAGLE's, retrieval, SSD) and a tree under top_p; the cascade's coupled
    # decoding stays in the default run through test_decode_in_a_user_jit_equals_generate_without_a_plan.
    "test_coupling.py::test_every_method_at_its_defaults_gives_coupled_ar_tokens": {
        "bv-t1", "specinfer-t1", "spectr-t1", "gbv-t1", "logitspec-t1", "csd-t1", "sd-t07-p09", "bv-t07-p09", "specinfer-t07-p09",
        "spectr-t07-p09", "pld-t07-p09", "logitspec-t07-p09", "csd-t07-p09", "ssd-t07-p09"},
    "test_coupling.py::test_decode_in_a_user_jit_equals_generate_without_a_plan": {"sd"},
    "test_coupling.py::test_a_draft_equal_to_the_target_is_always_accepted": {"gbv"},
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        function_id = item.nodeid.split("tests/", 1)[-1].split("[", 1)[0]
        if function_id not in SLOW:
            continue
        cases = SLOW[function_id]
        case = item.nodeid.split("[", 1)[1].rstrip("]") if "[" in item.nodeid else None
        if cases is None or case in cases:
            item.add_marker(pytest.mark.slow)
