"""The repository tracks only its known top-level layout: no checkpoints, weights or logs of a manual run.

Reads ``git ls-files``; skipped outside a git checkout (an sdist, a copied tree). A tracked file that the working
tree has already deleted (a removal not yet committed) is not counted: the test judges what the checkout holds.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Every top-level entry the repository may track. A new one is a design decision: add it here (and say why in
# docs/design.md) rather than letting an artifact of a manual run slip into a commit.
ALLOWED_TOP_LEVEL = {
    ".ci", ".gitignore", "Makefile", "README.md", "pyproject.toml",
    "benchmarks", "docs", "examples", "impel", "tests",
    "findings",  # named by the design guide for the drop-in differences
    "mkdocs.yml",  # the documentation site's config (docs/ holds the pages): mkdocs reads it from the root
}


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    inside = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                            timeout=60, check=False)
    if inside.returncode != 0 or Path(inside.stdout.strip()).resolve() != ROOT:
        pytest.skip(f"{ROOT} is not the root of a git checkout")
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60, check=False)


def _tracked_in_checkout(*args: str) -> list[str]:
    out = _git("ls-files", "-z", *args)
    assert out.returncode == 0, out.stderr
    return [p for p in out.stdout.split("\0") if p and ((ROOT / p).exists() or (ROOT / p).is_symlink())]


def test_tracked_files_stay_inside_the_known_top_level_layout():
    tracked = _tracked_in_checkout()
    assert "impel/__init__.py" in tracked  # the listing really is this repository's
    stray = sorted(p for p in tracked if p.split("/", 1)[0] not in ALLOWED_TOP_LEVEL)
    assert not stray, (f"tracked files outside the known layout {sorted(ALLOWED_TOP_LEVEL)}: {stray[:20]}; remove "
                       "them (git rm --cached) and ignore them in .gitignore, or add the entry to ALLOWED_TOP_LEVEL")


def test_no_tracked_file_is_one_gitignore_excludes():
    ignored = sorted(_tracked_in_checkout("--cached", "--ignored", "--exclude-standard"))
    assert not ignored, (f"tracked files match .gitignore patterns: {ignored[:20]}; remove them from git "
                         "(git rm --cached) or narrow the pattern")


@pytest.mark.parametrize("artifact", ["ckpt/COMPLETE", "full.pt", "out_3.txt", "model.safetensors"])
def test_gitignore_keeps_manual_run_artifacts_out(artifact):
    out = _git("check-ignore", "--no-index", artifact)  # exit 0: ignored, 1: not ignored
    assert out.returncode == 0, f"{artifact} is not ignored by .gitignore ({out.stderr.strip()})"
