"""`stockade.run` without a session: the next new session's directories are made
while a run's sandbox starts; published whole, never shared with a fork, gone at exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def test_new_sessions_made_ahead_are_whole_and_leave_nothing(api_project: Path, state_dir: Path) -> None:
    code = textwrap.dedent(
        """
        import json, os, sys
        import stockade
        from stockade.session import store
        proj = sys.argv[1]
        sessions = store.sessions_dir()
        r1 = stockade.run(["sh", "-c", "echo one > a.txt"], project=proj)
        ahead = [n for n in os.listdir(sessions) if n.startswith(".new-")]
        assert len(ahead) == 1, ahead  # made while the run's sandbox started
        r2 = stockade.run(["sh", "-c", "cat a.txt 2>/dev/null; echo two > b.txt"], project=proj, capture_output=True)
        assert r2.returncode == 0 and r2.stdout == b"", r2  # a new session: not the first one's layer
        s2 = store.open_session(r2.session)
        meta = json.loads((s2.dir / "meta.json").read_text())
        assert meta["id"] == r2.session and meta["project"] == proj, meta
        assert (s2.upper / "b.txt").read_text() == "two\\n" and not (s2.upper / "a.txt").exists()
        assert r1.session != r2.session
        pid = os.fork()
        if pid == 0:  # a fork child makes its own, never the parent's
            r = stockade.run(["true"], project=proj)
            os._exit(0 if r.returncode == 0 else 1)
        assert os.waitpid(pid, 0)[1] == 0
        print(json.dumps(sorted(n for n in os.listdir(sessions) if n.startswith(".new-"))))
        """
    )
    r = subprocess.run([sys.executable, "-c", code, str(api_project)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() != "[]"  # one still made ahead while the process lives
    left = [p.name for p in (state_dir / "sessions").iterdir() if p.name.startswith(".new-")]
    # removed at exit; the fork child's (it left by os._exit, without exit handlers)
    # goes with the next process that makes one ahead
    assert len(left) == 1, left
    code2 = "import sys, stockade; stockade.run(['true'], project=sys.argv[1])"
    assert subprocess.run([sys.executable, "-c", code2, str(api_project)], timeout=120).returncode == 0
    assert [p.name for p in (state_dir / "sessions").iterdir() if p.name.startswith(".new-")] == []
