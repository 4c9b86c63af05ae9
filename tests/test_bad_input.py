"""Bad input: a project exception whose message names the problem; nothing half-written."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import ssd_jax
from checkpoints_convert import hf_to_ssd
from ssd_jax.errors import CheckpointError, ConfigError, InputError, SsdJaxError


def _encoding(text: str):
    """A tokenizers.Encoding, what `model.tokenizer.encode` returns."""
    import tokenizers

    words = {"[UNK]": 0, "a": 1, "b": 2}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return tokenizer.encode(text)


@pytest.fixture
def llama_copy(hf_family, tmp_path):
    directory, _ = hf_family("llama3")
    copy = tmp_path / "model"
    shutil.copytree(directory, copy)
    return copy


@pytest.fixture(scope="module")
def model(hf_family):
    return ssd_jax.load(hf_family("llama3")[0])


def test_missing_config(llama_copy):
    os.remove(llama_copy / "config.json")
    with pytest.raises(ConfigError, match="missing config.json"):
        ssd_jax.load(str(llama_copy))


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        ssd_jax.load(str(tmp_path / "nowhere"))


def test_missing_weights(llama_copy):
    os.remove(llama_copy / "model.safetensors")
    with pytest.raises(CheckpointError, match="no weights"):
        ssd_jax.load(str(llama_copy))


def test_missing_tensor(llama_copy):
    tensors = load_file(str(llama_copy / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(llama_copy / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight"):
        ssd_jax.load(str(llama_copy))


def test_unsupported_model_type(llama_copy):
    config = json.load(open(llama_copy / "config.json"))
    config["model_type"] = "falcon"
    json.dump(config, open(llama_copy / "config.json", "w"))
    with pytest.raises(ConfigError, match="falcon") as err:
        ssd_jax.load(str(llama_copy))
    assert "llama" in str(err.value) and "gpt2" in str(err.value)


def test_unsupported_rope_scaling(llama_copy):
    config = json.load(open(llama_copy / "config.json"))
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    json.dump(config, open(llama_copy / "config.json", "w"))
    with pytest.raises(ConfigError, match="yarn"):
        ssd_jax.load(str(llama_copy))


def test_tensor_of_wrong_shape(llama_copy):
    tensors = load_file(str(llama_copy / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((7, 64), np.float32)
    save_file(tensors, str(llama_copy / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"k_proj.weight.*\(7, 64\).*expected \(32, 64\)"):
        ssd_jax.load(str(llama_copy))


def test_corrupt_safetensors(llama_copy):
    data = (llama_copy / "model.safetensors").read_bytes()
    (llama_copy / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match="corrupt"):
        ssd_jax.load(str(llama_copy))


def test_failed_conversion_writes_nothing(llama_copy, tmp_path):
    data = (llama_copy / "model.safetensors").read_bytes()
    (llama_copy / "model.safetensors").write_bytes(b"\x08" + data[1:64])
    dst = tmp_path / "out"
    with pytest.raises(CheckpointError):
        hf_to_ssd(str(llama_copy), str(dst), progress=False)
    assert not dst.exists()
    assert not [p for p in os.listdir(tmp_path) if "partial" in p]


def test_failed_conversion_midway_writes_nothing(llama_copy, tmp_path):
    tensors = load_file(str(llama_copy / "model.safetensors"))
    tensors["model.norm.weight"] = np.zeros((3,), np.float32)  # fails after most tensors were read
    save_file(tensors, str(llama_copy / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        hf_to_ssd(str(llama_copy), str(tmp_path / "out"), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["model"]


@pytest.mark.parametrize(
    "prompts, kwargs, match",
    [
        ([[1, 2, 96]], {}, "token id 96 outside the vocabulary"),
        ([[1, -3]], {}, "token id -3"),
        ([[1, 2], []], {}, "prompt 1 is empty"),
        ([], {}, "prompt_ids is empty"),
        ([1, 2, 3], {}, "list of token-id lists"),
        (["hello"], {}, "is a string"),
        ([_encoding("a b")], {}, r"prompt 0 is of type Encoding, not token ids; pass its \.ids"),
        ([[1.5, 2.0]], {}, "non-integer"),
        ([[1] * 200], {"max_new_tokens": 100}, "max_position_embeddings=256"),
        ([[1, 2]], {"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
        ([[1, 2]], {"temperature": -0.5}, "temperature must be"),
        ([[1, 2]], {"temperature": float("nan")}, "temperature must be"),
        ([[1, 2]], {"temperature": 1.0, "top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ([[1, 2]], {"temperature": 1.0, "top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ([[1, 2]], {"temperature": 1.0, "top_k": 0}, "top_k must be an integer >= 1"),
        ([[1, 2]], {"method": "telepathy"}, "unknown method 'telepathy'"),
        ([[1, 2]], {"num_paths": 3}, "AR has no option for num_paths"),
        ([[1, 2]], {"key": np.zeros((3, 2), np.uint32)}, "3 keys for a batch of 1"),
    ],
)
def test_generate_rejects(model, prompts, kwargs, match):
    kwargs.setdefault("max_new_tokens", 4)
    with pytest.raises(InputError, match=match):
        ssd_jax.generate(model, prompts, **kwargs)


def test_forward_rejects_out_of_vocab(model):
    with pytest.raises(InputError, match="token id 500"):
        ssd_jax.forward(model, np.array([[1, 500]]))


def test_bad_dtype(hf_family):
    with pytest.raises(InputError, match="unsupported dtype 'int8'"):
        ssd_jax.load(hf_family("llama3")[0], dtype="int8")


def test_all_project_errors_share_a_base():
    for cls in (CheckpointError, ConfigError, InputError):
        assert issubclass(cls, SsdJaxError)
