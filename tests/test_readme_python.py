"""The Python blocks of README.md and docs/*.md run, and the README's method table matches
`ssd_jax.methods.DEFAULTS`.

Every ```python block runs, in this process, unless the line right before its fence is a marker
`<!-- doc-test: ... -->` saying otherwise:
  devices=N    runs it in a subprocess with N fake CPU devices (a mesh example);
  slow         marks it slow (`pytest -q -m slow` runs it);
  skip REASON  does not run it (say why: it needs a TPU, a download).
A path a reader replaces with their own is replaced here by one that exists (PLACEHOLDERS).
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

from ssd_jax.defaults import default_model_dirs
from ssd_jax.methods import DEFAULTS
from subprocess_env import fake_devices_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
BLOCK = re.compile(r"(?:^<!--\s*doc-test:(?P<marker>[^>]*?)-->\n)?^```python\n(?P<code>.*?)^```", re.S | re.M)
# A reader's own checkpoint -> the embedded target's Hugging Face directory.
PLACEHOLDERS = {'"path/to/hf-model"': repr(default_model_dirs()[0])}


def parse_marker(marker: str) -> dict:
    """{"devices": int | None, "slow": bool, "skip": reason | None} of a block's marker."""
    options: dict = {"devices": None, "slow": False, "skip": None}
    words = marker.split()
    for index, word in enumerate(words):
        if word.startswith("devices="):
            options["devices"] = int(word.split("=", 1)[1])
        elif word == "slow":
            options["slow"] = True
        elif word == "skip":
            options["skip"] = " ".join(words[index + 1:]) or "no reason given"
            break
        else:
            raise ValueError(f"unknown doc-test marker {word!r} in {marker!r}")
    return options


def python_blocks() -> list:
    """pytest params (path, index, code, options) of every Python block in the README and docs."""
    params = []
    for path in DOCS:
        text = open(os.path.join(REPO, path)).read()
        for index, match in enumerate(BLOCK.finditer(text), 1):
            options = parse_marker(match["marker"] or "")
            marks = [pytest.mark.slow] if options["slow"] else []
            params.append(pytest.param(path, index, match["code"], options, id=f"{path}-{index}", marks=marks))
    return params


@pytest.mark.parametrize("path, index, code, options", python_blocks())
def test_python_blocks_run(path, index, code, options):
    if options["skip"]:
        pytest.skip(options["skip"])
    for placeholder, real in PLACEHOLDERS.items():
        code = code.replace(placeholder, real)
    if options["devices"]:
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=fake_devices_env(options["devices"]),
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{path} block {index} failed:\n{done.stderr[-4000:]}"
        return
    namespace: dict = {}
    exec(compile(code, f"{path} (Python block {index})", "exec"), namespace)
    if "ssd_jax.decode" in code and "new_tokens" in namespace:
        assert namespace["new_tokens"].shape == (2, 16)


def test_readme_shows_decode_inside_a_jit():
    readme = open(os.path.join(REPO, "README.md")).read()
    blocks = [m["code"] for m in BLOCK.finditer(readme)]
    assert any("ssd_jax.decode" in b and "@jax.jit" in b for b in blocks)


def test_readme_table_shows_the_defaults():
    readme = open(os.path.join(REPO, "README.md")).read()
    for name in ("sd", "gbv", "pld", "logitspec", "csd"):
        for field, value in DEFAULTS[name].items():
            shown = (f"{field}={value!r}", f"{field}={value}", f'{field}="{value}"')
            assert any(text in readme for text in shown), (name, field)


@pytest.mark.parametrize("marker, options", [
    ("", {"devices": None, "slow": False, "skip": None}),
    (" devices=8 slow ", {"devices": 8, "slow": True, "skip": None}),
    (" skip needs a TPU ", {"devices": None, "slow": False, "skip": "needs a TPU"}),
])
def test_markers(marker, options):
    assert parse_marker(marker) == options
    with pytest.raises(ValueError, match="unknown doc-test marker"):
        parse_marker("devices=2 fast")
