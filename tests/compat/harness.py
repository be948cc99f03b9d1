"""Runs a command bare and inside `stockade run` (default settings) as one user, and
CPython regression modules test by test on both sides.

Every run is bounded: a run that records nothing for IDLE seconds, or exceeds its
budget, is killed with its whole process tree (its process group, and every process
carrying this run's COMPAT_RUN_ID in its environment, inside the sandbox too), and
the test that had started is recorded as hung; the module then goes on from the
next test (the finished and hung ones ignored), so one hang names its test and
never stops the suite.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import User

SYSTEM_PY = "/usr/bin/python3"  # the interpreter Debian's libpython3.X-testsuite belongs to
RUNNER = Path(__file__).with_name("regrtest_runner.py")
SESSION = "compat"
IDLE = 30.0  # no test of the default set takes more than 3 s bare
GOOD = {"ok", "xfail"}
BAD = {"fail", "error", "xpass", "hang", "crash"}
INSTALL_HINT = ("sudo apt-get install -y libpython3.{v}-testsuite  "
                "(CPython's `test` package; `make test` as root installs it)")


def testsuite_missing() -> str | None:
    """Why the CPython `test` package cannot run, or None when it can."""
    r = subprocess.run([SYSTEM_PY, "-c", "import sys, test.test_os, test.libregrtest; print(sys.version_info[1])"],
                       capture_output=True, text=True)
    if r.returncode == 0:
        return None
    v = subprocess.run([SYSTEM_PY, "-c", "import sys; print(sys.version_info[1])"],
                       capture_output=True, text=True).stdout.strip()
    return f"{SYSTEM_PY} has no `test` package: {INSTALL_HINT.format(v=v)}"


def kill_run(p: subprocess.Popen[bytes], token: str) -> None:
    """SIGKILL a run's process group and every process that carries its token."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    mark = f"COMPAT_RUN_ID={token}".encode()
    for _ in range(3):  # a process may fork while we look
        found = False
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                env = (d / "environ").read_bytes()
            except OSError:
                continue
            if mark in env.split(b"\0"):
                found = True
                try:
                    os.kill(int(d.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if not found:
            break
        time.sleep(0.1)
    p.wait()


@dataclass
class Side:
    """One user, one project, bare or inside."""

    user: User
    project: Path
    inside: bool
    logs: Path

    @property
    def name(self) -> str:
        return "inside" if self.inside else "bare"

    def env(self, token: str) -> dict[str, str]:
        return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(self.user.home), "LANG": "C.UTF-8",
                "COMPAT_RUN_ID": token}

    def popen(self, cmd: list[str], token: str, log: Path) -> subprocess.Popen[bytes]:
        """Start cmd (run with the token in its environment) as the user, bare or inside."""
        # the token goes on the command itself (the CLI's own environment is the user's),
        # and the CLI's PYTHONPATH (stockade's sources) must not reach the system interpreter
        inner = ["/usr/bin/env", "-u", "PYTHONPATH", "-u", "PYTHONDONTWRITEBYTECODE", f"COMPAT_RUN_ID={token}", *cmd]
        with open(log, "ab") as out:
            if self.inside:
                argv = [*self.user.prefix(), self.user.python, "-m", "stockade", "run", "--project",
                        str(self.project), "--session", SESSION, "--", *inner]
                env = self.user.env()
            else:
                argv = [*self.user.prefix(), *inner]
                env = self.env(token)
            return subprocess.Popen(argv, cwd=self.project, env=env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def written(self, rel: str) -> Path:
        """Where a file the command wrote at project/rel is, seen from the host."""
        if self.inside:  # the session's upper layer: the run's writes never reach the project
            return self.user.state / "sessions" / SESSION / "upper" / rel
        return self.project / rel

    def run(self, cmd: list[str], timeout: float, log_name: str) -> tuple[int | None, bytes]:
        """Run cmd to its end (None: killed at the timeout); its output."""
        token = uuid.uuid4().hex
        log = self.logs / f"{log_name}-{self.user.name}-{self.name}.log"
        p = self.popen(cmd, token, log)
        try:
            rc: int | None = p.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        kill_run(p, token)  # also what it left behind
        return rc, log.read_bytes()


@dataclass
class ModuleRun:
    """Every test's outcome (last event wins) and why, over the attempts one module took."""

    outcomes: dict[str, str] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


def run_module(side: Side, module: str, ignore: list[str], *, budget: float, attempts: int = 6,
               only: list[str] | None = None, tag: str = "") -> ModuleRun:
    """Run one regrtest module on one side (only some of its tests: ``only``), going on
    past hangs and crashes."""
    res = ModuleRun()
    start = time.monotonic()
    tag = f"{module}-{side.name}{tag}"
    for n in range(attempts):
        rel = f"compat-out/{tag}-{n}.jsonl"
        ign = side.project / f"compat-in/{tag}-{n}.ignore"
        ign.parent.mkdir(exist_ok=True)
        # tests already decided are not run again
        ign.write_text("".join(f"{i}\n" for i in [*ignore, *res.outcomes]))
        side.user.own(ign.parent)
        (side.project / "compat-out").mkdir(exist_ok=True)
        side.user.own(side.project / "compat-out")
        cmd = [SYSTEM_PY, str(side.project / RUNNER.name), str(side.project / rel),
               "--tempdir", str(side.project / "compat-tmp"), "--ignorefile", str(ign), module]
        if only is not None:
            match = ign.with_suffix(".match")
            match.write_text("".join(f"{i}\n" for i in only))
            side.user.own(match)
            cmd[-1:-1] = ["--matchfile", str(match)]
        token = uuid.uuid4().hex
        log = side.logs / f"{tag}-{side.user.name}-{n}.log"
        p = side.popen(cmd, token, log)
        out = side.written(rel)
        last_size, last_change, killed = -1, time.monotonic(), ""
        while p.poll() is None:
            size = out.stat().st_size if out.exists() else 0
            now = time.monotonic()
            if size != last_size:
                last_size, last_change = size, now
            elif now - last_change > IDLE:
                killed = f"nothing recorded for {IDLE:.0f}s"
            if now - start > budget:
                killed = f"module budget of {budget:.0f}s exceeded"
            if killed:
                break
            time.sleep(0.2)
        kill_run(p, token)
        started, exited = None, None
        if out.exists():
            for line in out.read_text(errors="replace").splitlines():
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue  # a line cut by the kill
                if ev["e"] == "start":
                    started = ev["id"]
                elif ev["e"] == "exit":
                    exited = ev["code"]
                else:
                    res.outcomes[ev["id"]] = ev["e"]
                    if ev.get("why"):
                        res.why[ev["id"]] = ev["why"]
                    if ev["id"] == started:
                        started = None
        tail = log.read_bytes()[-1500:].decode(errors="replace") if log.exists() else ""
        if exited is not None:
            if not res.outcomes and exited != 0:
                res.notes.append(f"{side.name}: regrtest exited {exited} having run no test:\n{tail}")
            break
        if started is None:
            res.notes.append(f"{side.name}: run {n} ended ({killed or f'status {p.returncode}'}) "
                             f"outside any test:\n{tail}")
            break
        res.outcomes[started] = "hang" if killed else "crash"
        res.why[started] = killed or f"the run died (status {p.returncode}) in this test:\n{tail}"
        res.notes.append(f"{side.name}: {started}: {res.outcomes[started]} ({killed or p.returncode})")
        if time.monotonic() - start > budget:
            res.notes.append(f"{side.name}: stopped after the module budget; later tests not run")
            break
    res.seconds = time.monotonic() - start
    return res


@dataclass(frozen=True)
class Diff:
    test_id: str
    bare: str
    inside: str
    why: str


def compare(bare: ModuleRun, inside: ModuleRun) -> list[Diff]:
    """Tests that pass bare and do not inside: failed, errored, hung, not run or skipped.
    A test that fails bare says nothing about the sandbox and is left out."""
    diffs = []
    for tid, b in sorted(bare.outcomes.items()):
        i = inside.outcomes.get(tid, "not run")
        if b in GOOD and i not in GOOD:
            diffs.append(Diff(tid, b, i, inside.why.get(tid, "")))
    # a fixture error (setUpClass, setUpModule) exists only inside
    for tid, i in sorted(inside.outcomes.items()):
        if i in BAD and tid not in bare.outcomes:
            diffs.append(Diff(tid, "absent", i, inside.why.get(tid, "")))
    return diffs


def fresh_project(base: Path, user: User) -> Path:
    p = base / "p"
    p.mkdir()
    shutil.copy(RUNNER, p / RUNNER.name)
    user.own(base)
    return p
