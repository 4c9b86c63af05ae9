"""The `ssd-jax` command line, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ssd_jax.cli", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=600, env=env)


def test_demo_runs_end_to_end(tmp_path):
    result = _cli("demo", "--max-new-tokens", "8", "--batch-size", "2", "--out", str(tmp_path / "rand"))
    assert result.returncode == 0, result.stderr
    assert "tokens_per_second" in result.stdout
    assert (tmp_path / "rand" / "model.safetensors").exists()


def test_generate_with_prompt_ids_prints_json(hf_family):
    directory, _ = hf_family("llama3")
    result = _cli("generate", "--target", directory, "--method", "ar", "--prompt-ids", "3,4,5", "--prompt-ids", "9",
                  "--max-new-tokens", "6", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert len(payload["tokens"]) == 2 and payload["stats"]["method"] == "ar"


def test_generate_reports_bad_input_cleanly(hf_family):
    directory, _ = hf_family("llama3")
    result = _cli("generate", "--target", directory, "--method", "ar", "--prompt-ids", "3,999", "--max-new-tokens", "4")
    assert result.returncode == 2
    assert "token id 999 outside the vocabulary" in result.stderr
    assert "Traceback" not in result.stderr
    result = _cli("generate", "--target", directory, "--method", "ar", "hi")
    assert result.returncode == 2 and "tokenizer.json" in result.stderr
    result = _cli("generate", "--target", directory, "--prompt-ids", "3")
    assert result.returncode == 2 and "need a draft model" in result.stderr


def test_compile_cache_keeps_the_programs_for_the_next_run(hf_family, tmp_path):
    """--compile-cache DIR writes the run's compiled programs there (the decode program also whole,
    `ssd_jax.runtime.program_store`), and a second run loads them (it writes nothing new) and decodes
    the same tokens; a directory that cannot be made is a clean error."""
    directory, _ = hf_family("llama3")
    cache = tmp_path / "xla"
    run = ("generate", "--target", directory, "--method", "ar", "--prompt-ids", "3,4,5", "--max-new-tokens", "4",
           "--json", "--compile-cache", str(cache))
    result = _cli(*run)
    assert result.returncode == 0, result.stderr
    first, tokens = sorted(os.listdir(cache)), json.loads(result.stdout)["tokens"]
    programs = sorted(os.listdir(cache / "ssd_jax-programs"))   # the decode program, whole
    assert first and programs and all(name.endswith(".program") for name in programs)
    result = _cli(*run)
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(cache)) == first and sorted(os.listdir(cache / "ssd_jax-programs")) == programs
    assert json.loads(result.stdout)["tokens"] == tokens
    (tmp_path / "a_file").write_text("")
    result = _cli(*run[:-1], str(tmp_path / "a_file" / "xla"))
    assert result.returncode == 2 and "compile cache directory" in result.stderr and "Traceback" not in result.stderr


def test_generate_keeps_its_programs_by_default(hf_family, tmp_path):
    """Without --compile-cache a run keeps its compiled programs under $XDG_CACHE_HOME/ssd_jax/xla,
    and the next run loads them (it writes nothing new); JAX_COMPILATION_CACHE_DIR (JAX's own
    setting) stands instead, SSD_JAX_COMPILE_CACHE='' keeps none, and a default directory that
    cannot be made only warns."""
    directory, _ = hf_family("llama3")
    run = ("generate", "--target", directory, "--method", "ar", "--prompt-ids", "3,4,5", "--max-new-tokens", "4",
           "--json")
    unset = ("SSD_JAX_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    kept = tmp_path / "home_cache" / "ssd_jax" / "xla"
    listings = []
    for _ in range(2):
        result = _cli(*run, env=dict(env, XDG_CACHE_HOME=str(tmp_path / "home_cache")))
        assert result.returncode == 0, result.stderr
        listings.append(sorted(os.listdir(kept)))
    assert listings[0] and listings[1] == listings[0]
    own = tmp_path / "jax_own"
    result = _cli(*run, env=dict(env, XDG_CACHE_HOME=str(tmp_path / "second"), JAX_COMPILATION_CACHE_DIR=str(own)))
    assert result.returncode == 0, result.stderr
    assert os.listdir(own) and not (tmp_path / "second").exists()
    result = _cli(*run, env=dict(env, XDG_CACHE_HOME=str(tmp_path / "third"), SSD_JAX_COMPILE_CACHE=""))
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "third").exists()
    (tmp_path / "a_file").write_text("")
    result = _cli(*run, env=dict(env, XDG_CACHE_HOME=str(tmp_path / "a_file")))
    assert result.returncode == 0, result.stderr
    assert "not kept for the next run" in result.stderr and json.loads(result.stdout)["stats"]["method"] == "ar"
    result = _cli(*run, env=dict(env, SSD_JAX_COMPILE_CACHE=str(tmp_path / "a_file" / "xla")))
    assert result.returncode == 2 and "compile cache directory" in result.stderr and "Traceback" not in result.stderr


def test_the_default_compile_cache_is_bounded_where_jax_can_evict(tmp_path):
    """JAX's eviction needs the filelock package (tokenizers brings it): with it the command
    line's default cache is bounded, without it unbounded rather than an error at the first
    compile."""
    script = """
import json, jax
from ssd_jax.runtime import compile_cache
compile_cache._importable = lambda module: {present}
chosen = compile_cache.use_command_line_cache(None)
print(json.dumps([chosen, jax.config.jax_compilation_cache_max_size]))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("SSD_JAX_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR")}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    from ssd_jax.runtime.compile_cache import COMMAND_LINE_CACHE_BYTES

    for present, bound in ((True, COMMAND_LINE_CACHE_BYTES), (False, -1)):
        done = subprocess.run([sys.executable, "-c", script.format(present=present)], capture_output=True,
                              text=True, cwd=REPO, env=env, timeout=300)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == [str(tmp_path / "ssd_jax" / "xla"), bound]


def test_compare_reports_the_median_of_paired_rounds():
    """--compare's speedup is the median of the rounds' own ratios, not a ratio of single runs:
    a round where the machine slowed both runs reads the same ratio as the others."""
    from types import SimpleNamespace

    from ssd_jax.cli.generate_cmd import COMPARE_ROUNDS, compare_with_ar

    # tokens/s by call: the warm runs first, then (method, AR) per round; round 2 ran at half speed
    method_speeds = iter([1.0, 300.0, 150.0, 330.0, 310.0, 320.0])
    ar_speeds = iter([1.0, 250.0, 125.0, 300.0, 250.0, 250.0])
    calls = []

    def run(speeds, name):
        def go():
            calls.append(name)
            return SimpleNamespace(stats=dict(tokens_per_second=next(speeds)))
        return go

    out, baseline, speedup = compare_with_ar(run(method_speeds, "method"), run(ar_speeds, "ar"))
    assert COMPARE_ROUNDS == 5 and calls == ["method", "ar"] * 6
    assert speedup == 1.2   # ratios 1.2, 1.2, 1.1, 1.24, 1.28
    assert out.stats["tokens_per_second"] == 310.0 and baseline.stats["tokens_per_second"] == 250.0


def test_streamed_text_ends_as_the_unstreamed_text_does(capsys):
    """`--stream`'s printer holds back text that ends inside a multi-byte character; when the
    decode ends there (a length limit), what it held back is printed too, as the unstreamed
    output prints it (a replacement character included): every cut of a text of accented
    letters, an arrow and an emoji, streamed a token and two tokens at a time."""
    import numpy as np
    from tokenizers import Tokenizer

    from ssd_jax.cli.generate_cmd import TextStreamer
    from ssd_jax.defaults import default_model_dirs

    tokenizer = Tokenizer.from_file(os.path.join(default_model_dirs()[0], "tokenizer.json"))
    ids = tokenizer.encode("naïve café → 😀 done").ids
    for cut in range(1, len(ids) + 1):
        for size in (1, 2):
            printer = TextStreamer(tokenizer, prefix="P:")
            for at in range(0, cut, size):
                piece = ids[at:min(at + size, cut)]
                printer(np.asarray([piece], np.int32), np.asarray([len(piece)], np.int32))
            printer.finish()
            assert capsys.readouterr().out == "P:" + tokenizer.decode(ids[:cut]), (cut, size)
