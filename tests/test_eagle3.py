"""Converted EAGLE-3 heads (`checkpoints_convert.eagle3`): the converted head reproduces a torch
reference of EAGLE-3's architecture, round-trips to the same checkpoint, decodes exactly (greedy
identity with AR, the sampled law with a reduced draft vocabulary), and bad checkpoints are
refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ssd_jax
from checkpoints_convert.eagle3 import convert_eagle3, eagle3_to_head, export_eagle3
from checkpoints_convert.safetensors_io import read_hf_tensors
from eagle3_reference import layer_config, random_eagle3_tensors, reference_logits, write_eagle3
from spec_models import exact_law, llama
from ssd_jax.eagle import init_head, load_head, save_head
from ssd_jax.eagle.forward import OUTSIDE_DRAFT_VOCAB_LOGIT, fused_features, head_forward_cached, training_time_test
from ssd_jax.errors import CheckpointError, InputError
from ssd_jax.methods import EAGLE
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.transformer import embed, forward_full
from ssd_jax.sampling import SamplingParams
from test_eagle import LAW_NEW, PROMPT, ROWS, _empirical
from test_speculative import _consistent

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INPUT_IDS = [2, 4, 1]          # target layers whose inputs the head reads, in fc's order
FEATURE_LAYERS = (0, 1, 3)     # ours: the outputs of layers 1 - 1, 2 - 1, 4 - 1, sorted
DRAFT_IDS = np.random.default_rng(5).permutation(64)[:40]


@pytest.fixture(scope="module")
def target():
    return llama(64, 32, 4, seed=3)


def _checkpoint(directory, target, draft_ids=DRAFT_IDS, seed=0, **config_extra):
    config = dict(layer_config(target.config), draft_vocab_size=len(draft_ids),
                  eagle_aux_hidden_state_layer_ids=INPUT_IDS, **config_extra)
    tensors = random_eagle3_tensors(target.config, draft_ids, seed=seed)
    return write_eagle3(str(directory), config, tensors), config, tensors


def test_a_converted_head_reproduces_the_reference_architecture(target, tmp_path):
    """Depth-1 draft logits of the converted head, through its KV cache and through the training
    forward, equal a float64 torch forward of EAGLE-3's layer on the same features; the target
    tokens outside the draft vocabulary get draft probability 0."""
    src, config, tensors = _checkpoint(tmp_path / "eagle3", target)
    head = eagle3_to_head(src, target.config)
    assert head.config.feature_layers == FEATURE_LAYERS and head.config.draft_vocab_size == len(DRAFT_IDS)
    tokens = jnp.asarray([[5, 9, 13, 2, 44, 7, 30, 11]], jnp.int32)
    _, features = forward_full(target.params, target.config, tokens, feature_layers=FEATURE_LAYERS)
    features, nxt = features[:, :-1], tokens[:, 1:]
    t = nxt.shape[1]
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    layer = head.config.layer_config(target.config)
    cache = init_cache(layer, 1, 16, jnp.float32)
    logits, _, _ = head_forward_cached(head.params, target.params, layer, fused_features(head.params, features),
                                       nxt, positions, cache)
    in_fc_order = np.concatenate([np.asarray(features[0, :, FEATURE_LAYERS.index(i - 1)]) for i in INPUT_IDS], -1)
    embeds = np.asarray(embed(target.params, target.config, nxt, positions)[0])
    want = reference_logits(tensors, config, in_fc_order, embeds, np.arange(t))
    np.testing.assert_allclose(np.asarray(logits[0][:, DRAFT_IDS]), want, rtol=2e-4, atol=2e-4)
    outside = np.setdiff1d(np.arange(64), DRAFT_IDS)
    assert np.all(np.asarray(logits[0][:, outside]) == OUTSIDE_DRAFT_VOCAB_LOGIT)
    trained_view = training_time_test(head.params, target.params, target.config, head.config, features, nxt, 1)[0]
    np.testing.assert_allclose(np.asarray(trained_view), np.asarray(logits), rtol=2e-4, atol=2e-4)


def test_a_head_round_trips_to_the_same_checkpoint(target, tmp_path):
    """EAGLE-3 -> our head directory -> load -> EAGLE-3 gives back every tensor (d2t and t2d
    included) and the feature layer ids; vLLM speculators' layout converts to the same head."""
    src, config, tensors = _checkpoint(tmp_path / "eagle3", target)
    target_dir = tmp_path / "target"
    os.makedirs(target_dir)
    with open(target_dir / "config.json", "w") as f:
        json.dump(target.config.to_hf(), f)
    ours = convert_eagle3(src, str(tmp_path / "ours"), str(target_dir))
    head = load_head(ours, target=target)
    back = export_eagle3(head, str(tmp_path / "back"))
    again = read_hf_tensors(back)
    fc_order = [FEATURE_LAYERS.index(i - 1) for i in INPUT_IDS]
    assert sorted(again.keys()) == sorted(tensors)
    for name, array in tensors.items():
        got = np.asarray(again[name])
        if name == "fc.weight":   # written in our (sorted) feature order
            d = target.config.hidden_size
            got = np.concatenate([got[:, k * d:(k + 1) * d] for k in fc_order], axis=1)
        np.testing.assert_array_equal(got, array, err_msg=name)
    with open(os.path.join(back, "config.json")) as f:
        assert json.load(f)["eagle_aux_hidden_state_layer_ids"] == sorted(INPUT_IDS)

    speculators = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): a
                   for k, a in tensors.items()}
    nested = {"architectures": ["Eagle3Speculator"], "draft_vocab_size": len(DRAFT_IDS),
              "eagle_aux_hidden_state_layer_ids": INPUT_IDS,
              "transformer_layer_config": {k: v for k, v in config.items()
                                           if k not in ("architectures", "draft_vocab_size",
                                                        "eagle_aux_hidden_state_layer_ids")}}
    other = eagle3_to_head(write_eagle3(str(tmp_path / "speculators"), nested, speculators), target.config)
    assert other.config == head.config
    jax.tree.map(np.testing.assert_array_equal, other.params, head.params)


@pytest.mark.parametrize("draft_ids", [DRAFT_IDS, np.arange(64)], ids=["reduced_vocab", "full_vocab"])
def test_greedy_equals_autoregressive(target, tmp_path, draft_ids):
    src, _, _ = _checkpoint(tmp_path / "eagle3", target, draft_ids=draft_ids)
    head = eagle3_to_head(src, target.config)
    ar = ssd_jax.generate(target, ROWS, max_new_tokens=16).tokens
    out = ssd_jax.generate(target, ROWS, max_new_tokens=16, method=EAGLE(draft_len=3, topk=2), draft=head)
    assert out.tokens == ar
    assert out.stats["num_accepted_tokens"] > 0


def test_auto_times_a_converted_head(target, tmp_path):
    """Under "auto" the cost model times the head as a one-layer model (`head_as_model`: its
    reduced LM head, its attention without the embedding half) and decodes exactly."""
    src, _, _ = _checkpoint(tmp_path / "eagle3", target)
    head = eagle3_to_head(src, target.config)
    out = ssd_jax.generate(target, ROWS, max_new_tokens=16, method=EAGLE(), draft=head, tuner=ssd_jax.Tuner(store=None))
    assert out.tokens == ssd_jax.generate(target, ROWS, max_new_tokens=16).tokens
    assert out.stats["planned_draft_len"] >= 1


def test_sampled_law_with_a_reduced_draft_vocabulary(tmp_path):
    """At T = 1 the tokens follow the target's law exactly when the head's q is 0 on a target
    token (here token 2, outside its 3-token draft vocabulary)."""
    law_target = llama(4, 32, 4, seed=3, scale=0.4, eos=())
    src, _, _ = _checkpoint(tmp_path / "eagle3", law_target, draft_ids=np.asarray([3, 0, 1]), seed=2)
    head = eagle3_to_head(src, law_target.config)
    sampling = SamplingParams(temperature=1.0)
    freq, stats = _empirical(law_target, head, EAGLE(draft_len=2, topk=2), sampling)
    assert stats["num_accepted_tokens"] > 0
    assert _consistent(freq, exact_law(law_target, PROMPT, sampling, LAW_NEW))


def _mutated(tensors, config, change):
    tensors, config = dict(tensors), dict(config)
    change(tensors, config)
    return tensors, config


BAD = {
    "missing": (lambda t, c: t.pop("midlayer.mlp.up_proj.weight"), "missing tensor 'midlayer.mlp.up_proj.weight'"),
    "unexpected": (lambda t, c: t.update(extra=np.zeros(3, np.float32)), "does not know: extra"),
    "misshapen": (lambda t, c: t.update({"fc.weight": t["fc.weight"][:, :64]}), r"'fc.weight' has shape \(32, 64\)"),
    "d2t_range": (lambda t, c: t.update(d2t=t["d2t"] + 100), "outside the target's vocabulary of 64"),
    "t2d": (lambda t, c: t.update(t2d=~t["t2d"]), "'t2d' and 'd2t' disagree"),
    "no_d2t": (lambda t, c: t.pop("d2t"), "no d2t"),
    "norm_before_residual": (lambda t, c: c.update(norm_before_residual=True), "norm_before_residual"),
    "width": (lambda t, c: c.update(target_hidden_size=48), "target_hidden_size=48"),
    "vocabulary": (lambda t, c: c.update(vocab_size=100), "vocabulary of 100 tokens; the target has 64"),
    "layer_ids": (lambda t, c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 9]), r"\[9\]"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_checkpoints_are_refused_by_name(target, tmp_path, case):
    _, config, tensors = _checkpoint(tmp_path / "good", target)
    change, match = BAD[case]
    tensors, config = _mutated(tensors, config, change)
    src = write_eagle3(str(tmp_path / "bad"), config, tensors)
    with pytest.raises(CheckpointError, match=match):
        eagle3_to_head(src, target.config)


def test_other_bad_input(target, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        eagle3_to_head(str(tmp_path / "nowhere"), target.config)
    os.makedirs(tmp_path / "bin")
    with open(tmp_path / "bin" / "config.json", "w") as f:
        json.dump(dict(layer_config(target.config), draft_vocab_size=40, eagle_aux_hidden_state_layer_ids=INPUT_IDS), f)
    open(tmp_path / "bin" / "pytorch_model.bin", "wb").close()
    with pytest.raises(CheckpointError, match=r"\.bin checkpoints are not supported"):
        eagle3_to_head(str(tmp_path / "bin"), target.config)
    with pytest.raises(InputError, match="style 'eagle3'"):
        export_eagle3(init_head(target), str(tmp_path / "out"))
    src, _, _ = _checkpoint(tmp_path / "eagle3", target)
    head = eagle3_to_head(src, target.config)
    other = llama(80, 32, 4, seed=1)
    with pytest.raises(InputError, match="vocab_size"):
        ssd_jax.generate(other, ROWS, max_new_tokens=4, method=EAGLE(draft_len=2), draft=head)


def test_the_command_line_converts_both_ways(target, tmp_path):
    src, _, tensors = _checkpoint(tmp_path / "eagle3", target)
    target_dir = tmp_path / "target"
    os.makedirs(target_dir)
    with open(target_dir / "config.json", "w") as f:
        json.dump(target.config.to_hf(), f)
    run = lambda *args: subprocess.run([sys.executable, "-m", "checkpoints_convert", *args], capture_output=True,
                                       text=True, cwd=REPO, timeout=300)
    done = run("--eagle3", "--target", str(target_dir), src, str(tmp_path / "ours"), "--dtype", "bfloat16")
    assert done.returncode == 0, done.stderr
    head = load_head(done.stdout.strip(), target=target)
    assert head.params["lm_head"]["kernel"].dtype == jnp.float32   # cast to the target's on load
    assert save_head(head, str(tmp_path / "copy"))
    back = run("--to-eagle3", done.stdout.strip(), str(tmp_path / "back"))
    assert back.returncode == 0, back.stderr
    np.testing.assert_array_equal(np.asarray(read_hf_tensors(back.stdout.strip())["d2t"]), tensors["d2t"])
    refused = run("--eagle3", src, str(tmp_path / "x"))
    assert refused.returncode == 2 and "--target" in refused.stderr
