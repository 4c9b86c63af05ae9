"""Training, resuming and distillation on a tiny corpus; argument validation."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig

import jax
import numpy as np
import pytest

import ssd_jax
from ssd_jax.errors import InputError
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import init_params
from ssd_jax.train.corpus import collect_corpus
from ssd_jax.train.losses import next_token_loss
from ssd_jax.train.recipes import distill_draft, train_language_model
from ssd_jax.train.trainer import TrainSettings, fit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STDLIB_FILES = ["json/encoder.py", "json/decoder.py", "textwrap.py", "string.py", "bisect.py", "heapq.py",
                "fnmatch.py", "shlex.py", "colorsys.py", "keyword.py"]


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    stdlib = sysconfig.get_paths()["stdlib"]
    for rel in STDLIB_FILES:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(stdlib, rel), root / rel)
    return str(root)


def _settings(**kw):
    base = dict(steps=24, batch_size=4, seq_len=64, learning_rate=3e-3, warmup_steps=2, checkpoint_every=8,
                eval_every=12, eval_batches=2)
    return TrainSettings(**{**base, **kw})


def test_stdlib_corpus_split_is_deterministic_and_excludes_tests():
    a, b = collect_corpus(), collect_corpus()
    assert a == b
    assert len(a.train) > 100 and len(a.heldout) > 5
    assert not set(a.train) & set(a.heldout)
    assert not any(f"{os.sep}test{os.sep}" in p or os.path.basename(p).startswith("test_") for p in a.train)


def test_loss_falls_and_a_resumed_run_continues(tmp_path):
    config = ModelConfig(model_type="llama", vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=128, tie_word_embeddings=True)
    tokens = np.tile(np.random.default_rng(0).integers(0, 32, 50).astype(np.int32), 40)
    loss_fn = lambda p, w: next_token_loss(p, config, w)  # noqa: E731
    params0 = init_params(config, jax.random.PRNGKey(0))
    settings = _settings(learning_rate=1e-2)
    full, history = fit(loss_fn, params0, tokens, tokens[:600], settings, str(tmp_path / "full"), progress=False)
    assert np.mean([h["loss"] for h in history[-4:]]) < history[0]["loss"] - 1.0
    # Interrupted after 16 steps (checkpoint at 16), then resumed to 24.
    fit(loss_fn, params0, tokens, None, _settings(steps=16, learning_rate=1e-2), str(tmp_path / "resumed"),
        progress=False)
    resumed, tail = fit(loss_fn, params0, tokens, None, settings, str(tmp_path / "resumed"), progress=False)
    assert [h["step"] for h in tail] == list(range(17, 25))
    # The schedule depends on `steps`, so the first 16 steps differ slightly; the run must continue
    # from its checkpoint (loss near the uninterrupted run's), not restart from scratch.
    assert tail[0]["loss"] < history[0]["loss"] - 0.7
    assert abs(tail[-1]["loss"] - history[-1]["loss"]) < 0.3


def test_train_then_distill_end_to_end(tiny_corpus, tmp_path):
    target_dir = train_language_model(str(tmp_path / "target"), data_dir=tiny_corpus, preset="tiny",
                                      settings=_settings(steps=30), vocab_size=320, progress=False)
    report = json.load(open(os.path.join(target_dir, "training_report.json")))
    history = [json.loads(l) for l in open(str(tmp_path / "target") + ".work/history.jsonl")]
    assert history[-1]["loss"] < history[0]["loss"] - 0.5
    assert report["heldout_loss"] is not None
    target = ssd_jax.load(target_dir)
    assert target.tokenizer is not None and target.config.vocab_size == target.tokenizer.get_vocab_size()

    draft_dir = distill_draft(target_dir, str(tmp_path / "draft"), data_dir=tiny_corpus, preset="tiny",
                              settings=_settings(steps=30), progress=False, hidden_size=32, intermediate_size=64)
    kl = [json.loads(l)["loss"] for l in open(str(tmp_path / "draft") + ".work/history.jsonl")]
    assert np.mean(kl[-5:]) < 0.7 * np.mean(kl[:3])
    draft = ssd_jax.load(draft_dir)
    assert draft.tokenizer.get_vocab() == target.tokenizer.get_vocab()
    out = ssd_jax.generate(draft, [draft.tokenizer.encode("def ").ids], max_new_tokens=5)
    assert len(out.tokens[0]) >= 1


@pytest.mark.parametrize("args, match", [
    (["train", "--out", "OUT", "--data", "MISSING"], "does not exist"),
    (["train", "--out", "OUT", "--data", "EMPTY"], "holds no non-empty text files"),
    (["train", "--out", "OUT", "--data", "EMPTY", "--steps", "0"], "steps must be >= 1"),
    (["distill-draft", "--target", "MISSING", "--out", "OUT"], "does not exist"),
])
def test_training_cli_rejects_bad_arguments(args, match, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.py").write_text("")
    mapping = {"OUT": str(tmp_path / "out"), "MISSING": str(tmp_path / "missing"), "EMPTY": str(tmp_path / "empty")}
    argv = [mapping.get(a, a) for a in args]
    result = subprocess.run([sys.executable, "-m", "ssd_jax.cli", *argv], capture_output=True, text=True, cwd=REPO,
                            timeout=300)
    assert result.returncode == 2
    assert match in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_settings_validation():
    with pytest.raises(InputError, match="warmup_steps"):
        TrainSettings(steps=10, warmup_steps=10)
    with pytest.raises(InputError, match="learning_rate"):
        TrainSettings(learning_rate=0.0)
