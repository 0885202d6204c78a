"""The README's commands are exactly what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(python -m venv[^\n]+)\n```", text)


def test_ci_runs_the_readme_test_command():
    commands = _readme_commands()
    assert len(commands) == 2, commands
    train, test = commands
    assert "pip install torch==2.13.0" in train and train.endswith("parallel3d train")
    assert test.endswith("python -m pytest -q")
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test in ci_lines
