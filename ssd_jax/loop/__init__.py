"""The traced decode: the skeleton, emission, each method's parts, the adaptive loop and the
method -> parts dispatch. Pure functions of their arguments; nothing here reads process memory or
imports `ssd_jax.tuning`, `ssd_jax.runtime`, `ssd_jax.generate` or `ssd_jax.cli`."""
