"""README.md and docs/*.md stay true to the repository without running anything heavy: their
bash blocks name commands, scripts and options that exist; their links, anchors, file paths and
`ssd_jax.` names resolve; the README and the design of "auto" stay short; no session log.
(Their Python blocks run in test_readme_python.py.)"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import re
import shlex

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
RESULTS = os.path.join(REPO, "benchmarks", "results")
# Commands a bash block may use beyond python and ssd-jax (checked no further).
OTHER_COMMANDS = {"pip", "cd", "export", "git", "bash"}
REPO_PATH = r"(?<![\w/.])((?:benchmarks|tests|ssd_jax|docs|notebooks|checkpoints_convert)/[\w./*-]+)"


def _text(path: str) -> str:
    return open(os.path.join(REPO, path)).read()


def _bash_commands(text: str) -> list[str]:
    """Every command of the bash blocks: lines joined at a trailing backslash, comments dropped,
    split at &&, ||, ; and |."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            command: list[str] = []
            for word in words + [";"]:
                if word in ("&&", "||", ";", "|"):
                    if command:
                        commands.append(shlex.join(command))
                    command = []
                else:
                    command.append(word)
    return commands


def _check_command(command: str) -> None:
    words = shlex.split(command)
    while words and re.match(r"^[A-Z_]+=", words[0]):   # VAR=value before the command
        words = words[1:]
    program = os.path.basename(words[0])
    if program == "ssd-jax":
        from ssd_jax.cli import build_parser

        try:
            build_parser().parse_args(words[1:])
        except SystemExit as err:
            raise AssertionError(f"`{command}`: ssd-jax does not take these arguments") from err
    elif re.fullmatch(r"python3?(\.\d+)?", program):
        if words[1] == "-m":
            assert _is_module(words[2]), f"`{command}`: no module {words[2]}"
            return
        script = os.path.join(REPO, words[1])
        assert os.path.isfile(script), f"`{command}`: no file {words[1]}"
        source = open(script).read()
        for word in words[2:]:
            if word == "--":   # what follows goes to another script (pooled_runs.py -> bench_adaptive.py)
                break
            if word.startswith("--"):
                flag = word.split("=", 1)[0]
                assert f'"{flag}"' in source, f"`{command}`: {words[1]} takes no {flag}"
    else:
        assert program in OTHER_COMMANDS, f"`{command}`: unknown command {program}"
        if program == "bash":
            assert os.path.isfile(os.path.join(REPO, words[1])), f"`{command}`: no file {words[1]}"


@pytest.mark.parametrize("path", DOCS)
def test_bash_blocks_name_real_commands_scripts_and_options(path):
    commands = _bash_commands(_text(path))
    for command in commands:
        _check_command(command)


def test_the_command_check_catches_what_is_gone():
    for command in ("python benchmarks/no_such_script.py", "python benchmarks/bench_ar.py --no-such-flag",
                    "ssd-jax generate x --no-such-flag", "ssd-jax no-such-command", "python -m no_such_module",
                    "rm -rf build"):
        with pytest.raises(AssertionError):
            _check_command(command)
    _check_command("SSD_JAX_COMPILE_CACHE= .venv/bin/ssd-jax generate x --json")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: str) -> set[str]:
    text = re.sub(r"^```.*?^```", "", _text(path), flags=re.S | re.M)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("path", DOCS)
def test_links_and_anchors_resolve(path):
    folder = os.path.dirname(os.path.join(REPO, path))
    for target in re.findall(r"\]\(([^)\s]+)\)", _text(path)):
        if re.match(r"^[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        linked = os.path.normpath(os.path.join(folder, file)) if file else os.path.join(REPO, path)
        assert os.path.exists(linked), f"{path}: link to {target}: no such file"
        if anchor:
            assert anchor in _anchors(os.path.relpath(linked, REPO)), f"{path}: link to {target}: no such heading"


def _code_spans(text: str) -> list[str]:
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", text)


@pytest.mark.parametrize("path", DOCS)
def test_named_files_exist(path):
    """A repository path in a code span (`benchmarks/...`, `tests/...`, `ssd_jax/...`, ...) exists
    (a glob matches at least one file), and so does a results file named alone (`x.json`)."""
    for span in _code_spans(_text(path)):
        for name in re.findall(REPO_PATH, span):
            name = name.rstrip(".")
            assert glob.glob(os.path.join(REPO, name)), f"{path}: `{span}` names {name}, which does not exist"
        if re.fullmatch(r"[\w*-]+\.(json|png)", span) and span not in ("config.json", "tokenizer.json"):
            assert glob.glob(os.path.join(RESULTS, span)), f"{path}: `{span}` is not in benchmarks/results"


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:   # a name inside a module that is not a package
        return False


@pytest.mark.parametrize("path", DOCS)
def test_named_python_objects_exist(path):
    """`ssd_jax.x.y` in a code span is a module or an attribute of one."""
    for span in _code_spans(_text(path)):
        match = re.match(r"ssd_jax(?:\.[A-Za-z_]\w*)+", span)
        if not match:
            continue
        parts = match.group(0).split(".")
        for cut in range(len(parts), 0, -1):
            module_name = ".".join(parts[:cut])
            if _is_module(module_name):
                break
        value = importlib.import_module(module_name)
        for attribute in parts[cut:]:
            assert hasattr(value, attribute), f"{path}: `{span}`: {module_name} has no {'.'.join(parts[cut:])}"
            value = getattr(value, attribute)


def test_the_readme_and_the_design_of_auto_stay_short():
    assert len(_text("README.md").splitlines()) <= 400
    assert len(_text("docs/adaptive.md").splitlines()) <= 400


@pytest.mark.parametrize("path", DOCS)
def test_no_session_log(path):
    text = _text(path)
    assert not re.search(r"\b\w+(st|nd|rd|th) session\b", text, re.I), f"{path} cites a session"
    assert "adaptive_notes" not in text


def test_the_results_folder_holds_only_what_the_docs_show():
    """Every file in benchmarks/results is named by the README or a doc (or is the JSON or PNG of
    one that is), and there are at most 80."""
    shown = "\n".join(_text(p) for p in DOCS)
    files = sorted(os.listdir(RESULTS))
    assert len(files) <= 80
    for name in files:
        stem = name.rsplit(".", 1)[0]
        assert name in shown or stem + ".json" in shown or stem + ".png" in shown or stem + ".{json,png}" in shown, \
            f"benchmarks/results/{name} is shown nowhere (fold adaptive*.json into the summary, then delete it)"
