"""End-to-end recipes behind `ssd-jax train` and `ssd-jax distill-draft`: corpus -> tokenizer ->
model -> optax training -> a Hugging Face directory (safetensors, config.json, tokenizer.json)."""

from __future__ import annotations

import json
import os
import time

import jax

from ssd_jax.backend import cpu_model, describe
from ssd_jax.errors import InputError
from ssd_jax.model import Model, dtype_from_name
from ssd_jax.models.params import init_params
from ssd_jax.train.corpus import collect_corpus, read_text
from ssd_jax.train.data import tokenize_files
from ssd_jax.train.losses import distillation_loss, next_token_loss
from ssd_jax.train.presets import llama_config
from ssd_jax.train.tokenizer import EOS_TOKEN, train_bpe_tokenizer
from ssd_jax.train.trainer import TrainSettings, fit


def _machine() -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), **describe()}


def _export(model: Model, out_dir: str, dtype: str, report: dict, overwrite: bool) -> str:
    from checkpoints_convert import export_hf

    out = export_hf(model, out_dir, dtype=dtype, overwrite=overwrite)
    with open(os.path.join(out, "training_report.json"), "w") as f:
        json.dump(report, f, indent=2)
    return out


def _eos_id(tokenizer) -> int:
    eos = tokenizer.token_to_id(EOS_TOKEN)
    if eos is None:
        raise InputError(f"tokenizer has no {EOS_TOKEN} token")
    return eos


def train_language_model(
    out_dir: str,
    data_dir: str | None = None,
    preset: str = "target",
    settings: TrainSettings = TrainSettings(),
    vocab_size: int = 4096,
    tokenizer_path: str | None = None,
    workdir: str | None = None,
    export_dtype: str = "bfloat16",
    overwrite: bool = False,
    progress: bool = True,
    **size_overrides,
) -> str:
    """Trains a Llama of `preset` shape on the text files of data_dir (default: the Python
    stdlib) and writes it as a Hugging Face directory. Resumes from workdir's checkpoints.
    Returns out_dir."""
    dtype_from_name(export_dtype)
    corpus = collect_corpus(data_dir)
    workdir = workdir or out_dir.rstrip("/") + ".work"
    os.makedirs(workdir, exist_ok=True)
    if tokenizer_path is None:
        tokenizer_path = os.path.join(workdir, "tokenizer.json")
        if not os.path.exists(tokenizer_path):
            tokenizer = train_bpe_tokenizer((read_text(p) for p in corpus.train), vocab_size=vocab_size)
            tokenizer.save(tokenizer_path)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_path)
    eos = _eos_id(tokenizer)
    config = llama_config(preset, tokenizer.get_vocab_size(), eos_token_id=eos, **size_overrides)
    if settings.seq_len > config.max_position_embeddings:
        raise InputError(f"seq_len {settings.seq_len} exceeds max_position_embeddings {config.max_position_embeddings}")
    train_tokens = tokenize_files(tokenizer, corpus.train, eos)
    eval_tokens = tokenize_files(tokenizer, corpus.heldout, eos)
    params = init_params(config, jax.random.PRNGKey(settings.seed))
    began = time.time()
    params, history = fit(lambda p, w: next_token_loss(p, config, w), params, train_tokens, eval_tokens,
                          settings, workdir, desc=f"train {preset}", progress=progress)
    report = dict(
        kind="language_model", preset=preset, num_params=config.num_params, corpus_root=corpus.root,
        train_files=len(corpus.train), heldout_files=len(corpus.heldout), train_tokens=int(len(train_tokens)),
        heldout_tokens=int(len(eval_tokens)), settings=settings.__dict__, seconds_this_run=time.time() - began,
        final_loss=history[-1]["loss"] if history else None,
        heldout_loss=next((h["eval_loss"] for h in reversed(history) if h.get("eval_loss") is not None), None),
        machine=_machine(),
    )
    model = Model(config=config, params=params, tokenizer=tokenizer)
    out = _export(model, out_dir, export_dtype, report, overwrite)
    tokenizer.save(os.path.join(out, "tokenizer.json"))
    return out


def distill_draft(
    target_dir: str,
    out_dir: str,
    data_dir: str | None = None,
    preset: str = "draft",
    settings: TrainSettings = TrainSettings(),
    temperature: float = 1.0,
    workdir: str | None = None,
    export_dtype: str = "bfloat16",
    overwrite: bool = False,
    progress: bool = True,
    **size_overrides,
) -> str:
    """Distils a small Llama draft from the target at target_dir (any supported family with a
    tokenizer.json) by minimising KL(target || draft) on the corpus. Returns out_dir."""
    from ssd_jax.loading import load

    dtype_from_name(export_dtype)
    if not temperature > 0:
        raise InputError(f"distillation temperature must be > 0, got {temperature}")
    target = load(target_dir, dtype="float32")
    if target.tokenizer is None:
        raise InputError(f"target {target_dir} has no tokenizer.json; the draft must share the target's tokenizer")
    corpus = collect_corpus(data_dir)
    eos = target.config.eos_token_ids[0] if target.config.eos_token_ids else _eos_id(target.tokenizer)
    config = llama_config(preset, target.config.vocab_size, eos_token_id=eos,
                          max_position_embeddings=target.config.max_position_embeddings, **size_overrides)
    if settings.seq_len > config.max_position_embeddings:
        raise InputError(f"seq_len {settings.seq_len} exceeds max_position_embeddings {config.max_position_embeddings}")
    train_tokens = tokenize_files(target.tokenizer, corpus.train, eos)
    eval_tokens = tokenize_files(target.tokenizer, corpus.heldout, eos)
    workdir = workdir or out_dir.rstrip("/") + ".work"
    target_params, target_config = target.params, target.config

    def loss(params, windows):
        return distillation_loss(params, config, target_params, target_config, windows, temperature)

    began = time.time()
    params, history = fit(loss, init_params(config, jax.random.PRNGKey(settings.seed + 1)), train_tokens,
                          eval_tokens, settings, workdir, desc=f"distill {preset}", progress=progress)
    report = dict(
        kind="distilled_draft", preset=preset, num_params=config.num_params, target=os.path.abspath(target_dir),
        corpus_root=corpus.root, train_tokens=int(len(train_tokens)), settings=settings.__dict__,
        temperature=temperature, seconds_this_run=time.time() - began,
        final_kl=history[-1]["loss"] if history else None,
        heldout_kl=next((h["eval_loss"] for h in reversed(history) if h.get("eval_loss") is not None), None),
        machine=_machine(),
    )
    model = Model(config=config, params=params, tokenizer=target.tokenizer, path=target.path)
    return _export(model, out_dir, export_dtype, report, overwrite)
