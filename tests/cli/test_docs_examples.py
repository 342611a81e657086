"""The docs' command examples run as written, so they cannot drift from the commands (issue 27: a question added to
`impel config` broke the piped example of docs/launch.md unnoticed).

A fenced ```bash block of docs/*.md preceded by the line ``<!-- runs in tests/cli/test_docs_examples.py -->`` is run
here with bash (``set -euo pipefail``) in an empty directory, with that directory as ``$HOME`` (so
``~/.cache/impel/default_config.yaml`` is a fresh file) and impel's ``impel`` command on ``PATH``. Blocks that need
a GPU, a model or another machine stay unmarked.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import clean_env

DOCS = Path(__file__).resolve().parents[2] / "docs"
MARKER = "<!-- runs in tests/cli/test_docs_examples.py -->"
BLOCK = re.compile(re.escape(MARKER) + r"\n```bash\n(.*?)\n```", re.S)


def examples() -> dict[str, str]:
    found = {}
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        markers = re.findall(f"^{re.escape(MARKER)}$", text, re.M)  # on a line of its own (not quoted in prose)
        assert len(markers) == len(BLOCK.findall(text)), f"{page.name}: a marker not followed by ```bash"
        for match in BLOCK.finditer(text):
            found[f"{page.name}:{text[: match.start()].count(chr(10)) + 2}"] = match.group(1)
    return found


EXAMPLES = examples()


def test_the_marked_examples_are_found():
    assert {name.split(":")[0] for name in EXAMPLES} >= {"launch.md", "planning.md"}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_a_docs_example_runs_as_written(name, tmp_path):
    env = clean_env(tmp_path, PATH=f"{Path(sys.executable).parent}{os.pathsep}/usr/bin{os.pathsep}/bin")
    env.pop("XDG_CACHE_HOME")  # the default location the docs name: ~/.cache/impel
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", EXAMPLES[name]], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=180, check=False)
    assert res.returncode == 0, f"{name} failed (exit {res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert "Traceback" not in res.stdout + res.stderr
