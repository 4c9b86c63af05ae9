"""A generic optax training loop with resumable orbax checkpoints and a progress bar."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ssd_jax.errors import InputError
from ssd_jax.runtime.progress import Progress
from ssd_jax.train.data import batch_at, eval_batches


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """Optimisation hyper-parameters. AdamW with linear warmup then cosine decay to 10% of the
    peak rate, global-norm gradient clipping, weight decay on matrices only."""

    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 50
    eval_every: int = 250
    eval_batches: int = 8

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.learning_rate > 0:
            raise InputError(f"learning_rate must be > 0, got {self.learning_rate}")
        if not 0 <= self.warmup_steps < self.steps:
            raise InputError(f"warmup_steps must be in [0, steps={self.steps}), got {self.warmup_steps}")


def make_optimizer(settings: TrainSettings) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=settings.learning_rate, warmup_steps=settings.warmup_steps,
        decay_steps=settings.steps, end_value=settings.learning_rate * 0.1,
    )
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(settings.grad_clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=settings.weight_decay, mask=decay_mask),
    )


def _checkpoint_manager(workdir: str, settings: TrainSettings):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=1, enable_async_checkpointing=False)
    return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")), options=options)


def fit(
    loss_fn: Callable[[dict, jax.Array], jax.Array],
    params: dict,
    train_tokens: np.ndarray,
    eval_tokens: np.ndarray | None,
    settings: TrainSettings,
    workdir: str,
    desc: str = "train",
    progress: bool = True,
) -> tuple[dict, list[dict]]:
    """Minimises loss_fn(params, windows int32 [B, T+1]) over random windows of train_tokens.

    Checkpoints {params, opt_state} to workdir/checkpoints every settings.checkpoint_every steps;
    if a checkpoint exists there, training resumes from it (same batches as an uninterrupted run).
    Returns (params, history); history rows are also appended to workdir/history.jsonl.
    """
    import orbax.checkpoint as ocp

    os.makedirs(workdir, exist_ok=True)
    optimizer = make_optimizer(settings)
    params = jax.tree.map(jnp.array, params)  # the step donates its state: keep the caller's arrays alive
    state = {"params": params, "opt_state": optimizer.init(params)}
    manager = _checkpoint_manager(workdir, settings)
    start = 0
    if manager.latest_step() is not None:
        start = int(manager.latest_step())
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        state = manager.restore(start, args=ocp.args.StandardRestore(abstract))
        print(f"{desc}: resuming from step {start} ({workdir})")

    def train_step(state, windows):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], windows)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

    step_fn = jax.jit(train_step, donate_argnums=(0,))
    eval_fn = jax.jit(loss_fn)
    evals = eval_batches(eval_tokens, settings.batch_size, settings.seq_len, settings.eval_batches) \
        if eval_tokens is not None and len(eval_tokens) else []

    def evaluate(params) -> float | None:
        return float(np.mean([float(eval_fn(params, jnp.asarray(w))) for w in evals])) if evals else None

    history: list[dict] = []
    history_path = os.path.join(workdir, "history.jsonl")
    tokens_per_step = settings.batch_size * settings.seq_len
    with Progress(settings.steps, desc, unit="steps", enabled=progress) as bar:
        bar.count = start
        began = time.perf_counter()
        for step in range(start, settings.steps):
            windows = jnp.asarray(batch_at(train_tokens, step, settings.batch_size, settings.seq_len, settings.seed))
            state, loss = step_fn(state, windows)
            loss = float(loss)
            if not np.isfinite(loss):
                raise FloatingPointError(f"{desc}: loss became {loss} at step {step + 1}")
            done = step + 1
            row = {"step": done, "loss": loss}
            if settings.eval_every and (done % settings.eval_every == 0 or done == settings.steps):
                row["eval_loss"] = evaluate(state["params"])
            if done % settings.checkpoint_every == 0 or done == settings.steps:
                manager.save(done, args=ocp.args.StandardSave(state))
            history.append(row)
            with open(history_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            rate = (done - start) * tokens_per_step / (time.perf_counter() - began)
            bar.update(1, loss=loss, tok_s=rate, **({"eval": row["eval_loss"]} if row.get("eval_loss") else {}))
    manager.wait_until_finished()
    manager.close()
    return jax.tree.map(jnp.asarray, state["params"]), history
