"""Training text: the Python standard library of the running interpreter (present on every
machine with Python, nothing to download), or any directory of text/code files.

Files are split deterministically into train and held-out by a hash of their relative path,
so the split is the same on every machine and does not depend on directory listing order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig

from ssd_jax.errors import InputError

TEXT_EXTENSIONS = (".py", ".txt", ".md", ".rst", ".c", ".h", ".js", ".ts", ".json", ".toml", ".cfg", ".ini",
                   ".sh", ".html", ".css", ".go", ".rs", ".java", ".cpp", ".hpp", ".yaml", ".yml")
_SKIPPED_DIRS = {"__pycache__", "site-packages", "dist-packages", "test", "tests", "idle_test", ".git"}


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Sorted absolute file paths of each split."""

    root: str
    train: tuple[str, ...]
    heldout: tuple[str, ...]


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def _is_heldout(relative_path: str, heldout_percent: int) -> bool:
    digest = hashlib.sha256(relative_path.replace(os.sep, "/").encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < heldout_percent


def collect_corpus(root: str | None = None, extensions=TEXT_EXTENSIONS, heldout_percent: int = 5) -> Corpus:
    """Lists the text files under root (default: the stdlib, tests and site-packages excluded).

    Raises InputError if root is missing, not a directory, or holds no matching non-empty file.
    """
    root = stdlib_dir() if root is None else os.fspath(root)
    if not os.path.exists(root):
        raise InputError(f"data directory {root!r} does not exist")
    if not os.path.isdir(root):
        raise InputError(f"data directory {root!r} is not a directory")
    if not 0 <= heldout_percent < 100:
        raise InputError(f"heldout_percent must be in [0, 100), got {heldout_percent}")
    train, heldout = [], []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIPPED_DIRS and not d.startswith("config-"))
        for name in sorted(files):
            if not name.endswith(tuple(extensions)) or name.startswith("test_"):
                continue
            path = os.path.join(directory, name)
            if os.path.getsize(path) == 0:
                continue
            relative = os.path.relpath(path, root)
            (heldout if _is_heldout(relative, heldout_percent) else train).append(path)
    if not train:
        raise InputError(
            f"data directory {root!r} holds no non-empty text files with extensions {', '.join(extensions)}"
        )
    return Corpus(root=root, train=tuple(train), heldout=tuple(heldout))


def read_text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()
