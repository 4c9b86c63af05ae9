"""Adaptive speculation's calibrations kept on disk (`ssd_jax.runtime.calibration_store`): measured
once per program and machine, found again by a new process, never read half-written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import jax
import numpy as np
import pytest

import ssd_jax
from ssd_jax.tuning import cost_model, measure
from ssd_jax.tuning import tuner as tuner_module
from ssd_jax.tuning.tuner import Tuner
from tuning_helpers import measuring
from ssd_jax.tuning import against_ar
from ssd_jax.runtime import calibration_store
from spec_models import pair

TESTS = os.path.dirname(__file__)
ROOT = os.path.dirname(TESTS)

# One PLD "auto" call on the adaptive tests' tiny pair; prints the loop's measured costs and how
# many times the program was calibrated.
SCRIPT = """
import json
import ssd_jax
from ssd_jax.tuning import measure
from spec_models import pair

from ssd_jax.tuning import against_ar
from ssd_jax.runtime import calibration_store

# Never checked against AR's program: its ratio, kept on disk too, is another test's subject (and
# on a loaded machine a first process can measure it implausible and keep nothing).
against_ar.GAIN_CHECK = float("inf")
measured, saved = [], []
calibrate, save = measure._calibrate, calibration_store.save
measure._calibrate = lambda *args, **kwargs: measured.append(1) or calibrate(*args, **kwargs)
calibration_store.save = lambda path, values: saved.append(path) or save(path, values)
target, _ = pair(vocab=64, seed=0, noise=0.3)
out = ssd_jax.generate(target, [[3, 4, 5, 3, 4]], max_new_tokens=16, method=ssd_jax.PLD(draft_len="auto"))
print(json.dumps(dict(costs=out.stats["loop_costs"][:3], calibrations=len(measured), saved=len(saved),
                      forward=[measure.forward_seconds(ssd_jax.default_tuner(), target, 1, w, 5) for w in (1, 9)])))
"""


def _call(directory, xla_cache) -> dict:
    """The script in a new process, calibrations kept in `directory`, with JAX's persistent
    compilation cache in `xla_cache` (every program of the second call is read back from it)."""
    env = {k: v for k, v in os.environ.items() if k != tuner_module.DETERMINISTIC_ENV}
    env.update({calibration_store.DIR_ENV: str(directory), "PYTHONPATH": os.pathsep.join([TESTS, ROOT]),
                "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(xla_cache),
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_new_process_finds_the_calibration(tmp_path):
    """Also where the new process reads the compiled program from JAX's persistent compilation
    cache (Colab and TPU users turn it on), whose text has fewer stack frames than a fresh
    compile's: the calibration is named by what the program computes. The per-forward timings
    the cost model starts from are found too: the second process measures nothing."""
    store, xla_cache = tmp_path / "calibrations", tmp_path / "xla"
    first = _call(store, xla_cache)
    files = sorted(os.listdir(store))
    forward = [name for name in files if name.startswith("forward-")]
    # The loop's calibration, and the target's forward timed at 1 and at L + 1 tokens.
    assert first["calibrations"] == 1 and len(files) == 3 and len(forward) == 2
    assert all(name.endswith(".json") for name in files) and first["saved"] == 3
    assert os.listdir(xla_cache)
    second = _call(store, xla_cache)
    assert second["calibrations"] == 0 and second["saved"] == 0
    assert second["costs"] == first["costs"] and second["forward"] == first["forward"]
    assert sorted(os.listdir(store)) == files


def test_the_entry_name_ignores_debug_information_only():
    """program_text drops the source tables and each instruction's metadata, and keeps the rest."""
    text = "\n".join([
        "HloModule jit_f, entry_computation_layout={(f32[4]{0})->f32[4]{0}}", "", "FileNames", '1 "/a/b.py"', "",
        "FileLocations", "1 {file_name_id=1 function_name_id=1 line=3 end_line=3 column=4 end_column=42}", "",
        "StackFrames", "1 {file_location_id=1 parent_frame_id=1}", "",
        "ENTRY %main (x: f32[4]) -> f32[4] {",
        "  %x = f32[4]{0} parameter(0), metadata={op_name=\"x\"}",
        '  ROOT %s = f32[4]{0} sine(%x), metadata={op_name="jit(f)/sin {odd}" source_line=3 stack_frame_id=1}',
        "}"])
    assert calibration_store.program_text(text).splitlines() == [
        "HloModule jit_f, entry_computation_layout={(f32[4]{0})->f32[4]{0}}", "ENTRY %main (x: f32[4]) -> f32[4] {",
        "  %x = f32[4]{0} parameter(0)", "  ROOT %s = f32[4]{0} sine(%x)", "}"]
    assert calibration_store.program_text(text.replace("sine", "cosine")) != calibration_store.program_text(text)


@pytest.fixture
def timed(monkeypatch, tmp_path):
    """Measured costs, a fresh in-process memory and a calibration directory of the test's own."""
    tuner = measuring(monkeypatch)
    monkeypatch.setenv(calibration_store.DIR_ENV, str(tmp_path))
    # No verdict against AR's program makes a later call start plain (it would not calibrate).
    monkeypatch.setattr(against_ar, "GAIN_CHECK", float("inf"))
    calls = []
    calibrate = measure._calibrate
    monkeypatch.setattr(measure, "_calibrate", lambda *a, **k: calls.append(1) or calibrate(*a, **k))
    target, _ = pair(vocab=64, seed=0, noise=0.3)

    def call():
        for table in (tuner.calibrations, tuner.forward_seconds, tuner.step_costs):   # as in a new process
            table.clear()
        out = ssd_jax.generate(target, [[3, 4, 5, 3, 4]], max_new_tokens=16, method=ssd_jax.PLD(draft_len="auto"))
        return out.stats["loop_costs"][:3]

    call.tuner = tuner
    return call, calls


def test_a_damaged_file_is_measured_again_and_replaced(timed, tmp_path):
    call, calls = timed
    costs = call()
    (entry,) = [path for path in tmp_path.iterdir() if not path.name.startswith("forward-")]
    size = len(json.loads(entry.read_text())["costs"])   # 3 costs and one per cap
    assert size == 3 + ssd_jax.PLD().max_draft_len
    # Unparsable, not finite, not numbers, and an entry of another length (an older format's).
    for damaged in ("{", json.dumps(dict(costs=[1.0, float("nan"), 0.0])), json.dumps(dict(costs="fast")),
                    json.dumps(dict(costs=[1.0, 2.0, 0.5]))):
        entry.write_text(damaged)
        call()
        assert len(json.loads(entry.read_text())["costs"]) == size
    assert len(calls) == 5
    call()
    assert len(calls) == 5 and len(costs) == 3
    # The per-forward timings: a damaged one is timed again and replaced; the others are read.
    forward = sorted(path for path in tmp_path.iterdir() if path.name.startswith("forward-"))
    kept = [json.loads(path.read_text())["costs"] for path in forward]
    assert len(forward) == 2 and all(len(values) == 1 and values[0] > 0 for values in kept)
    forward[0].write_text(json.dumps(dict(costs=[0.0])))
    call()
    assert json.loads(forward[0].read_text())["costs"][0] > 0
    assert json.loads(forward[1].read_text())["costs"] == kept[1]


def test_an_unwritable_directory_warns_and_keeps_the_calibration_in_memory(timed, tmp_path, monkeypatch):
    call, calls = timed
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv(calibration_store.DIR_ENV, str(blocker / "calibration"))
    with pytest.warns(UserWarning, match="kept in memory only"):
        call()
    assert len(calls) == 1 and len(call.tuner.calibrations) == 1


def test_an_empty_directory_setting_keeps_nothing_on_disk(monkeypatch):
    monkeypatch.setenv(calibration_store.DIR_ENV, "")
    assert calibration_store.store_dir() is None
    monkeypatch.delenv(calibration_store.DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere")
    assert calibration_store.store_dir() == os.path.join("/somewhere", "ssd_jax", "calibration")
    monkeypatch.setenv("HOME", "/home/someone")
    monkeypatch.setenv(calibration_store.DIR_ENV, "~/calibrations")
    assert calibration_store.store_dir() == "/home/someone/calibrations"


def test_a_later_process_reads_ar_s_step_ratio(monkeypatch, tmp_path):
    """AR's step over the loop's plain step (measured for calls near a tie with AR) is kept beside
    the loop's calibration: a later process (its memory cleared here) reads it instead of
    building and timing AR's program, and gets the same ratio."""
    from ssd_jax.tuning import plain_verdicts

    tuner = measuring(monkeypatch)
    monkeypatch.setenv(calibration_store.DIR_ENV, str(tmp_path))
    monkeypatch.setattr(plain_verdicts, "PLAIN_SHARE", 1.01)
    monkeypatch.setattr(against_ar, "GAIN_CHECK", 0.0)      # every call checked
    monkeypatch.setattr(against_ar, "GAIN_MARGIN", -1.0)    # measured, never a verdict
    monkeypatch.setattr(against_ar, "PLAUSIBLE_RATIO", (0.0, float("inf")))
    measured = []
    ratio_of = against_ar.ar_step_ratio
    monkeypatch.setattr(against_ar, "ar_step_ratio", lambda *args: measured.append(1) or ratio_of(*args))
    target, _ = pair(vocab=64, seed=0, noise=0.3)
    ratios = []
    for _ in range(2):
        tuner.ar_ratios.clear()   # as in a new process
        out = ssd_jax.generate(target, [[3, 4, 5, 3, 4]], max_new_tokens=40, method=ssd_jax.PLD(draft_len="auto"))
        ratios.append(out.stats["ar_step_over_loop_plain"])
    kept = [path for path in tmp_path.iterdir() if path.name.startswith(against_ar.STORE_KIND + "-")]
    assert len(measured) == 1 and ratios[0] == ratios[1] and ratios[0] > 0
    assert len(kept) == 1 and json.loads(kept[0].read_text())["costs"] == [ratios[0]]


# A key `calibration_store.path_for` names by its text (no program needed): (static key, signature).
def _key(name: str) -> tuple:
    from ssd_jax.runtime.compile_cache import signature

    return (name, signature((np.zeros(2, np.float32),)))


@pytest.mark.parametrize("text", [
    "", "[1.0, 2.0]", '"costs"', '{"costs": []}', '{"costs": "25"}', '{"costs": {"1": 2}}', '{"costs": [true]}',
    '{"costs": [[1.0]]}', '{"costs": [null]}', '{"costs": [-1.0]}', '{"costs": [NaN]}', '{"costs": [Infinity]}',
    '{"costs": [1e39]}', pytest.param('{"costs": [1' + "0" * 400 + "]}", id="an-integer-of-401-digits"),
    pytest.param('{"costs": ' + "[" * 100_000 + "]" * 100_000 + "}", id="nested-100000-deep"),
])
def test_a_file_that_holds_no_measurements_reads_as_absent(tmp_path, text):
    """Never a crash (an integer too large for a float, JSON nested past the recursion limit), nor
    a string's digits or a dict's keys read as numbers, nor a value that is inf as the loop's
    float32 (inf / inf: a NaN in the cost model)."""
    path = tmp_path / "entry.json"
    path.write_text(text)
    assert calibration_store.load(str(path)) is None
    path.write_text('{"costs": [0.0, 2, 1.5e-05]}')
    assert calibration_store.load(str(path)) == (0.0, 2.0, 1.5e-05)
    path.unlink()
    path.mkdir()
    assert calibration_store.load(str(path)) is None


def test_a_kept_calibration_without_a_plain_or_speculative_step_is_measured_again(monkeypatch, tmp_path):
    """A loop's calibration on disk whose AR or speculative step is 0 (measured ones are at least
    1e-9 s; at 0 the loop never finds speculation paying) counts as absent: measured again and
    replaced."""
    tuner = measuring(monkeypatch)
    monkeypatch.setenv(calibration_store.DIR_ENV, str(tmp_path))
    measured = (2e-3, 3e-3, 5e-4, 0.0, 0.0, 0.0, 0.0)
    monkeypatch.setattr(measure, "_calibrate", lambda *args, **kwargs: measured)
    planned = cost_model.loop_inputs(cost_model.UNMEASURED, 0.7, verify_width=5, draft_len=4)
    key = _key("a loop")
    path = calibration_store.path_for(None, key=key, store=tuner.store_dir())
    for damaged in ((0.0, 3e-3, 5e-4, 0.0, 0.0, 0.0, 0.0), (2e-3, 0.0, 5e-4, 0.0, 0.0, 0.0, 0.0)):
        calibration_store.save(path, damaged)
        tuner.calibrations.clear()   # as in a new process
        inputs = measure.calibrated_inputs(tuner, None, (), key, cost_model.UNMEASURED, planned)
        assert inputs[:3].tolist() == pytest.approx(measured[:3])
        assert calibration_store.load(path) == measured


def test_an_implausible_kept_ar_step_ratio_is_measured_again(monkeypatch, tmp_path):
    """`ar_step_ratio` keeps only plausible ratios, so an implausible one on disk is damage: it
    counts as absent (measured again, and replaced by a plausible measurement), instead of
    leaving the program without a verdict against AR's program on this machine for good."""
    monkeypatch.setenv(calibration_store.DIR_ENV, str(tmp_path))
    tuner = Tuner()
    key = _key("a loop")
    path = calibration_store.path_for(None, against_ar.STORE_KIND, key, store=tuner.store_dir())
    for ratio, found in ((100.0, (False, None)), (0.0, (False, None)), (1.1, (True, 1.1))):
        tuner.reset()   # as in a new process
        calibration_store.save(path, (ratio,))
        assert against_ar.stored_ratio(tuner, None, key) == found


def _at_once(measure) -> list:
    """measure() in two threads started together: their results."""
    barrier, results = threading.Barrier(2), []

    def run():
        barrier.wait()
        results.append(measure())

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@pytest.mark.parametrize("what", ["calibration", "forward", "ar-ratio"])
def test_threads_measure_a_program_once_and_one_at_a_time(monkeypatch, what):
    """Two threads' first calls of a program (a server warming up): the loop's calibration, a
    per-forward timing and AR's step ratio are each measured once, and never two at once (each
    would time the other's runs too), the waiting thread taking the other's measurement."""
    tuner = measuring(monkeypatch)
    monkeypatch.setenv(calibration_store.DIR_ENV, "")
    spans = []

    def slowly(value):
        start = time.perf_counter()
        time.sleep(0.3)
        spans.append((start, time.perf_counter()))
        return value

    measured = (2e-3, 3e-3, 5e-4, 0.0, 0.0, 0.0, 0.0)
    monkeypatch.setattr(measure, "_calibrate", lambda *args, **kwargs: slowly(measured))
    monkeypatch.setattr(measure, "_loop_seconds", lambda *args: slowly(1e-3))

    def timed_run(executable, args, max_new, forced=None):   # AR's program's step 1.25x the loop's
        if forced is None and max_new == 1:   # AR's short run: one per measurement
            spans.append(None)

        def run():
            time.sleep(0.01)
            steps = np.asarray(max_new)
            output = SimpleNamespace(tokens=np.zeros((1, 16)), counters=dict(spec=SimpleNamespace(target_calls=steps)))
            return (1e-3 if forced is not None else 1.25e-3) * int(steps), output

        return run

    monkeypatch.setattr(against_ar, "timed_run", timed_run)
    planned = cost_model.loop_inputs(cost_model.UNMEASURED, 0.7, verify_width=5, draft_len=4)
    key = _key("a loop")
    target, _ = pair(vocab=64, seed=0, noise=0.3, layers=1)
    once = dict(calibration=lambda: tuple(measure.calibrated_inputs(tuner, None, (), key, cost_model.UNMEASURED,
                                                                    planned)),
                forward=lambda: measure.forward_seconds(tuner, target, 1, 1, 5),
                **{"ar-ratio": lambda: against_ar.ar_step_ratio(tuner, None, (), None, (), key)})[what]
    first, second = _at_once(once)
    assert first == second and len(spans) == 1
    if what == "ar-ratio":
        assert first == pytest.approx(1.25)


def test_models_sharded_by_other_rules_are_timed_apart(monkeypatch):
    """Remembered per-forward timings are per placement's mesh and rules: on one mesh a model
    split over "model" and the same model replicated run other programs (4 CPU devices, the tiny
    target at batch 8: 0.70 ms against 1.24 ms a forward of 9 tokens), which the process took for
    one, reading the first one's timing for the second."""
    tuner = measuring(monkeypatch)
    monkeypatch.setenv(calibration_store.DIR_ENV, "")
    timed = []
    monkeypatch.setattr(measure, "_loop_seconds", lambda store, params, *args: timed.append(1) or float(len(timed)))
    target, _ = pair(vocab=64, seed=0, noise=0.3, layers=1)
    mesh = jax.make_mesh((1, 1), ("data", "model"))
    split = ssd_jax.shard(target, mesh)
    replicated = ssd_jax.shard(target, mesh, rules={"heads": None, "kv_heads": None, "mlp": None, "vocab": None})
    assert [measure.forward_seconds(tuner, model, 8, 9, 64) for model in (split, replicated, split)] == [1.0, 2.0, 1.0]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this platform")
def test_a_process_pinned_to_fewer_cores_measures_for_itself(monkeypatch):
    """XLA:CPU sizes its thread pool by the cores the process may run on (taskset, a container's
    cpuset, a batch job's allocation), so the measurements are named by them, not by the
    machine's core count: a process pinned to one core of two read the calibrations of one that
    ran on both."""
    text = "HloModule m"
    names = {}
    for cores in ({0}, {0, 1}):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, cores=cores: cores)
        names[len(cores)] = calibration_store._digest("forward", text)
        assert calibration_store.machine()["cores"] == len(cores)
    assert names[1] != names[2]


def test_a_call_reports_the_calibrations_it_made(monkeypatch):
    """A call that calibrates its program says how long that took (calibration_time_s: the
    benchmarks leave it out of a call's time, as they do its compile); the next call of the
    program reads the calibration back and reports none."""
    tuner = measuring(monkeypatch)
    monkeypatch.setenv(calibration_store.DIR_ENV, "")
    calibrate = measure._calibrate

    def slowly(*args, **kwargs):
        time.sleep(0.4)
        return calibrate(*args, **kwargs)

    monkeypatch.setattr(measure, "_calibrate", slowly)
    target, _ = pair(vocab=64, seed=0, noise=0.3)
    calls = [ssd_jax.generate(target, [[3, 4, 5, 3, 4]], max_new_tokens=16, method=ssd_jax.PLD(draft_len="auto"),
                              tuner=tuner) for _ in range(2)]
    assert calls[0].stats["calibration_time_s"] >= 0.4
    assert calls[1].stats["calibration_time_s"] == 0.0
    assert calls[0].tokens == calls[1].tokens


def test_calibration_seconds_count_nested_calibrations_once_and_per_thread():
    """A calibration inside another adds its seconds once; another thread's do not show in this
    thread's total."""
    tuner = Tuner(store=None)
    with tuner.calibrating("outer"):
        time.sleep(0.05)
        with tuner.calibrating("inner"):
            time.sleep(0.05)
    alone = tuner.calibration_seconds()
    assert 0.1 <= alone < 0.2
    def elsewhere():
        with tuner.calibrating("elsewhere"):
            time.sleep(0.1)

    other = threading.Thread(target=elsewhere)
    other.start()
    other.join()
    assert tuner.calibration_seconds() == alone


def test_seconds_left_out_of_a_calibration_do_not_count_in_it():
    """Time inside a calibration that the call reports elsewhere (a program a timing run compiled,
    in compile_time_s) is left out of its seconds, so a timed call leaves it out once."""
    tuner = Tuner(store=None)
    with tuner.calibrating("timing"):
        time.sleep(0.15)
        tuner.leave_out_of_calibration(0.1)
    assert 0.05 <= tuner.calibration_seconds() < 0.1
