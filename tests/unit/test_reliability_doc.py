"""docs/reliability.md is the table of bad inputs the tests actually tried, with the errors they produced."""
from __future__ import annotations

import os
from pathlib import Path

from reliability_cases import collect, render

DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"


def test_reliability_table_is_current(tmp_path):
    rows = collect(tmp_path)
    assert len(rows) >= 30
    for area, what, error in rows:
        assert error and "Traceback" not in error, (area, what)
    text = render(rows, tmp_path)
    if os.environ.get("IMPEL_UPDATE_DOCS") == "1":
        DOC.write_text(text)
    assert DOC.read_text() == text, "docs/reliability.md is out of date: run IMPEL_UPDATE_DOCS=1 pytest " \
                                    "tests/unit/test_reliability_doc.py"
