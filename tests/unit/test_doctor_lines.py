"""`stockade doctor` text: a probe's reasons are printed whole, one a line (issue #12 item 10:
an unprivileged user saw the cgroups line cut at 300 characters, ending in "v1 )")."""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest

from stockade import doctor


def test_every_cgroup_reason_is_printed_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    from stockade.cgroups import detect

    reasons = [
        "v2: /sys/fs/cgroup/unified has none of memory, pids, cpu (has: hugetlb)",
        *(f"v1 {c}: /sys/fs/cgroup/{c}/user.slice/user-65534.slice/session-{c}.scope is not writable by uid 65534"
          for c in ("memory", "pids", "cpu", "cpuacct", "freezer")),
    ]
    manager = types.SimpleNamespace(kind="none", describe=lambda: {})
    monkeypatch.setattr(detect, "detection", lambda: types.SimpleNamespace(manager=manager, reasons=reasons))
    probe = doctor.probe_cgroups()
    assert probe.status == "degraded"
    text = doctor.Report([probe]).format()
    lines = text.splitlines()
    assert lines[0] == "DEGRADED  cgroups      no delegated cgroup: memory/pids/CPU limits fall back to rlimits"
    assert lines[1:1 + len(reasons)] == [f"{'':<22}- {r}" for r in reasons]
    assert lines[1 + len(reasons)].startswith(f"{'':<22}fix: ")


def test_id_range_names_an_unused_subordinate_entry(tmp_path: Path) -> None:
    import pwd

    name = pwd.getpwuid(os.getuid()).pw_name
    p = doctor.probe_id_range(tmp_path)
    assert p.status == "info" and p.detail.startswith("none — ") and "not used" not in p.detail
    assert p.data["subordinate_entries"] == []
    (tmp_path / "subuid").write_text(f"someone:100000:65536\n{name}:165536:65536\n")
    p = doctor.probe_id_range(tmp_path)
    assert p.data["subordinate_entries"] == ["subuid"] and "/etc/subuid entry is not used" in p.detail
