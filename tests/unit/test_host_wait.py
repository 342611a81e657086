"""impel launch on a machine other than machine 0 waits for machine 0's rendezvous address, saying so
(impel.commands.host_wait)."""
from __future__ import annotations

import socket
import threading
import time

from impel.commands.host_wait import DEFAULT_JOIN_TIMEOUT, join_timeout, wait_for_machine_0
from impel.testing import free_port


def test_join_timeout_is_read_from_rdzv_conf():
    assert join_timeout([]) == DEFAULT_JOIN_TIMEOUT == 600
    assert join_timeout(["--rdzv_conf", "last_call_timeout=5, join_timeout=42"]) == 42
    assert join_timeout(["--tee", "3", "--rdzv_conf", "keep_alive_interval=1"]) == DEFAULT_JOIN_TIMEOUT


def test_a_machine_0_that_starts_late_is_joined_and_said_so():
    port, lines = free_port(), []
    server = socket.socket()

    def listen_late() -> None:
        time.sleep(1.5)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()

    thread = threading.Thread(target=listen_late)
    thread.start()
    try:
        assert wait_for_machine_0("127.0.0.1", port, 30, lines.append)
    finally:
        thread.join()
        server.close()
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"impel launch: machine 0 (the rendezvous host, 127.0.0.1:{port}) does not answer "
                               "(Connection refused) after 0 s; waiting up to 30 s")
    assert lines[1].startswith(f"impel launch: machine 0 answered at 127.0.0.1:{port} after ")


def test_an_answering_machine_0_is_joined_silently_and_a_missing_one_ends_in_one_line():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        lines: list[str] = []
        assert wait_for_machine_0("127.0.0.1", server.getsockname()[1], 5, lines.append) and lines == []
    port, lines = free_port(), []
    assert not wait_for_machine_0("127.0.0.1", port, 1.2, lines.append)
    assert lines[-1].startswith(f"impel launch: machine 0 never answered at 127.0.0.1:{port} in 1 s (Connection "
                                "refused); it hosts the rendezvous: start machine 0 (--machine_rank 0)")
