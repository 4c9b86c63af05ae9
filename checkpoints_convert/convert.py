"""Conversions between Hugging Face directories and ours, written atomically: the result is
assembled in a temporary sibling directory and renamed into place only when complete."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile

import jax
import numpy as np

from checkpoints_convert.hf_mapping import hf_to_params, params_to_hf
from checkpoints_convert.orbax_io import save_params
from checkpoints_convert.safetensors_io import read_hf_tensors, write_hf_tensors
from ssd_jax.errors import CheckpointError, InputError
from ssd_jax.loading import load, read_config
from ssd_jax.model import Model, dtype_from_name
from ssd_jax.models.params import validate_params
from ssd_jax.runtime.progress import Progress

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
    "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
)


def resolve_source(src: str) -> str:
    """A local directory, or a hub repo id downloaded with huggingface_hub when it is installed."""
    if os.path.isdir(src):
        return src
    if os.path.exists(src):
        raise InputError(f"source {src!r} is a file; pass a model directory")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise InputError(f"source directory {src!r} does not exist (install huggingface_hub to use hub ids)") from None
    try:
        return snapshot_download(src, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
    except Exception as err:
        raise InputError(f"{src!r} is neither a local directory nor a downloadable hub repo: {err}") from None


@contextlib.contextmanager
def _atomic_directory(dst: str, overwrite: bool):
    """Yields a temporary directory that becomes dst on success and vanishes on failure."""
    dst = os.path.abspath(dst)
    if os.path.exists(dst):
        if not os.path.isdir(dst):
            raise InputError(f"destination {dst} exists and is a file")
        if os.listdir(dst) and not overwrite:
            raise InputError(f"destination {dst} exists and is not empty (pass --overwrite to replace it)")
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(dst) + ".partial-", dir=parent)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # mkdtemp makes a private (0700) directory; a model directory is ordinary readable data.
    os.chmod(tmp, 0o755)
    for name in os.listdir(tmp):
        path = os.path.join(tmp, name)
        if os.path.isfile(path):
            os.chmod(path, 0o644)
    if os.path.exists(dst):
        shutil.rmtree(dst)
    os.replace(tmp, dst)


def _copy_tokenizer_files(src: str, dst: str) -> None:
    for name in TOKENIZER_FILES:
        path = os.path.join(src, name)
        if os.path.exists(path):
            shutil.copy2(path, os.path.join(dst, name))


def _write_config(config, dst: str) -> None:
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config.to_hf(), f, indent=2, sort_keys=True)


def hf_to_ssd(src: str, dst: str, dtype: str = "float32", overwrite: bool = False, progress: bool = True) -> str:
    """Hugging Face directory (or hub id) -> our directory (config.json, ssd_jax.json, orbax params/,
    tokenizer files). Returns dst. Nothing is left at dst if it fails."""
    target_dtype = dtype_from_name(dtype)
    src = resolve_source(src)
    config = read_config(src)
    tensors = read_hf_tensors(src)
    with _atomic_directory(dst, overwrite) as tmp:
        name = os.path.basename(os.path.normpath(src))
        with Progress(len(tensors) + 1, f"convert {name}", unit="tensors", enabled=progress) as bar:
            params = hf_to_params(config, tensors, dtype=np.dtype(target_dtype), on_tensor=bar.update)
            validate_params(config, params)
            save_params(tmp, params, dtype)
            _write_config(config, tmp)
            _copy_tokenizer_files(src, tmp)
            bar.update(bar.total - bar.count)
    return os.path.abspath(dst)


def export_hf(model: Model, dst: str, dtype: str | None = None, overwrite: bool = False) -> str:
    """Writes `model` as a Hugging Face directory (safetensors + config.json + tokenizer files)
    that transformers' AutoModelForCausalLM.from_pretrained loads. Returns dst."""
    params = model.params
    if dtype is not None:
        cast = dtype_from_name(dtype)
        params = jax.tree.map(lambda a: a.astype(cast), params)
    validate_params(model.config, params)
    tensors = params_to_hf(model.config, jax.tree.map(np.asarray, params))
    with _atomic_directory(dst, overwrite) as tmp:
        write_hf_tensors(tmp, tensors)
        _write_config(model.config, tmp)
        if model.path:
            _copy_tokenizer_files(model.path, tmp)
        elif model.tokenizer is not None:
            model.tokenizer.save(os.path.join(tmp, "tokenizer.json"))
    return os.path.abspath(dst)


def ssd_to_hf(src: str, dst: str, dtype: str | None = None, overwrite: bool = False) -> str:
    """Our directory (or a Hugging Face one) -> a Hugging Face directory. Returns dst."""
    if not os.path.isdir(src):
        raise CheckpointError(f"model directory {src!r} does not exist")
    return export_hf(load(src), dst, dtype=dtype, overwrite=overwrite)
