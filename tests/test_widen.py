"""`ssd_jax.testing.widen`: every family's random model widened (MLP units, layers, query heads)
keeps its float32 logits within 1e-5 and grows; the parts that must be zero are what keep it
exact (a control); the KV-cache path keeps them (Gemma 3); greedy AR on the widened embedded
target gives the original's tokens; a sharded model is resharded by its own rules (2 fake devices,
in a subprocess); bad input is an InputError naming the value."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import ssd_jax
from cached_logits import incremental_logits
from hf_models import FAMILY_CONFIGS, NEW_FAMILY_CONFIGS
from ssd_jax.errors import InputError
from ssd_jax.model import Model
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import init_params
from ssd_jax.models.transformer import unstack_layers
from ssd_jax.testing import widen
from subprocess_env import fake_devices_env

HERE = os.path.dirname(os.path.abspath(__file__))
FAMILIES = {**FAMILY_CONFIGS, **NEW_FAMILY_CONFIGS}
ATOL = 1e-5
HEADS = "kv"  # in a case: extra_heads = num_kv_heads (none for GPT-2, which refuses extra heads)
# (mlp_multiple, extra_layers, extra_heads): the default run covers each value once per family.
CASES = [(2, 0, 0), (3, 2, HEADS)]
OTHER_CASES = [(m, n, h) for m in (2, 3) for n in (0, 2) for h in (0, HEADS) if (m, n, h) not in CASES]


def random_model(name: str, seed: int = 0) -> Model:
    """A random float32 model of the family, its norms and biases perturbed (as tests/hf_models.py
    does) so that none is the identity or zero."""
    config = ModelConfig.from_hf(dict(FAMILIES[name], bos_token_id=1, eos_token_id=2, pad_token_id=0))
    key = jax.random.PRNGKey(seed)
    params = init_params(config, key, scale=0.15)

    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = []
    for index, (path, leaf) in enumerate(flat):
        name = str(getattr(path[-1], "key", ""))
        noise = jax.random.normal(jax.random.fold_in(key, 1000 + index), leaf.shape, leaf.dtype)
        leaves.append(leaf + 0.1 * noise if name == "scale" else leaf + 0.05 * noise if name == "bias" else leaf)
    return Model(config=config, params=jax.tree_util.tree_unflatten(treedef, leaves))


def _tokens(config: ModelConfig) -> np.ndarray:
    """Three sequences of 12 tokens (longer than every test config's sliding window)."""
    return np.random.default_rng(0).integers(0, config.vocab_size, (3, 12)).astype(np.int32)


def _size(model: Model) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(model.params))


def _heads(case_heads, config: ModelConfig) -> int:
    return (0 if config.model_type == "gpt2" else config.num_kv_heads) if case_heads == HEADS else case_heads


def _check_family(name: str, cases) -> None:
    model = random_model(name)
    tokens = _tokens(model.config)
    base = np.asarray(ssd_jax.forward(model, tokens))
    for multiple, layers, case_heads in cases:
        heads = _heads(case_heads, model.config)
        wide = widen(model, mlp_multiple=multiple, extra_layers=layers, extra_heads=heads)
        c, w = model.config, wide.config
        assert (w.intermediate_size, w.num_layers, w.num_heads, w.num_kv_heads, w.head_dim) == (
            c.intermediate_size * multiple, c.num_layers + layers, c.num_heads + heads, c.num_kv_heads, c.head_dim)
        assert w.num_params > c.num_params and _size(wide) > _size(model)
        if c.layer_types:  # the per-layer pattern continues in a cycle
            assert w.layer_types == c.layer_types + tuple(c.layer_types[j % c.num_layers] for j in range(layers))
        assert ModelConfig.from_hf(w.to_hf()) == w  # the widened config.json describes the widened model
        gap = float(np.abs(np.asarray(ssd_jax.forward(wide, tokens)) - base).max())
        print(f"{name} mlp_multiple={multiple} extra_layers={layers} extra_heads={heads}: max |logit diff| {gap:.2e}")
        assert gap <= ATOL, (name, multiple, layers, heads, gap)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_widened_random_model_keeps_its_logits(name):
    _check_family(name, CASES)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_widened_random_model_keeps_its_logits_in_every_combination(name):
    _check_family(name, OTHER_CASES)


def test_new_units_are_random_and_only_the_zero_parts_keep_the_logits():
    """The new gate/up columns, q columns and layers are random (no unit is skipped for being
    zero), and filling each block that widen leaves zero changes the logits: those blocks, not an
    accident of the test, are what keep them."""
    model = random_model("llama3")
    c = model.config
    wide = widen(model, mlp_multiple=2, extra_layers=1, extra_heads=c.num_kv_heads, key=jax.random.PRNGKey(7))
    layers = wide.params["layers"]
    f, hd, n = c.intermediate_size, c.head_dim, c.num_layers
    new_gate = np.asarray(layers["gate"]["kernel"][:n, :, f:])
    assert np.all(np.abs(new_gate).max(axis=1) > 0)  # every new unit has nonzero weights
    q = np.asarray(layers["q"]["kernel"]).reshape(n + 1, c.hidden_size, c.num_kv_heads, -1, hd)
    assert np.all(np.abs(q[:n, :, :, c.num_groups:]).max(axis=(1, 4)) > 0)
    assert np.abs(np.asarray(layers["up"]["kernel"][n])).min() > 0  # the new layer is random, not a copy
    assert not np.array_equal(np.asarray(layers["q"]["kernel"][n]), np.asarray(layers["q"]["kernel"][0]))
    # A different key gives different new weights and the same logits.
    other = widen(model, mlp_multiple=2, extra_layers=1, extra_heads=c.num_kv_heads, key=3)
    assert not np.array_equal(np.asarray(other.params["layers"]["up"]["kernel"]), np.asarray(layers["up"]["kernel"]))

    tokens = _tokens(c)
    base = np.asarray(ssd_jax.forward(model, tokens))
    assert np.abs(np.asarray(ssd_jax.forward(wide, tokens)) - base).max() <= ATOL
    o_rows = np.asarray(layers["o"]["kernel"]).reshape(n + 1, c.num_kv_heads, -1, hd, c.hidden_size)
    assert not o_rows[:n, :, c.num_groups:].any() and not np.asarray(layers["o"]["kernel"][n]).any()
    assert not np.asarray(layers["down"]["kernel"][:, f:]).any() and not np.asarray(layers["down"]["kernel"][n]).any()
    fill = lambda a, where: a.at[where].set(0.1)  # noqa: E731
    breaks = {
        "new MLP units' down rows": ("down", (slice(0, n), slice(f, None))),
        "new heads' o rows": ("o", (slice(0, n), slice(c.num_groups * hd, (c.num_groups + 1) * hd))),
        "new layer's o": ("o", (n,)),
        "new layer's down": ("down", (n,)),
    }
    for what, (leaf, where) in breaks.items():
        broken = dict(layers, **{leaf: dict(layers[leaf], kernel=fill(layers[leaf]["kernel"], where))})
        logits = ssd_jax.forward(wide.with_params(dict(wide.params, layers=broken)), tokens)
        gap = np.abs(np.asarray(logits) - base).max()
        assert gap > 1e-3, what


def test_greedy_ar_on_the_widened_embedded_target_gives_the_original_tokens():
    target, _ = ssd_jax.default_models("float32")
    wide = widen(target, mlp_multiple=2, extra_layers=2, extra_heads=target.config.num_kv_heads)
    assert wide.tokenizer is target.tokenizer and wide.path is None and wide.placement is None
    assert wide.config.num_params > 1.5 * target.config.num_params
    prompts = [target.tokenizer.encode(text).ids for text in ("import os\n\n\ndef ", "class Stack:\n    def ")]
    expected = ssd_jax.generate(target, prompts, max_new_tokens=16)
    out = ssd_jax.generate(wide, prompts, max_new_tokens=16)
    assert out.tokens == expected.tokens and out.finish_reasons == expected.finish_reasons


def test_cached_decoding_with_sliding_windows_and_sandwich_norms():
    """Gemma 3 (sliding and global layers, sandwich norms, q/k norms) widened every way gives the
    original's logits through the KV cache too (the new layers get caches of their own), in
    chunks that cross the sliding window."""
    model = random_model("gemma3_text")
    wide = widen(model, mlp_multiple=2, extra_layers=2, extra_heads=model.config.num_kv_heads)
    tokens = _tokens(model.config)
    sizes = (7, 1, 4)
    gap = np.abs(incremental_logits(wide, tokens, sizes) - incremental_logits(model, tokens, sizes)).max()
    assert gap <= ATOL, gap


_SHARDED_SCRIPT = """
import jax, numpy as np, ssd_jax
from ssd_jax.model import Model
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import init_params
from ssd_jax.testing import widen
config = ModelConfig.from_hf(dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                  max_position_embeddings=64))
model = Model(config, init_params(config, jax.random.PRNGKey(0), scale=0.15))
sharded = ssd_jax.shard(model, jax.make_mesh((1, 2), ("data", "model")))
wide = widen(sharded, mlp_multiple=2, extra_layers=1, extra_heads=2, reshard=True)
assert wide.placement == sharded.placement, (wide.placement, sharded.placement)
for leaf, axis in (("gate", -1), ("q", -1), ("down", -2), ("o", -2)):
    spec = wide.params["layers"][leaf]["kernel"].sharding.spec
    assert spec[axis] == "model", (leaf, spec)
tokens = np.arange(24).reshape(2, 12) % 96
gap = np.abs(np.asarray(ssd_jax.forward(wide, tokens)) - np.asarray(ssd_jax.forward(model, tokens))).max()
assert gap <= 1e-5, gap
print("sharded gap", gap)
"""


def test_a_sharded_model_is_resharded_by_its_own_rules():
    proc = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT], cwd=os.path.dirname(HERE),
                          env=fake_devices_env(2), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "sharded gap" in proc.stdout


@dataclasses.dataclass(frozen=True)
class _FakePlacement:
    """Stands for a `Placement` (a real one needs several devices: see the test above)."""

    mesh: object = None
    rules: tuple = (("heads", ("model",)),)


@pytest.mark.parametrize("kwargs, match", [
    (dict(mlp_multiple=0), "mlp_multiple must be a positive integer, got 0"),
    (dict(mlp_multiple=-2), "mlp_multiple must be a positive integer, got -2"),
    (dict(mlp_multiple=1.5), "mlp_multiple must be a positive integer, got 1.5"),
    (dict(mlp_multiple=2.0), "mlp_multiple must be a positive integer, got 2.0"),
    (dict(mlp_multiple=True), "mlp_multiple must be a positive integer, got True"),
    (dict(mlp_multiple="2"), "mlp_multiple must be a positive integer, got '2'"),
    (dict(extra_layers=-1), "extra_layers must be an integer >= 0, got -1"),
    (dict(extra_layers=0.5), "extra_layers must be an integer >= 0, got 0.5"),
    (dict(extra_heads=-2), "extra_heads must be an integer >= 0, got -2"),
    (dict(extra_heads=1), "extra_heads=1 must be a multiple of num_kv_heads=2"),
    (dict(extra_heads=3), "extra_heads=3 must be a multiple of num_kv_heads=2"),
    (dict(key="seven"), "key must be a jax PRNG key.*'seven'"),
    (dict(reshard="yes"), "reshard must be True or False, got 'yes'"),
])
def test_bad_arguments_are_input_errors_naming_the_value(kwargs, match):
    with pytest.raises(InputError, match=match):
        widen(random_model("llama3"), **kwargs)


def test_refused_models_are_input_errors():
    with pytest.raises(InputError, match="widen\\(\\) takes an ssd_jax Model, got dict"):
        widen({"params": {}}, mlp_multiple=2)
    # A family that cannot be kept exact: GPT-2 cannot take extra query heads.
    gpt2 = random_model("gpt2")
    with pytest.raises(InputError, match="extra_heads=4: a gpt2 model cannot take extra query heads"):
        widen(gpt2, extra_heads=4)
    widen(gpt2, mlp_multiple=2, extra_layers=1)  # its MLP and layers can be widened
    # Sandwich norms of a zero block output are zero only when eps > 0.
    gemma2 = random_model("gemma2")
    no_eps = Model(dataclasses.replace(gemma2.config, norm_eps=0.0), gemma2.params)
    with pytest.raises(InputError, match="extra_layers=1: model_type 'gemma2' with sandwich norms and norm_eps=0.0"):
        widen(no_eps, extra_layers=1)
    widen(no_eps, mlp_multiple=2, extra_heads=2)  # no new layer, nothing normed from zero
    # A sharded model without reshard=True (which would shard the new units by the same rules).
    llama = random_model("llama3")
    placed = dataclasses.replace(llama, placement=_FakePlacement())
    with pytest.raises(InputError, match="the model is sharded .*rules \\(\\('heads', \\('model',\\)\\),\\).*"
                                         "pass reshard=True"):
        widen(placed, mlp_multiple=2)
    # Params not in the stacked layout (a decode-layout copy).
    with pytest.raises(InputError, match="stacked layout"):
        widen(llama.with_params(unstack_layers(llama.params)), mlp_multiple=2)
