"""`EagleHead`: a feature-level draft head (EAGLE-3 style) for one target.

The head reads the residual stream after K named layers of the target (`HeadConfig.feature_layers`),
normalises each, fuses them with one linear map [K*D, D], adds the embedding of the next token
(both at unit RMS) and runs one decoder layer of the target's family. Its output goes through the target's own
final norm and LM head (frozen, never copied into the head). While drafting it reads its own
output in place of the fused features it does not have yet (training-time test).

Params: {"fuse": {"kernel": [K*D, D]}, "layers": one layer, stacked as a `Model`'s are (leading
axis of 1; see `ssd_jax.models.params`)}. The layer's shapes are those of
`HeadConfig.layer_config(target.config)`: the target's layer with `intermediate_size` units.

Style "eagle3" is the layout of EAGLE-3's published heads (`checkpoints_convert.eagle3` converts
them): the fuse map reads the raw features; the layer is a Llama layer of the checkpoint's own
config whose attention reads cat(norm(embedding), norm(hidden)) [2D] while its residual stream
starts from the fused hidden alone; the head has its own final norm and LM head over a reduced
draft vocabulary. Its params add "embed_norm" {"scale": [D]}, "final_norm", "lm_head" {"kernel":
[D, Vd]} and "draft_to_target" int32 [Vd] (the target token id of each draft-vocabulary row);
q/k/v kernels take 2D inputs (embedding half first).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.errors import InputError, SsdJaxError
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import init_params, param_shapes

# The target params a head borrows (frozen) for its input embedding and its output.
SHARED_TARGET_PARAMS = ("embed", "pos_embed", "final_norm", "lm_head")
# The output params an "eagle3" head has of its own, in place of the target's.
OWN_OUTPUT_PARAMS = ("final_norm", "lm_head")
STYLES = ("fused", "eagle3")


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """What a head reads and how big its layer is, plus what it was built for.

    feature_layers: target layer indices whose outputs are fused (sorted, distinct);
    intermediate_size: the head layer's MLP units; target_*: the target's model_type,
    hidden_size, vocab_size and num_layers, which a head must match to be used with a target.
    style: "fused" (ours, `init_head`) or "eagle3" (a converted EAGLE-3 head, see the module
    docstring); for "eagle3", draft_vocab_size: the rows of its own LM head, and
    layer_hf_config: its layer's config.json text (a Llama config)."""

    feature_layers: tuple[int, ...]
    intermediate_size: int
    target_model_type: str
    target_hidden_size: int
    target_vocab_size: int
    target_num_layers: int
    style: str = "fused"
    draft_vocab_size: int = 0
    layer_hf_config: str = ""

    @classmethod
    def for_target(cls, target_config: ModelConfig, feature_layers: tuple[int, ...] | None = None,
                   intermediate_size: int | None = None) -> "HeadConfig":
        """A head config for target_config; feature_layers default to `default_feature_layers`,
        intermediate_size to the target's. InputError for indices out of range or repeated, or a
        non-positive size."""
        layers = default_feature_layers(target_config.num_layers) if feature_layers is None else feature_layers
        config = cls(feature_layers=tuple(int(i) for i in layers),
                     intermediate_size=int(target_config.intermediate_size if intermediate_size is None
                                           else intermediate_size),
                     target_model_type=target_config.model_type, target_hidden_size=target_config.hidden_size,
                     target_vocab_size=target_config.vocab_size, target_num_layers=target_config.num_layers)
        config.check_target(target_config)
        return config

    def check_target(self, target_config: ModelConfig) -> None:
        """InputError naming the first way this head does not fit target_config: another family,
        hidden size or vocabulary, feature layers out of the target's range, or repeated. A
        target with more layers than the head was trained on is accepted where every feature
        layer exists in it (`ssd_jax.testing.widen` appends zero layers, which leave the
        residual stream of the layers before them as it was)."""
        if self.intermediate_size < 1:
            raise InputError(f"head intermediate_size must be >= 1, got {self.intermediate_size}")
        if self.style not in STYLES:
            raise InputError(f"head style must be one of {STYLES}, got {self.style!r}")
        if self.style == "eagle3" and not 1 <= self.draft_vocab_size <= target_config.vocab_size:
            raise InputError(f"an eagle3 head's draft_vocab_size must be in 1..{target_config.vocab_size} (the "
                             f"target's vocabulary), got {self.draft_vocab_size}")
        if not self.feature_layers:
            raise InputError("a head needs at least one feature layer, got none")
        if len(set(self.feature_layers)) != len(self.feature_layers) or list(self.feature_layers) != sorted(
                self.feature_layers):
            raise InputError(f"feature_layers must be distinct and increasing, got {list(self.feature_layers)}")
        bad = [i for i in self.feature_layers if not 0 <= i < target_config.num_layers]
        if bad:
            raise InputError(f"feature layer(s) {bad} out of range for a target of {target_config.num_layers} "
                             f"layers (0..{target_config.num_layers - 1})")
        for field, mine, theirs in (("model_type", self.target_model_type, target_config.model_type),
                                    ("hidden_size", self.target_hidden_size, target_config.hidden_size),
                                    ("vocab_size", self.target_vocab_size, target_config.vocab_size)):
            if mine != theirs:
                raise InputError(f"this head was trained for a target with {field}={mine!r}; "
                                 f"the target has {field}={theirs!r}")
        width = self.layer_config(target_config).hidden_size
        if self.style == "eagle3" and width != target_config.hidden_size:
            raise InputError(f"this eagle3 head's layer has hidden_size {width}, the target "
                             f"{target_config.hidden_size}; heads of another width are not supported")

    def layer_config(self, target_config: ModelConfig) -> ModelConfig:
        """The one-layer `ModelConfig` the head runs under: the target's family, dims and norms,
        global attention, a dense MLP of intermediate_size units (a mixture-of-experts target
        gets a gated one). An "eagle3" head's: the Llama layer of its own config."""
        if self.style == "eagle3":
            return eagle3_layer_config(self.layer_hf_config, target_config.vocab_size)
        return dataclasses.replace(
            target_config, num_layers=1, intermediate_size=self.intermediate_size, layer_types=(),
            sliding_window=None, rope_local=None,
            mlp="gated" if target_config.mlp == "moe" else target_config.mlp, num_experts=0, experts_per_token=0,
            hf_json="")

    @property
    def num_features(self) -> int:
        return len(self.feature_layers)

    def to_json(self) -> str:
        return json.dumps(dict(dataclasses.asdict(self), feature_layers=list(self.feature_layers)), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "HeadConfig":
        data = json.loads(text)
        fields = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise InputError(f"head config lacks {missing}")
        return cls(**{k: (tuple(v) if k == "feature_layers" else v) for k, v in data.items() if k in fields})


@functools.lru_cache(maxsize=64)
def eagle3_layer_config(layer_hf_config: str, vocab_size: int) -> ModelConfig:
    """The one-layer Llama `ModelConfig` of an EAGLE-3 head's config.json text, over the target's
    vocabulary (its input embedding is the target's). InputError for a config it cannot read."""
    try:
        hf = json.loads(layer_hf_config)
        config = ModelConfig.from_hf(dict(hf, model_type="llama", num_hidden_layers=1, vocab_size=vocab_size,
                                          tie_word_embeddings=False))
    except (ValueError, SsdJaxError) as err:   # json's errors are ValueErrors
        raise InputError(f"an eagle3 head's layer config is unreadable: {err}") from None
    return dataclasses.replace(config, hf_json="", eos_token_ids=(), bos_token_id=None, pad_token_id=None)


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """A low, a middle and the last layer (EAGLE-3's choice), fewer for shallow targets."""
    return tuple(sorted({min(1, num_layers - 1), num_layers // 2, num_layers - 1}))


@dataclasses.dataclass(frozen=True)
class EagleHead:
    """A trained (or fresh) feature-level draft head: its config, params (the pytree's leaves) and
    the directory it was loaded from (or None)."""

    config: HeadConfig
    params: dict
    path: str | None = None

    @property
    def dtype(self):
        return self.params["fuse"]["kernel"].dtype

    def with_params(self, params: dict) -> "EagleHead":
        return dataclasses.replace(self, params=params)

    def check_target(self, target) -> None:
        """InputError where this head does not fit target (a `Model`), see `HeadConfig.check_target`."""
        self.config.check_target(target.config)

    @property
    def num_params(self) -> int:
        return int(sum(leaf.size for leaf in jax.tree.leaves(self.params)))


jax.tree_util.register_dataclass(EagleHead, data_fields=["params"], meta_fields=["config", "path"])


def cast_floats(params: dict, dtype) -> dict:
    """params with every floating-point leaf cast to dtype (integer leaves as they are)."""
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, params)


def check_draft_vocab(ids, vocab_size: int) -> None:
    """InputError where draft-to-target ids (int [Vd], concrete) are not distinct token ids of a
    vocab_size vocabulary."""
    ids = np.asarray(ids)
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise InputError(f"draft vocabulary maps to token id(s) {bad[:5].tolist()} outside the target's "
                         f"vocabulary of {vocab_size}")
    repeated = ids.size - np.unique(ids).size
    if repeated:
        raise InputError(f"draft vocabulary maps {repeated} row(s) to a target token another row has")


def head_param_shapes(config: HeadConfig, target_config: ModelConfig) -> dict:
    """The expected shape of every head leaf, as a pytree of tuples."""
    d = target_config.hidden_size
    layer_shapes = param_shapes(config.layer_config(target_config))
    shapes = {"fuse": {"kernel": (config.num_features * d, d)}, "layers": layer_shapes["layers"]}
    if config.style == "eagle3":
        for name in "qkv":
            n, _, out = shapes["layers"][name]["kernel"]
            shapes["layers"][name] = dict(shapes["layers"][name], kernel=(n, 2 * d, out))
        shapes.update(embed_norm={"scale": (d,)}, final_norm=layer_shapes["final_norm"],
                      lm_head={"kernel": (d, config.draft_vocab_size)}, draft_to_target=(config.draft_vocab_size,))
    return shapes


def init_head(target, feature_layers: tuple[int, ...] | None = None, intermediate_size: int | None = None,
              seed: int = 0, dtype=jnp.float32) -> EagleHead:
    """A fresh head for target (a `Model`): the layer initialised as `init_params` does, the fuse
    map as the mean of the normalised features (so an untrained head starts from a sensible
    input rather than noise)."""
    config = HeadConfig.for_target(target.config, feature_layers, intermediate_size)
    layer_config = config.layer_config(target.config)
    layers = init_params(layer_config, jax.random.PRNGKey(seed), dtype=dtype)["layers"]
    d, k = target.config.hidden_size, config.num_features
    fuse = jnp.tile(jnp.eye(d, dtype=jnp.float32), (k, 1)) / k
    return EagleHead(config=config, params={"fuse": {"kernel": fuse.astype(dtype)}, "layers": layers})


def check_head_params(head: EagleHead, target_config: ModelConfig) -> None:
    """InputError naming the first head leaf whose shape is not what config and target say."""
    expected = jax.tree_util.tree_leaves_with_path(head_param_shapes(head.config, target_config),
                                                   is_leaf=lambda x: isinstance(x, tuple))
    actual = {jax.tree_util.keystr(path): tuple(leaf.shape)
              for path, leaf in jax.tree_util.tree_leaves_with_path(head.params)}
    for path, shape in expected:
        name = jax.tree_util.keystr(path)
        if name not in actual:
            raise InputError(f"head params lack {name}")
        if actual[name] != tuple(shape):
            raise InputError(f"head param {name} has shape {actual[name]}, expected {tuple(shape)}")
    extra = sorted(set(actual) - {jax.tree_util.keystr(p) for p, _ in expected})
    if extra:
        raise InputError(f"head params have unexpected leaves {extra}")
    ids = head.params.get("draft_to_target")
    if ids is not None and not jnp.issubdtype(ids.dtype, jnp.integer):
        raise InputError(f"head param draft_to_target must hold integer token ids, got dtype {ids.dtype}")
