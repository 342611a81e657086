"""``impel to-fsdp2`` writes what ``accelerate to-fsdp2`` (the installed Accelerate) writes, and impel launches it."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from impel.commands.main import main
from impel.config.run_config import ConfigError

FIXTURES = Path(__file__).resolve().parents[1] / "cli" / "fixtures"
FSDP1 = FIXTURES / "fsdp1" / "accelerate_fsdp1.yaml"
# every Accelerate-written file: FSDP1 (with fsdp_version 1 or, as older Accelerate writes it, none), FSDP2 (left as
# it is), a file without an FSDP section, and an old one with FSDP1's strategy number (impel writes the bool for it)
FILES = [FSDP1, *sorted(FIXTURES.glob("*.yaml"))]
# where impel deliberately differs: Accelerate copies the number 2 into fsdp_reshard_after_forward, which no FSDP2
# reads; impel writes the strategy's bool (2 = SHARD_GRAD_OP: false)
DELIBERATE = {"accelerate_fsdp_legacy.yaml": {"fsdp_reshard_after_forward": (2, False)}}


def _accelerate(path: Path, out: Path) -> str:
    from accelerate.commands.to_fsdp2 import convert_config_to_fsdp2

    out.write_text(yaml.dump(convert_config_to_fsdp2(yaml.safe_load(path.read_text()))))
    return out.read_text()


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_output_matches_accelerate_to_fsdp2_and_launches(path, tmp_path, capsys):
    theirs = _accelerate(path, tmp_path / "accelerate.yaml")
    assert main(["to-fsdp2", "--config_file", str(path), "--output_file", str(tmp_path / "impel.yaml")]) == 0
    ours = (tmp_path / "impel.yaml").read_text()
    for key, (accelerate_value, impel_value) in DELIBERATE.get(path.name, {}).items():
        theirs = theirs.replace(f"{key}: {accelerate_value}\n", f"{key}: {str(impel_value).lower()}\n")
    assert ours == theirs
    err = capsys.readouterr().err
    if path == FSDP1:
        assert "fsdp_sharding_strategy=SHARD_GRAD_OP -> fsdp_reshard_after_forward=false" in err
        assert "fsdp_backward_prefetch='BACKWARD_PRE' dropped" in err
    _launches(tmp_path / "impel.yaml", tmp_path)


def _launches(path: Path, tmp_path: Path) -> None:
    from impel.commands.flags import bool_values_joined
    from impel.commands.launch import plan_launch
    from impel.commands.main import build_parser

    (tmp_path / "train.py").write_text("")
    argv = ["launch", "--config_file", str(path), str(tmp_path / "train.py")]
    plan_launch(build_parser().parse_args(bool_values_joined(argv)))


def test_the_fsdp1_refusal_names_the_command_that_converts(tmp_path):
    from impel.config.yaml_file import read_config_file

    with pytest.raises(ConfigError, match=r"impel to-fsdp2 --config_file FILE --output_file NEW.yaml"):
        read_config_file(str(FSDP1))


def test_bad_invocations_name_the_fix(tmp_path, capsys):
    def error(*argv):
        assert main(["to-fsdp2", *argv]) == 2
        return capsys.readouterr().err

    assert "does not exist" in error("--config_file", str(tmp_path / "none.yaml"), "--output_file", "x.yaml")
    assert "needs --output_file OUT (or --overwrite" in error("--config_file", str(FSDP1))
    (tmp_path / "taken.yaml").write_text("kept\n")
    assert "pass --overwrite" in error("--config_file", str(FSDP1), "--output_file", str(tmp_path / "taken.yaml"))
    assert (tmp_path / "taken.yaml").read_text() == "kept\n"
    (tmp_path / "in.yaml").write_text(FSDP1.read_text())
    assert main(["to-fsdp2", "--config_file", str(tmp_path / "in.yaml"), "--overwrite"]) == 0
    assert yaml.safe_load((tmp_path / "in.yaml").read_text())["fsdp_config"]["fsdp_version"] == 2
