"""The README's commands are a contract: CI runs the README's test command verbatim."""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, re.S)]


def test_ci_runs_the_readme_test_command():
    readme = open(os.path.join(REPO, "README.md")).read()
    test_command = _bash_blocks(readme)[1]
    assert "pytest" in test_command
    assert test_command in open(os.path.join(REPO, ".ci", "run")).read().splitlines()


def test_readme_main_command_runs_generate_on_the_embedded_pair():
    readme = open(os.path.join(REPO, "README.md")).read()
    main_command = _bash_blocks(readme)[0]
    assert "ssd-jax generate" in main_command and "--target" not in main_command
