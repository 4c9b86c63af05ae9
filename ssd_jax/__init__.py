"""ssd_jax: speculative decoding for JAX.

Public API: `load`, `forward`, `decode`, `generate`, the method objects (`AR`, `SD`, ...),
`MaxGram`, `default_models`, `EagleHead` and `default_eagle_head` (`ssd_jax.eagle`), `shard`, `Model`, `ModelConfig`, `SamplingParams`, `GenerateOutput`,
`Plan`, `Tuner` and `default_tuner`, and the exceptions in `ssd_jax.errors`. Verifiers live in
`ssd_jax.verify`.
"""

from ssd_jax.defaults import default_eagle_head, default_models
from ssd_jax.eagle import EagleHead
from ssd_jax.runtime.compile_cache import use_persistent_cache
from ssd_jax.runtime.output import GenerateOutput
from ssd_jax.errors import CheckpointError, ConfigError, InputError, SsdJaxError
from ssd_jax.decode import DecodeOutput, decode
from ssd_jax.draft.maxgram import MaxGram
from ssd_jax.generate import METHODS, generate
from ssd_jax.loading import load
from ssd_jax.methods import AR, BV, CSD, EAGLE, GBV, PLD, SD, SSD, LogitSpec, Method, SpecInfer, SpecTr
from ssd_jax.model import Model
from ssd_jax.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from ssd_jax.plan import Plan
from ssd_jax.reference import forward
from ssd_jax.sampling import SamplingParams
from ssd_jax.sharding import shard
from ssd_jax.tuning.tuner import Tuner, default_tuner

__version__ = "0.1.0"

__all__ = [
    "AR", "BV", "EAGLE", "EagleHead", "default_eagle_head", "DecodeOutput", "MaxGram", "decode", "CSD", "GBV", "PLD", "SD", "SSD", "LogitSpec", "Method", "SpecInfer", "SpecTr",
    "CheckpointError", "ConfigError", "GenerateOutput", "InputError", "METHODS", "Model", "ModelConfig", "Plan",
    "SUPPORTED_MODEL_TYPES", "SamplingParams", "SsdJaxError", "default_models", "forward", "generate", "load",
    "Tuner", "default_tuner", "shard", "use_persistent_cache",
]
