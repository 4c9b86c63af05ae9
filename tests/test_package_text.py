"""The package's comments and docstrings say what the code does and why; measurements, machines,
dates and session history belong in docs/ (docs/benchmarks.md names machine and date for every
number) or in git history. This scans the comments and string literals of every module of the
shipped packages and names each file:line that cites a machine, a date, a session, a results
file or the deleted adaptive notes."""

from __future__ import annotations

import glob
import io
import os
import re
import tokenize

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("ssd_jax", "checkpoints_convert")

# Ordinal or deictic "session": "the twelfth session", "5th session", "this session", "last
# session"; not the word alone, which code may use for other things (a download or HTTP session).
_SESSION = r"\b(?:\w+(?:st|nd|rd|th)|this|that|last|previous|earlier|prior|past|later|next) sessions?\b"
PATTERNS = {
    "a machine name": re.compile(r"(?<![a-z0-9])(?:h100|h200|a100|epyc|xeon)(?![a-z0-9])", re.I),
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "the deleted adaptive notes": re.compile(r"adaptive_notes"),
    "a results file": re.compile(r"benchmarks/results/"),
    "session history": re.compile(_SESSION + r"|\ba review (?:found|showed)\b|\bbefore this change\b", re.I),
}
_TEXT_TOKENS = {tokenize.COMMENT, tokenize.STRING} | (
    {tokenize.FSTRING_MIDDLE} if hasattr(tokenize, "FSTRING_MIDDLE") else set())


def _modules() -> list[str]:
    return sorted(path for package in PACKAGES
                  for path in glob.glob(os.path.join(REPO, package, "**", "*.py"), recursive=True))


def text_lines(source: str):
    """(line number, text) for every line of every comment and string literal in `source`."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in _TEXT_TOKENS:
            for offset, line in enumerate(token.string.splitlines()):
                yield token.start[0] + offset, line


def offences(source: str) -> list[tuple[int, str, str]]:
    """(line number, what it cites, the line) for each comment or string line that matches."""
    found = []
    for number, line in text_lines(source):
        for what, pattern in PATTERNS.items():
            if pattern.search(line):
                found.append((number, what, line.strip()))
    return found


def test_the_scan_catches_what_it_should_and_leaves_code_alone():
    bad = '''"""Ran 1.5x AR on an H200 (2026-11-30; benchmarks/results/x.json)."""
x = 1  # the twelfth session found this; see benchmarks/adaptive_notes.md
y = 2  # a 2-core Intel Xeon VM
z = 3  # as this session measured
'''
    assert [(n, w) for n, w, _ in offences(bad)] == [
        (1, "a machine name"), (1, "a date"), (1, "a results file"),
        (2, "the deleted adaptive notes"), (2, "session history"),
        (3, "a machine name"), (4, "session history")]
    good = '''"""A session of HTTP requests; sessions of the cascade; speculative sessions."""
h100 = session = 1  # code, not text
when = "%Y-%m-%d"
'''
    assert offences(good) == []


@pytest.mark.parametrize("path", _modules(), ids=lambda p: os.path.relpath(p, REPO))
def test_package_text_cites_no_machines_dates_sessions_or_results(path):
    with open(path, encoding="utf-8") as f:
        found = offences(f.read())
    relative = os.path.relpath(path, REPO)
    assert not found, "measurements, machines and history belong in docs/ or git history:\n" + "\n".join(
        f"{relative}:{number}: {what}: {line}" for number, what, line in found)
