"""Checkpoint conversion: HF -> ours -> HF round trips, sharded checkpoints, atomic failure."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import ssd_jax
from checkpoints_convert import export_hf, hf_to_ssd
from checkpoints_convert.safetensors_io import INDEX_NAME

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _convert_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "checkpoints_convert", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("family_name", ["llama3", "mistral", "qwen2", "qwen3", "gpt2", "llama_mqa_tied"])
def test_round_trip_through_ours_gives_same_logits(family_name, hf_family, tmp_path):
    directory, torch_model = hf_family(family_name)
    ours, back = tmp_path / "ours", tmp_path / "back"
    result = _convert_cli(directory, str(ours))
    assert result.returncode == 0, result.stderr
    assert (ours / "ssd_jax.json").exists() and (ours / "params").is_dir()
    result = _convert_cli("--to-hf", str(ours), str(back))
    assert result.returncode == 0, result.stderr
    tokens = np.random.default_rng(0).integers(0, 64, (2, 12))
    reloaded = AutoModelForCausalLM.from_pretrained(str(back)).eval()
    np.testing.assert_allclose(_torch_logits(reloaded, tokens), _torch_logits(torch_model, tokens), atol=1e-5)
    loaded = ssd_jax.load(str(ours))
    assert loaded.config == ssd_jax.load(directory).config
    np.testing.assert_allclose(np.asarray(ssd_jax.forward(loaded, tokens)), _torch_logits(torch_model, tokens),
                               rtol=1e-4, atol=1e-4)


def test_sharded_checkpoint_loads(hf_family, tmp_path):
    _, torch_model = hf_family("qwen2")
    torch_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / INDEX_NAME).exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    tokens = np.arange(1, 11)[None]
    np.testing.assert_allclose(np.asarray(ssd_jax.forward(ssd_jax.load(str(tmp_path)), tokens)),
                               _torch_logits(torch_model, tokens), rtol=1e-4, atol=1e-4)


def test_bfloat16_export_loads_in_transformers(hf_family, tmp_path):
    directory, torch_model = hf_family("llama3")
    export_hf(ssd_jax.load(directory, dtype="bfloat16"), str(tmp_path / "bf16"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), dtype=torch.float32).eval()
    tokens = np.arange(1, 9)[None]
    ref = _torch_logits(torch_model, tokens)
    assert np.abs(_torch_logits(reloaded, tokens) - ref).max() / np.abs(ref).max() < 5e-2


def test_a_checkpoint_stored_in_bfloat16_loads_unsharded(hf_family, tmp_path):
    """Hugging Face checkpoints are mostly stored in bfloat16: read without a mesh, as float32
    (exactly the stored values widened) and as bfloat16 (the stored values), each gives the greedy
    tokens of transformers on the same bfloat16 weights widened to float32."""
    _, torch_model = hf_family("llama3")
    stored = AutoModelForCausalLM.from_config(torch_model.config).eval()
    stored.load_state_dict(torch_model.state_dict())
    stored.to(torch.bfloat16).save_pretrained(tmp_path)
    widened = stored.float()
    prompt = [[3, 7, 1, 9]]
    with torch.no_grad():
        expected = widened.generate(torch.tensor(prompt), max_new_tokens=8, do_sample=False, min_new_tokens=8,
                                    pad_token_id=0)[0, 4:].tolist()
    for dtype in ("float32", "bfloat16"):
        model = ssd_jax.load(str(tmp_path), dtype=dtype)
        embed = np.asarray(model.params["embed"], np.float32)
        np.testing.assert_array_equal(embed, widened.model.embed_tokens.weight.detach().numpy())
        if dtype == "float32":
            config = dataclasses.replace(model.config, eos_token_ids=())
            tokens = ssd_jax.generate(dataclasses.replace(model, config=config), prompt, max_new_tokens=8).tokens
            assert tokens == [expected]


def test_tokenizer_and_config_files_travel(hf_family, tmp_path):
    directory, _ = hf_family("gpt2")
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    source = tmp_path / "src"
    export_hf(ssd_jax.load(directory), str(source))
    tokenizer.save(str(source / "tokenizer.json"))
    ours = hf_to_ssd(str(source), str(tmp_path / "ours"), progress=False)
    model = ssd_jax.load(ours)
    assert model.tokenizer is not None and model.tokenizer.encode("w5 w7").ids == [5, 7]
    assert json.load(open(os.path.join(ours, "config.json")))["model_type"] == "gpt2"


def test_existing_destination_is_not_clobbered(hf_family, tmp_path):
    directory, _ = hf_family("llama3")
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    result = _convert_cli(directory, str(dst))
    assert result.returncode == 2 and "not empty" in result.stderr
    assert os.listdir(dst) == ["keep.txt"]
    assert _convert_cli(directory, str(dst), "--overwrite").returncode == 0
    assert not (dst / "keep.txt").exists() and (dst / "ssd_jax.json").exists()
