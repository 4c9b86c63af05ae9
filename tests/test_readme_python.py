"""The README's Python blocks run, and its method table matches `ssd_jax.methods.DEFAULTS`."""

import os
import re

from ssd_jax.methods import DEFAULTS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_python_blocks_run():
    readme = open(os.path.join(REPO, "README.md")).read()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert any("ssd_jax.decode" in b for b in blocks)
    for block in blocks:
        if "ssd_jax.decode" in block:
            namespace: dict = {}
            exec(compile(block, "README.md", "exec"), namespace)
            assert namespace["new_tokens"].shape == (2, 16)


def test_readme_table_shows_the_defaults():
    readme = open(os.path.join(REPO, "README.md")).read()
    for name in ("sd", "gbv", "pld", "logitspec", "csd"):
        for field, value in DEFAULTS[name].items():
            shown = (f"{field}={value!r}", f"{field}={value}", f'{field}="{value}"')
            assert any(text in readme for text in shown), (name, field)
