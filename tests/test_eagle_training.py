"""Training a feature-level head (`ssd_jax.eagle.training`, `ssd-jax train-head`): it lowers the
held-out loss and raises acceptance over an untrained head, resumes, writes a loadable head, and
refuses bad input."""

from __future__ import annotations

import json
import os
import shutil
import sysconfig

import numpy as np
import pytest

import ssd_jax
from ssd_jax.eagle import load_head
from ssd_jax.eagle.training import head_acceptance, train_head
from ssd_jax.errors import InputError
from ssd_jax.train.trainer import TrainSettings
from spec_models import llama

SETTINGS = TrainSettings(steps=40, batch_size=4, seq_len=48, learning_rate=3e-3, warmup_steps=4, checkpoint_every=20,
                         eval_every=40, eval_batches=2)


@pytest.fixture(scope="module")
def target():
    return ssd_jax.default_models()[0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A few standard-library modules: text the embedded target knows."""
    root = tmp_path_factory.mktemp("corpus")
    stdlib = sysconfig.get_paths()["stdlib"]
    for name in ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "colorsys.py", "keyword.py",
                 "heapq.py", "string.py", "queue.py"):
        shutil.copy(os.path.join(stdlib, name), root / name)
    return str(root)


def test_training_lowers_the_loss_and_raises_acceptance(target, corpus, tmp_path):
    out = str(tmp_path / "head")
    head = train_head(target, out, data_dir=corpus, settings=SETTINGS, intermediate_size=128, passes=3,
                      progress=False)
    with open(os.path.join(out, "training_report.json")) as f:
        report = json.load(f)
    history = [json.loads(line) for line in open(os.path.join(out + ".work", "history.jsonl"))]
    assert np.mean([h["loss"] for h in history[-5:]]) < 0.8 * np.mean([h["loss"] for h in history[:5]])
    before, after = report["heldout_acceptance_untrained"], report["heldout_acceptance"]
    assert len(after["greedy"]) == 3
    assert after["greedy"][0] > before["greedy"][0] + 0.1
    assert after["sampled"][0] > before["sampled"][0] + 0.1
    loaded = load_head(out, target=target)
    assert loaded.config == head.config and loaded.config.intermediate_size == 128
    # The head drafts: on the embedded target it gets tokens accepted, and the output is AR's.
    prompt = [target.tokenizer.encode("def split(self, text):\n    ").ids]
    ar = ssd_jax.generate(target, prompt, max_new_tokens=24).tokens
    out_eagle = ssd_jax.generate(target, prompt, max_new_tokens=24, method=ssd_jax.EAGLE(draft_len=3, topk=2),
                                 draft=loaded)
    assert out_eagle.tokens == ar and out_eagle.stats["num_accepted_tokens"] > 0


@pytest.mark.slow   # ~100 s: two training runs; the resumption is `fit`'s, which tests/test_train.py checks
def test_training_resumes_from_its_checkpoints(target, corpus, tmp_path):
    """A run stopped at step 20 and rerun to 40 goes on from its orbax checkpoint: the rerun
    trains steps 21..40 only, starting near where the first run ended (`fit`'s resumption, which
    tests/test_train.py checks against an uninterrupted run)."""
    short = TrainSettings(**dict(SETTINGS.__dict__, steps=20, warmup_steps=4))
    workdir = str(tmp_path / "work")
    train_head(target, str(tmp_path / "a"), data_dir=corpus, settings=short, intermediate_size=64, passes=2,
               workdir=workdir, progress=False)
    history = [json.loads(line) for line in open(os.path.join(workdir, "history.jsonl"))]
    train_head(target, str(tmp_path / "b"), data_dir=corpus, settings=SETTINGS, intermediate_size=64, passes=2,
               workdir=workdir, progress=False)
    resumed = [json.loads(line) for line in open(os.path.join(workdir, "history.jsonl"))][len(history):]
    assert [h["step"] for h in resumed] == list(range(21, 41))
    assert resumed[0]["loss"] < 0.8 * history[0]["loss"]
    assert load_head(str(tmp_path / "b"), target=target).config.intermediate_size == 64


def test_bad_training_input_is_refused(target, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="holds no non-empty text files"):
        train_head(target, str(tmp_path / "h"), data_dir=str(empty), settings=SETTINGS, progress=False)
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "a.py").write_text("x = 1\n")
    with pytest.raises(InputError, match="fewer than one window"):
        train_head(target, str(tmp_path / "h"), data_dir=str(tmp_path / "small"), settings=SETTINGS, progress=False)
    with pytest.raises(InputError, match="has no tokenizer"):
        train_head(llama(64, 32, 2, seed=0), str(tmp_path / "h"), settings=SETTINGS, progress=False)
    with pytest.raises(InputError, match="passes .* must be >= 1, got 0"):
        train_head(target, str(tmp_path / "h"), settings=SETTINGS, passes=0, progress=False)
    with pytest.raises(InputError, match=r"feature layer\(s\) \[9\] out of range"):
        train_head(target, str(tmp_path / "h"), data_dir=str(tmp_path / "small"), settings=SETTINGS,
                   feature_layers=(1, 9), progress=False)


def test_head_acceptance_needs_windows(target):
    from ssd_jax.eagle import init_head

    with pytest.raises(InputError, match="at least one held-out window"):
        head_acceptance(init_head(target), target, [])


def test_the_command_line_trains_a_head(corpus, tmp_path, capsys):
    from ssd_jax.cli import main

    out = tmp_path / "head"
    rc = main(["train-head", "--data", corpus, "--out", str(out), "--steps", "6", "--batch-size", "2", "--seq-len",
               "32", "--warmup-steps", "2", "--intermediate-size", "32", "--passes", "2", "--feature-layers", "2,5",
               "--eval-every", "6", "--checkpoint-every", "3"])
    assert rc == 0 and capsys.readouterr().out.strip().endswith(str(out))
    assert load_head(str(out)).config.feature_layers == (2, 5)
    rc = main(["train-head", "--data", corpus, "--out", str(tmp_path / "bad"), "--feature-layers", "1,x"])
    assert rc == 2 and "--feature-layers takes comma-separated integers, got '1,x'" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
