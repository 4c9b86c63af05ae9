"""The `ssd-jax` command line, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ssd_jax.cli", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=600)


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
