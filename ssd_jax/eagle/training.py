"""Training a feature-level head for a target: `train_head` and `ssd-jax train-head`.

The target is frozen. Each optax step runs it over a batch of windows for its logits and the
features the head reads, then the head's training-time test (`forward.training_time_test`):
every draft depth 1..passes at every position at once, each depth reading the head's own output
of the depth before, as drafting does. The loss is the mean over depths of KL(target || head)
at the distillation temperature, which is what acceptance (sum_x min(p, q)) rewards.
Training state is checkpointed with orbax (`ssd_jax.train.trainer.fit`: a rerun resumes);
the trained head is written with `save_head`.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.eagle.checkpoint import save_head
from ssd_jax.eagle.forward import training_time_test
from ssd_jax.eagle.head import EagleHead, HeadConfig, init_head
from ssd_jax.errors import InputError
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.transformer import forward_full
from ssd_jax.train.trainer import TrainSettings, fit

DEFAULT_PASSES = 4   # draft depths simulated per step (EAGLE-3 trains on up to 7; 4 is this loop's default length)


def _target_view(target_params: dict, target_config: ModelConfig, config: HeadConfig, windows: jax.Array):
    """(target logits float32 [B, T, V] at positions 1..T, features [B, T, K, D] at 0..T-1) of
    windows int32 [B, T + 1], without gradients: the head's distillation targets and inputs."""
    logits, features = forward_full(target_params, target_config, windows, feature_layers=config.feature_layers)
    return jax.lax.stop_gradient(logits[:, 1:]), jax.lax.stop_gradient(features[:, :-1])


def head_loss(head_params: dict, target_params: dict, target_config: ModelConfig, config: HeadConfig,
              windows: jax.Array, passes: int = DEFAULT_PASSES, temperature: float = 1.0) -> jax.Array:
    """Mean over draft depths 1..passes of the mean KL(target || head) per scored position
    (nats), windows int32 [B, T + 1]. Depth s is scored at positions t >= s - 1 (those with a
    root before them)."""
    p_logits, features = _target_view(target_params, target_config, config, windows)
    per_depth = training_time_test(head_params, target_params, target_config, config, features, windows[:, 1:],
                                   passes)
    p_log = jax.nn.log_softmax(p_logits / temperature, axis=-1)
    positions = jnp.arange(p_logits.shape[1])
    total = 0.0
    for depth, q_logits in enumerate(per_depth, 1):
        q_log = jax.nn.log_softmax(q_logits / temperature, axis=-1)
        kl = jnp.sum(jnp.exp(p_log) * (p_log - q_log), axis=-1)   # [B, T]
        scored = (positions >= depth - 1)[None, :]
        total = total + jnp.sum(jnp.where(scored, kl, 0.0)) / (jnp.sum(scored) * kl.shape[0])
    return total / passes


def head_acceptance(head: EagleHead, target, windows: list[np.ndarray], passes: int = DEFAULT_PASSES) -> dict:
    """Held-out acceptance by draft depth on windows (each int32 [B, T + 1]), every earlier depth
    taken as accepted (the tokens are the text's): `greedy`, the share of positions where the
    head's argmax is the target's (T = 0), and `sampled`, the mean of sum_x min(p, q) (T = 1:
    the chance a token drawn from q is accepted). Lists of floats, depth 1 first."""
    config = head.config

    @jax.jit
    def scores(head_params, w):
        p_logits, features = _target_view(target.params, target.config, config, w)
        per_depth = training_time_test(head_params, target.params, target.config, config, features, w[:, 1:], passes)
        p = jax.nn.softmax(p_logits, axis=-1)
        out = []
        for depth, q_logits in enumerate(per_depth, 1):
            scored = jnp.broadcast_to((jnp.arange(p.shape[1]) >= depth - 1)[None, :], p.shape[:2])
            same = jnp.argmax(q_logits, -1) == jnp.argmax(p_logits, -1)
            overlap = jnp.sum(jnp.minimum(p, jax.nn.softmax(q_logits, axis=-1)), axis=-1)
            out.append(jnp.stack([jnp.sum(jnp.where(scored, same, 0.0)), jnp.sum(jnp.where(scored, overlap, 0.0)),
                                  jnp.sum(scored)]))
        return jnp.stack(out)

    if not windows:
        raise InputError("head_acceptance needs at least one held-out window")
    sums = sum(np.asarray(scores(head.params, jnp.asarray(w))) for w in windows)
    return dict(greedy=[float(g / n) for g, _, n in sums], sampled=[float(s / n) for _, s, n in sums])


def train_head(
    target,
    out_dir: str,
    data_dir: str | None = None,
    settings: TrainSettings = TrainSettings(steps=600, batch_size=8, seq_len=128, learning_rate=2e-3),
    feature_layers: tuple[int, ...] | None = None,
    intermediate_size: int | None = None,
    passes: int = DEFAULT_PASSES,
    temperature: float = 1.0,
    workdir: str | None = None,
    export_dtype: str = "float32",
    overwrite: bool = False,
    progress: bool = True,
) -> EagleHead:
    """Trains a head for target (a `Model` with a tokenizer) on the text files of data_dir (default:
    the Python standard library, split as `ssd_jax.train.corpus` does) and writes it to out_dir
    with a training report: losses, and held-out acceptance by depth before and after training.
    Resumes from workdir's orbax checkpoints (default out_dir + ".work"). Returns the head.
    InputError for a target without a tokenizer, an empty corpus or bad sizes."""
    from ssd_jax.train.corpus import collect_corpus
    from ssd_jax.train.data import eval_batches, tokenize_files

    if target.tokenizer is None:
        raise InputError("the target has no tokenizer; a head is trained on text the target's tokenizer reads")
    if passes < 1:
        raise InputError(f"passes (draft depths trained) must be >= 1, got {passes}")
    if not temperature > 0:
        raise InputError(f"distillation temperature must be > 0, got {temperature}")
    if settings.seq_len + 1 > target.config.max_position_embeddings:
        raise InputError(f"seq_len {settings.seq_len} exceeds the target's max_position_embeddings "
                         f"{target.config.max_position_embeddings}")
    head = init_head(target, feature_layers, intermediate_size, seed=settings.seed)
    corpus = collect_corpus(data_dir)
    eos = target.config.eos_token_ids[0] if target.config.eos_token_ids else 0
    train_tokens = tokenize_files(target.tokenizer, corpus.train, eos)
    eval_tokens = tokenize_files(target.tokenizer, corpus.heldout, eos)
    if len(train_tokens) < settings.seq_len + 2:
        raise InputError(f"the training corpus at {corpus.root} has {len(train_tokens)} tokens, fewer than one "
                         f"window of seq_len={settings.seq_len} + 2")
    config, tparams, tcfg = head.config, target.params, target.config
    held_out = eval_batches(eval_tokens if len(eval_tokens) > settings.seq_len + 1 else train_tokens,
                            settings.batch_size, settings.seq_len, settings.eval_batches)
    before = head_acceptance(head, target, held_out, passes)

    def loss(params, windows):
        return head_loss(params, tparams, tcfg, config, windows, passes, temperature)

    began = time.time()
    params, history = fit(loss, head.params, train_tokens, eval_tokens, settings,
                          workdir or out_dir.rstrip("/") + ".work", desc="train head", progress=progress)
    head = head.with_params(params)
    after = head_acceptance(head, target, held_out, passes)
    report = dict(
        kind="eagle_head", target=target.path, feature_layers=list(config.feature_layers),
        intermediate_size=config.intermediate_size, num_params=head.num_params, passes=passes,
        temperature=temperature, corpus_root=corpus.root, train_tokens=int(len(train_tokens)),
        heldout_tokens=int(len(eval_tokens)), settings=settings.__dict__, seconds_this_run=time.time() - began,
        final_loss=history[-1]["loss"] if history else None,
        heldout_loss=next((h["eval_loss"] for h in reversed(history) if h.get("eval_loss") is not None), None),
        heldout_acceptance_untrained=before, heldout_acceptance=after,
    )
    path = save_head(head, out_dir, dtype=export_dtype, report=report, overwrite=overwrite)
    if progress:
        print(f"head: {head.num_params / 1e6:.2f}M params -> {path}\n"
              f"held-out acceptance by depth, greedy: {_fmt(before['greedy'])} untrained, {_fmt(after['greedy'])} "
              f"trained; sampled (T=1): {_fmt(after['sampled'])}")
    return EagleHead(config=head.config, params=head.params, path=path)


def _fmt(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)
