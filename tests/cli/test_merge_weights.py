"""`impel merge-weights` turns an FSDP sharded checkpoint (2 ranks) into the model's full weights."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from cli_helpers import SCRIPTS, impel

pytestmark = pytest.mark.slow


def test_merge_weights_of_an_fsdp_checkpoint(tmp_path):
    res = impel(["launch", "--cpu", "--num_processes", "2", "--use_fsdp", "--fsdp_state_dict_type",
                 "SHARDED_STATE_DICT", str(SCRIPTS / "save_fsdp.py"), "ckpt", "full.pt"], tmp_path)
    assert res.returncode == 0, res.output[-4000:]
    merged = impel(["merge-weights", "ckpt", "export"], tmp_path)
    assert merged.returncode == 0, merged.output
    assert "wrote 1 file(s)" in merged.stdout
    got = load_file(tmp_path / "export" / "model.safetensors")
    want = torch.load(tmp_path / "full.pt", weights_only=True)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_merge_weights_bad_input(tmp_path):
    res = impel(["merge-weights", "nowhere", "out"], tmp_path)
    assert res.returncode == 2 and "checkpoint 'nowhere' is not a directory" in res.stderr
    (tmp_path / "empty").mkdir()
    res = impel(["merge-weights", "empty", "out"], tmp_path)
    assert res.returncode == 2 and "not a complete impel checkpoint" in res.stderr and "Traceback" not in res.stderr
