"""The embedded default models (target, draft_small, draft): load, agree with transformers,
generate; the main-job CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import ssd_jax
from ssd_jax import defaults
from ssd_jax.defaults import DRAFT_DIR, DRAFT_SMALL_DIR, default_model_dirs, default_small_draft, shipped_draft
from ssd_jax.errors import CheckpointError, InputError
from ssd_jax.train.presets import PRESETS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def target():
    return ssd_jax.default_models()[0]


@pytest.fixture(scope="module")
def draft():
    """The two-layer shipped draft (`default_models(draft="draft")`'s)."""
    return shipped_draft("draft")


@pytest.fixture(scope="module")
def small():
    """draft_small, the draft `default_models()` returns."""
    return ssd_jax.default_models()[1]


def test_default_pair_is_the_target_with_draft_small(target, small):
    assert target.path == default_model_dirs()[0]
    assert small.path == default_model_dirs()[1] == DRAFT_SMALL_DIR
    other_target, other = ssd_jax.default_models(draft="draft")
    assert other.path == DRAFT_DIR == default_model_dirs("draft")[1] and other_target.path == target.path
    assert default_small_draft().path == DRAFT_SMALL_DIR


def test_unknown_shipped_draft_is_an_input_error():
    with pytest.raises(InputError, match="draft must be one of.*'draft_large'"):
        ssd_jax.default_models(draft="draft_large")
    with pytest.raises(InputError, match="'tiny'"):
        shipped_draft("tiny")


def test_shapes_sizes_and_tokenizer(target, draft):
    assert target.config.model_type == draft.config.model_type == "llama"
    assert target.tokenizer.get_vocab() == draft.tokenizer.get_vocab()
    assert target.config.vocab_size == draft.config.vocab_size == target.tokenizer.get_vocab_size()
    assert draft.config.num_params * 8 < target.config.num_params
    directories = (default_model_dirs()[0], DRAFT_DIR, DRAFT_SMALL_DIR)
    shipped = sum(os.path.getsize(os.path.join(d, f)) for d in directories for f in os.listdir(d))
    assert shipped < 30 * 2**20


def test_small_draft_shape_size_and_tokenizer(target, draft, small):
    assert small.path == DRAFT_SMALL_DIR and small.config.model_type == "llama"
    assert small.tokenizer.get_vocab() == target.tokenizer.get_vocab()
    assert small.config.vocab_size == target.config.vocab_size
    assert small.config.eos_token_ids == target.config.eos_token_ids
    for field, value in PRESETS["draft_small"].items():
        assert getattr(small.config, field) == value, field
    assert small.config.num_params < draft.config.num_params
    with open(os.path.join(DRAFT_SMALL_DIR, "training_report.json")) as f:
        report = json.load(f)
    assert report["preset"] == "draft_small" and report["num_params"] == small.config.num_params
    assert os.path.getsize(os.path.join(DRAFT_SMALL_DIR, "model.safetensors")) < 2**20


def test_missing_small_draft_is_a_checkpoint_error(tmp_path, monkeypatch):
    monkeypatch.setattr(defaults, "DRAFT_SMALL_DIR", str(tmp_path / "draft_small"))
    with pytest.raises(CheckpointError, match="embedded model missing.*--only-draft-small"):
        default_small_draft()


def _heldout_windows(tokenizer, eos):
    from ssd_jax.train.corpus import collect_corpus
    from ssd_jax.train.data import eval_batches, tokenize_files

    heldout = collect_corpus().heldout
    return eval_batches(tokenize_files(tokenizer, heldout[:8], eos), 8, 256, 1)[0][:, :-1]


def test_drafts_agree_with_the_target_on_heldout_text(target, draft, small):
    """Greedy (argmax) agreement with the target on 8 held-out windows of 256 tokens: measured
    0.672 for the draft and 0.667 for draft_small; the floors leave about 8 points of margin."""
    windows = _heldout_windows(target.tokenizer, target.config.eos_token_ids[0])
    reference = np.asarray(ssd_jax.forward(target, windows)).argmax(-1)
    agreement = {name: float((np.asarray(ssd_jax.forward(m, windows)).argmax(-1) == reference).mean())
                 for name, m in (("draft", draft), ("draft_small", small))}
    assert agreement["draft"] > 0.60, agreement
    assert agreement["draft_small"] > 0.58, agreement


@pytest.mark.parametrize("which", [0, 1, 2])
def test_transformers_loads_the_shipped_directories_with_our_logits(target, draft, small, which):
    model = (target, draft, small)[which]
    directory = (default_model_dirs()[0], DRAFT_DIR, DRAFT_SMALL_DIR)[which]
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokens = np.array([model.tokenizer.encode("def add(a, b):\n    return a + b\n").ids])
    with torch.no_grad():
        expected = reference(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(ssd_jax.forward(model, tokens))
    assert np.abs(ours - expected).max() / np.abs(expected).max() < 1e-4


def test_pair_generates_python(target, small):
    prompt = target.tokenizer.encode("import os\n\n\ndef ").ids
    out = ssd_jax.generate(target, [prompt], max_new_tokens=32)
    text = out.texts(target.tokenizer)[0]
    assert len(out.tokens[0]) > 0 and text.strip()
    spec = ssd_jax.generate(target, [prompt], max_new_tokens=32, method="sd", draft=small)
    assert spec.tokens == out.tokens
    assert spec.stats["acceptance_rate"] > 0.3


def test_small_draft_drafts_for_the_target_and_for_the_draft(target, draft, small):
    prompt = target.tokenizer.encode("import os\n\n\ndef ").ids
    for model in (target, draft):
        out = ssd_jax.generate(model, [prompt], max_new_tokens=32)
        spec = ssd_jax.generate(model, [prompt], max_new_tokens=32, method="sd", draft=small)
        assert spec.tokens == out.tokens
        assert spec.stats["acceptance_rate"] > 0.2


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ssd_jax.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=600)


def test_main_job_json_output_has_the_named_fields():
    result = _cli("generate", "def fibonacci(n):", "--method", "sd", "--max-new-tokens", "24", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    for field in ("tokens_per_second", "acceptance_rate", "mean_acceptance_length", "block_efficiency",
                  "num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position",
                  "target_calls", "wall_time_s"):
        assert field in payload["stats"], field
    assert payload["texts"][0]


def test_main_job_prints_text_and_compares():
    """The README's main job (its default method, --compare), with fewer tokens; the prompt and
    length of the --json test above, so one of the two finds the other's SD program in the
    suite's compilation cache. --stream prints the same text as it is decoded."""
    result = _cli("generate", "def fibonacci(n):", "--max-new-tokens", "24", "--compare")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def fibonacci(n):") and "tokens_per_second" in result.stdout
    assert "speedup over autoregressive" in result.stdout
    printed = result.stdout.split("\n--- ")[0]
    streamed = _cli("generate", "def fibonacci(n):", "--max-new-tokens", "24", "--stream")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout.split("\n--- ")[0] == printed


@pytest.mark.parametrize("args, match", [
    (["generate", "x", "--method", "nope"], "unknown method 'nope'"),
    (["generate", "x", "--target", "/nonexistent/model"], "does not exist"),
    (["generate", "x", "--method", "sd", "--num-draft-tokens", "0"], "draft_len must be"),
    (["generate", "x", "--temperature", "-1"], "temperature must be"),
    (["generate", "x", "y", "--stream"], "--stream prints one prompt's text as it is decoded; got 2 prompts"),
    (["generate", "x", "--stream", "--json"], "--stream prints one prompt's text as it is decoded; got --json"),
])
def test_main_job_errors_are_one_line(args, match):
    result = _cli(*args)
    assert result.returncode == 2
    assert match in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_main_job_refuses_a_draft_with_another_tokenizer(tmp_path, hf_family):
    directory, _ = hf_family("llama3")
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0"))
    tok.save(os.path.join(directory, "tokenizer.json"))
    try:
        result = _cli("generate", "x", "--method", "sd", "--draft", directory)
    finally:
        os.remove(os.path.join(directory, "tokenizer.json"))
    assert result.returncode == 2 and "draft tokenizer differs" in result.stderr


def test_bad_flag_gets_usage_error():
    result = _cli("generate", "x", "--no-such-flag")
    assert result.returncode == 2 and "unrecognized arguments" in result.stderr
