"""tests/gpu: CUDA only. Every test here is skipped on a machine without a CUDA device (CI has none); run them with
``.venv/bin/python -m pytest -q tests/gpu`` on a GPU machine (they need one GPU and finish in about a minute; the
context-parallel check needs two and is skipped, saying so, with fewer)."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (tests/gpu runs on GPU machines only)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
