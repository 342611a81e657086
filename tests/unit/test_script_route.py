"""A stock TRL / transformers / Accelerate script under ``impel launch`` builds Accelerate's own Accelerator: the
launcher says so in one line, with the line that moves it onto impel (issue 38). A script that touches impel gets
no line. The stock TRL script is TRL's own quick-start shape (``from trl import SFTConfig, SFTTrainer``)."""
from __future__ import annotations

import sys

import pytest

from impel.commands.launch import plan_launch
from impel.commands.main import build_parser, parse
from impel.commands.script_route import accelerate_route_note

STOCK_TRL = """\
from datasets import Dataset
from trl import SFTConfig, SFTTrainer

trainer = SFTTrainer(model="gpt2", args=SFTConfig(output_dir="out"), train_dataset=Dataset.from_dict({"text": ["a"]}))
trainer.train()
"""
CASES = [  # (source, what the line names, the fix it gives)
    (STOCK_TRL, "imports trl (SFTTrainer)", "`on_impel(SFTTrainer)(...)`"),
    ("import transformers\ntrainer = transformers.Trainer(model=None)\n", "imports transformers (Trainer)",
     "`on_impel(Trainer)(...)`"),
    ("from transformers import AutoModel, Trainer, TrainingArguments\n", "imports transformers (Trainer)",
     "`on_impel(Trainer)(...)`"),
    ("from accelerate import Accelerator\nacc = Accelerator()\n", "imports accelerate (Accelerator)",
     "`from impel import Accelerator` in place of accelerate's"),
    ("import accelerate.utils\naccelerate.utils.set_seed(0)\n", "imports accelerate (utils)",
     "`from impel import Accelerator`"),
]
SILENT = [
    STOCK_TRL + "from impel.trainer import on_impel\n",       # the documented route
    "from impel import Accelerator\nfrom trl import SFTTrainer\n",
    "import torch\nfrom transformers import AutoModel\n",     # a raw torchrun loop: no Accelerator at all
    "this is not python (\n",                                # cannot parse: no guess
]


@pytest.mark.parametrize(("source", "names", "fix"), CASES)
def test_a_script_on_accelerates_stack_gets_one_line_naming_it_and_the_fix(tmp_path, source, names, fix):
    (tmp_path / "train.py").write_text(source)
    line = accelerate_route_note([str(tmp_path / "train.py"), "--lr", "1"])
    assert line is not None and "\n" not in line
    assert line.startswith(f"train.py {names} and never impel: it builds Accelerate's own Accelerator"), line
    assert fix in line and "docs/migration.md" in line


@pytest.mark.parametrize("source", SILENT)
def test_a_script_that_touches_impel_or_no_accelerator_gets_no_line(tmp_path, source):
    (tmp_path / "train.py").write_text(source)
    assert accelerate_route_note([str(tmp_path / "train.py")]) is None


def test_a_module_and_a_program_are_read_when_found(tmp_path, monkeypatch):
    pkg = tmp_path / "sftpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(STOCK_TRL)
    (pkg / "train.py").write_text(STOCK_TRL)
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in ("sftpkg", "sftpkg.train"):
        assert "on_impel(SFTTrainer)" in (accelerate_route_note(["-m", module]) or ""), module
    assert accelerate_route_note(["-m", "no_such_module_here"]) is None
    assert accelerate_route_note(["/bin/true"]) is None  # --no_python program: not python, no guess
    monkeypatch.delitem(sys.modules, "sftpkg", raising=False)


def test_impel_launch_prints_the_line_before_any_rank_starts(tmp_path):
    """The line reaches the launch plan's notes (printed as ``impel launch: ...`` before the ranks start)."""
    (tmp_path / "sft.py").write_text(STOCK_TRL)
    (tmp_path / "c.yaml").write_text("{}\n")
    plan = plan_launch(parse(build_parser(), ["launch", "--config_file", str(tmp_path / "c.yaml"), "--cpu",
                                              "--num_processes", "2", "--use_fsdp", str(tmp_path / "sft.py")]))
    lines = [n for n in plan.notes if "never impel" in n]
    assert len(lines) == 1 and lines[0].startswith("sft.py imports trl (SFTTrainer)"), plan.notes
