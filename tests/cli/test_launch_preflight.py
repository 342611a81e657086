"""Rendezvous problems are one line before any rank starts (issue 27): a port in use, a port out of range in a
config file (launch and `impel config validate`), an unknown host."""
from __future__ import annotations

import socket

from cli_helpers import SCRIPTS, impel

REPORT = str(SCRIPTS / "report.py")


def _one_line(res, command: str) -> str:
    assert res.returncode == 2 and "Traceback" not in res.output, res.output
    assert res.stderr.startswith(f"impel {command}: error:") and res.stderr.count("\n") == 1, res.stderr
    return res.stderr


def test_a_port_in_use_is_named_before_any_rank_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        marker = tmp_path / "started"
        res = impel(["launch", "--cpu", "--num_processes", "2", "--main_process_port", str(port), REPORT,
                     "--touch", str(marker)], tmp_path, timeout=60)
    assert f"--main_process_port {port} is already in use on this machine" in _one_line(res, "launch")
    assert not marker.exists()


def test_a_free_port_passes_the_check(tmp_path):
    from impel.commands.preflight import check_port_free

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    check_port_free(port)  # nothing listens on it now


def test_config_validate_refuses_a_port_out_of_range(tmp_path):
    (tmp_path / "c.yaml").write_text("main_process_port: 99999\n")
    res = impel(["config", "validate", "c.yaml"], tmp_path, timeout=60)
    assert "main_process_port=99999 must be an integer from 1 to 65535" in _one_line(res, "config")


def test_an_unknown_host_fails_within_the_resolve_limit(tmp_path):
    from impel import ConfigError
    from impel.commands.preflight import resolve

    try:
        resolve("no-such-host.invalid")
    except ConfigError as exc:
        assert "--main_process_ip no-such-host.invalid" in str(exc) and "resolve" in str(exc)
    else:
        raise AssertionError("an unknown host was accepted")
    resolve("127.0.0.1")
    resolve("localhost")
