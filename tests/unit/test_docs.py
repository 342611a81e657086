"""The documentation: README.md stays one screen, docs/cli.md is what the parsers say, and no relative link is broken.

`make docs` (part of `make test`) builds the site with `mkdocs build --strict`, which checks the pages' links and
anchors as mkdocs resolves them; these tests check what a reader of the repository on GitHub follows (README.md
included, which the site does not hold) and run without mkdocs installed.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = sorted(DOCS.glob("*.md"))
REGENERATE = ".venv/bin/python docs/gen_cli.py (or IMPEL_UPDATE_DOCS=1 pytest tests/unit/test_docs.py)"


def _gen_cli():
    spec = importlib.util.spec_from_file_location("gen_cli", DOCS / "gen_cli.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_generated_from_the_parsers():
    text = _gen_cli().render()
    assert "## `impel launch`" in text and "`--fsdp_sharding_strategy`" in text and "`--zero_stage`" in text
    cli = DOCS / "cli.md"
    if os.environ.get("IMPEL_UPDATE_DOCS") == "1":
        cli.write_text(text, encoding="utf-8")
    assert cli.exists() and cli.read_text(encoding="utf-8") == text, \
        f"docs/cli.md differs from the argparse parsers (a flag or help text changed): run {REGENERATE}"


def test_cli_reference_lists_every_flag_of_every_command():
    from impel.commands.main import build_parser

    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    parsers, seen = [build_parser()], 0
    while parsers:
        parser = parsers.pop()
        assert f"`{parser.prog}`" in text, f"{parser.prog} has no section in docs/cli.md: run {REGENERATE}"
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers += action.choices.values()
            elif action.help is not argparse.SUPPRESS and not isinstance(action, argparse._HelpAction):
                for flag in action.option_strings:
                    assert f"`{flag}`" in text, f"{parser.prog} {flag} is missing from docs/cli.md: run {REGENERATE}"
                    seen += 1
    assert seen > 100  # launch and test alone have ~60 flags each


def test_generating_the_cli_reference_does_not_import_torch():
    code = ("import runpy, sys; g = runpy.run_path('docs/gen_cli.py'); g['render'](); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]


def test_readme_stays_one_screen():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < 150, (f"README.md has {len(lines)} lines: it is the front page; move the detail to a page "
                              "under docs/ and link it")


def test_every_page_is_in_the_site_navigation():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))

    def targets(nav):
        for entry in nav:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            yield from targets(value) if isinstance(value, list) else [value]

    in_nav = set(targets(config["nav"]))
    assert in_nav == {p.name for p in PAGES}, ("mkdocs.yml's nav and docs/*.md differ: "
                                               f"{sorted(in_nav ^ {p.name for p in PAGES})}")


# --- links -----------------------------------------------------------------------------------------------------
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _links(text: str) -> list[str]:
    text = _CODE.sub("code", _FENCE.sub("", text))
    return _LINK.findall(text)


def _github_anchors(path: Path) -> set[str]:
    """The ids GitHub gives a Markdown file's headings (mkdocs' are checked by its strict build)."""
    anchors: set[str] = set()
    for line in _FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1)).replace("`", "").replace("*", "")
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        base, n = slug, 1
        while slug in anchors:
            slug, n = f"{base}-{n}", n + 1
        anchors.add(slug)
    return anchors


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_existing_files_and_headings(page):
    broken = []
    for target in _links(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
            continue
        if page.parent == DOCS and DOCS not in dest.parents:
            broken.append(f"{target}: outside docs/, which the site does not hold (name the file in `code`)")
        if anchor and dest.suffix == ".md" and anchor not in _github_anchors(dest):
            broken.append(f"{target}: no heading with the id #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"broken links in {page.relative_to(ROOT)}: {broken}"
