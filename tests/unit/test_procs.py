"""pid_alive: a zombie (exited, not yet reaped) counts as gone."""

from __future__ import annotations

import os
import subprocess
import time

from stockade.linux.procs import pid_alive


def test_a_running_process_is_alive_and_a_zombie_is_not() -> None:
    p = subprocess.Popen(["sleep", "30"])
    try:
        assert pid_alive(p.pid)
        p.kill()
        deadline = time.monotonic() + 10
        while pid_alive(p.pid):  # not reaped: still in /proc, as a zombie
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert os.path.exists(f"/proc/{p.pid}")
    finally:
        p.kill()
        p.wait()
    assert not pid_alive(p.pid)


def test_pid_1_is_alive() -> None:
    assert pid_alive(1)
