"""The parent/child handshake (csrc/child.c, linux/native.py): the parent releases its
child stage by stage (enum sk_stage), and each side checks the order."""

from __future__ import annotations

import os
import select
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade import plan as P
from stockade.launch import launcher
from stockade.launch import start as launch
from stockade.linux import native

from ..conftest import need


def build(tmp_path: Path, argv: tuple[str, ...]) -> P.Plan:
    proj = tmp_path / "proj"
    for d in (proj, tmp_path / "s" / "upper", tmp_path / "s" / "work"):
        d.mkdir(parents=True, exist_ok=True)
    return P.build(P.Request(argv=argv, project=proj, cwd=proj, env={"PATH": "/usr/bin:/bin"},
                             upper=tmp_path / "s" / "upper", work=tmp_path / "s" / "work"))


def reports(child: native.Child, timeout: float) -> list[native.Report]:
    """The records the child sent within ``timeout`` (all of them, once it is gone)."""
    out: list[native.Report] = []
    buf = b""
    p = select.poll()
    p.register(child.report_fd, select.POLLIN)
    while p.poll(int(timeout * 1000)):
        data = os.read(child.report_fd, 4096)
        if not data:
            break
        reps, buf = native.parse_reports(buf + data)
        out += reps
    return out


@pytest.fixture(params=["cold", "launcher"])
def how(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    need(os.geteuid() == 0, "in-process runs as root (the CLI tests cover uid 65534)")
    monkeypatch.setenv("STOCKADE_LAUNCHER", "0" if request.param == "cold" else "1")
    yield request.param
    launcher.shutdown()


def test_a_held_child_runs_nothing_until_released(tmp_path: Path, how: str) -> None:
    """With hold_before_exec, neither start waits for the caller's id maps (start passed
    that stage), and the command starts only at Stage.ATTACHED."""
    plan = build(tmp_path, ("true",))
    child = launch.start(plan, (-1, -1, -1), None, hold_before_exec=True)
    try:
        assert child.awaits == [native.Stage.ATTACHED]
        assert reports(child, 0.5) == []  # held: init has not forked the command
        assert not native.has_exited(child)
        with pytest.raises(ValueError, match="waits for ATTACHED, not IDMAP"):
            native.release(child, native.Stage.IDMAP)
        assert native.release(child, native.Stage.ATTACHED)
        kinds = [r.kind for r in reports(child, 10)]
        assert native.REP_STARTED in kinds and native.REP_EXIT in kinds, kinds
        assert child.reap() == 0
        with pytest.raises(ValueError, match="waits for no stage"):
            native.release(child, native.Stage.ATTACHED)
    finally:
        child.close()


def test_the_child_refuses_a_stage_out_of_order(tmp_path: Path, how: str) -> None:
    """A byte on the sync pipe naming another stage than the one the child waits for
    ends it before anything of the command's, with a stage-order record (EPROTO)."""
    marker = tmp_path / "proj" / "ran"
    plan = build(tmp_path, ("sh", "-c", f"echo x > {marker}"))
    child = launch.start(plan, (-1, -1, -1), None, hold_before_exec=True)
    try:
        os.write(child.sync_fd, bytes([native.Stage.IDMAP]))  # it waits for ATTACHED
        reps = reports(child, 10)
        assert [(r.kind, r.step, r.err, r.value) for r in reps] == [
            (native.REP_ERROR, "stage-order", 71, int(native.Stage.IDMAP))]  # EPROTO
        assert child.reap() == 125
        assert not marker.exists() and not (tmp_path / "s" / "upper" / "ran").exists()
    finally:
        child.close()
