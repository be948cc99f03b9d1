"""Living sandboxes (issue 17): what a command costs in a sandbox that is already running.

One run, four tables; each table's candidates are interleaved round by round (one
sample of each per round), so background load hits them alike:

1. API, in this process (median and p90 of BENCH_N): ``sb.exec(["true"])`` into a
   living sandbox vs bare ``subprocess.run(["true"])``, bubblewrap per command
   (bench_runtime's peer command, reused), ``stockade.run(["true"])`` (one-shot, a new
   session each) and ``Sandbox().run`` (a session). Figure of merit: the time added
   over bare; budget for ``sb.exec``: <= 1.0 ms (reported, not asserted).
2. The CLI as typed in a shell (the console script): ``stockade exec NAME -- true``
   vs ``stockade run -- true``, both served by the CLI server (STOCKADE_SERVER=require
   after warm-up runs: served, or the benchmark stops), and the interpreter's floor.
3. ``start`` to the first exec's end, API (``Sandbox(persistent=True)`` + ``sb.exec``)
   and CLI (``stockade start`` + ``stockade exec``), and the CLI's start claiming a
   pre-warmed sandbox (``stockade warm`` before the sample, waited for in ``stockade ps
   --json``); the stop after it, untimed in the total, is its own row.
4. A pre-warmed sandbox claimed by ``stockade run -- true``: per sample, ``stockade
   warm`` runs and ``stockade ps --json`` is polled until it shows the sandbox warm,
   then the run is timed (and checked to have claimed it); a served run with nothing
   to claim (a new session each) is the same round's reference. The same for
   ``stockade.run`` and a sandbox warmed for its options (as ``[prewarm]`` warms one).

Everything it starts, it stops; the last line says whether any sandbox was left.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ._util import bench_dir, interleaved, median
from .bench_runtime import _bwrap_argv, _must

N = int(os.environ.get("BENCH_N", "200"))
N_CLI = max(20, N // 5)  # a CLI sample costs an interpreter's start
N_START = max(10, N // 10)  # a start costs a sandbox's start and stop
BUDGET_EXEC_MS = 1.0  # sb.exec, added over bare
LIVE_STATES = ("running", "warm", "starting", "stopping")


def p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10, method="inclusive")[-1] if len(xs) > 1 else xs[0]


def _row(name: str, xs: list[float], extra: str = "") -> str:
    return f"  {name:<50} {median(xs) * 1e3:8.2f} ms {p90(xs) * 1e3:8.2f} ms  {extra}"


def _head(title: str) -> None:
    print(title)
    print(f"  {'':<50} {'median':>11} {'p90':>11}")


def _cli_exe() -> list[str]:
    """The console script of this interpreter's environment (what `make` installs), as bench_runtime finds it."""
    exe = shutil.which("stockade", path=os.path.dirname(sys.executable)) or shutil.which("stockade")
    return [exe] if exe else [sys.executable, "-m", "stockade"]


def _cli(cli: list[str], *args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    """A CLI command that must succeed (untimed work around the samples); its stdout."""
    r = subprocess.run([*cli, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise SystemExit(f"bench: stockade {' '.join(args)} exited {r.returncode}: {r.stderr.strip()}")
    return r.stdout


def _timed(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> Callable[[], object]:
    """A timed CLI candidate (stdout and stderr discarded); a failure stops the benchmark."""

    def run() -> object:
        r = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if r.returncode != 0:
            err = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True).stderr.strip()
            raise SystemExit(f"bench: {' '.join(argv)} exited {r.returncode}: {err}")
        return r

    return run


def _ok(what: str, r: object) -> object:
    rc = getattr(r, "returncode", None)
    if rc != 0:
        raise SystemExit(f"bench: {what} exited {rc}")
    return r


def _living() -> list[object]:
    from stockade.live import registry

    return [lv for lv in registry.all_living() if lv.status in LIVE_STATES]


def _settle(timeout: float = 15.0) -> None:
    """Until no sandbox of this state dir is running or being torn down (a claimed run
    stops its sandbox without waiting for the holder's end)."""
    end = time.monotonic() + timeout
    while _living() and time.monotonic() < end:
        time.sleep(0.02)


def _stop_all() -> None:
    from stockade import live

    for lv in _living():
        try:
            live.stop(lv)  # type: ignore[arg-type]
        except Exception as e:  # cleanup goes on
            print(f"  (stopping {getattr(lv, 'id', '?')}: {e})")


def main() -> None:
    with bench_dir("stockade-bench-live-") as base:
        os.environ["STOCKADE_LAUNCHER_IDLE"] = "5"  # the CLI's shared launcher and server end soon after
        os.environ["STOCKADE_SERVER_IDLE"] = "5"
        proj = base / "proj"
        proj.mkdir()
        (proj / "f").write_text("x\n")
        try:
            _machine()
            _api(proj)
            cli = _cli_exe()
            _cli_table(cli, proj)
            _starts(cli, proj)
            _prewarmed(cli, proj)
        finally:
            _stop_all()
            _settle()
            left = _living()
            from stockade.cgroups.base import flush_deferred
            from stockade.launch import launcher

            flush_deferred()
            launcher.shutdown()
            print(f"cleanup: {len(left)} living sandbox(es) left running" + (f": {left}" if left else ""))


def _machine() -> None:
    import stockade.cgroups.detect as cgdetect

    bw = shutil.which("bwrap")
    bwv = subprocess.run([bw, "--version"], capture_output=True, text=True).stdout.strip() if bw else "not installed"
    print(f"machine: {os.cpu_count()} cores, kernel {os.uname().release}, cgroup backend {cgdetect.detect().kind}, "
          f"{bwv}; BENCH_N={N}")


# --------------------------------------------------------------------------- 1. API


def _api(proj: Path) -> None:
    import stockade

    fns: dict[str, Callable[[], object]] = {}
    fns["bare `true` (subprocess.run)"] = _must(["true"])
    bw = shutil.which("bwrap")
    if bw:
        argv = _bwrap_argv(str(proj))
        _must(argv)()
        fns["bubblewrap per command (bench_runtime's)"] = _must(argv)
    live = stockade.Sandbox(proj, persistent=True)
    sb = stockade.Sandbox(proj)
    try:
        fns["sb.exec(['true']) (living sandbox)"] = lambda: _ok("sb.exec", live.exec(["true"]))
        fns["stockade.run(['true']) (one-shot, new session)"] = lambda: _ok("stockade.run", stockade.run(["true"], project=proj))
        fns["Sandbox().run(['true']) (session)"] = lambda: _ok("Sandbox.run", sb.run(["true"]))
        res = interleaved(fns, N)
    finally:
        live.close()
        sb.close()
    bare_name = "bare `true` (subprocess.run)"
    bare, bare90 = median(res[bare_name]), p90(res[bare_name])
    ref = median(res["bubblewrap per command (bench_runtime's)"]) if bw else None
    _head(f"== 1. a command in a sandbox, API (median and p90 of {N}, interleaved; "
          "added over bare: median, p90; ratio vs bubblewrap)")
    for name, xs in res.items():
        added = "" if name == bare_name else \
            f"+{(median(xs) - bare) * 1e3:5.2f} ms, +{(p90(xs) - bare90) * 1e3:5.2f} ms"
        ratio = f"{median(xs) / ref:5.2f}x bwrap" if ref else ""
        print(_row(name, xs, f"{added:<24} {ratio}"))
    if not bw:
        print("  (bubblewrap not installed: `apt-get install bubblewrap` for the comparison)")
    exec_added = (median(res["sb.exec(['true']) (living sandbox)"]) - bare) * 1e3
    verdict = "holds" if exec_added <= BUDGET_EXEC_MS else "OVER BUDGET"
    print(f"  budget: sb.exec adds {exec_added:.2f} ms over bare (budget <= {BUDGET_EXEC_MS:.1f} ms): {verdict}")
    _exec_share(proj)


def _exec_share(proj: Path) -> None:
    """Where an exec's time goes: the holder's answer (its checks, the run's directory),
    then the command's life as the client supervises it (init's vfork and execve, the
    reports, the exec socket's end); the rest is the client's Python."""
    import functools

    import stockade
    from stockade.live import client

    spent: dict[str, float] = {}
    saved: list[tuple[object, str, object]] = []

    def wrap(obj: object, name: str, label: str) -> None:
        f = getattr(obj, name)
        saved.append((obj, name, f))

        @functools.wraps(f)
        def g(*a: object, **k: object) -> object:
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t

        setattr(obj, name, g)

    wrap(client, "_recv_ack", "holder's answer")
    wrap(client.ExecSupervisor, "loop", "command (init's fork, exec, reports)")
    rows: dict[str, list[float]] = {}
    live = stockade.Sandbox(proj, persistent=True)
    try:
        for _ in range(N):
            spent.clear()
            t = time.perf_counter()
            _ok("sb.exec", live.exec(["true"]))
            total = time.perf_counter() - t
            for part, v in {"total": total, **spent, "client's Python": total - sum(spent.values())}.items():
                rows.setdefault(part, []).append(v)
    finally:
        for obj, name, f in saved:
            setattr(obj, name, f)
        live.close()
    print(f"  where sb.exec's time goes (back to back, median of {N}): "
          + ", ".join(f"{part} {median(v) * 1e3:.2f} ms" for part, v in rows.items()))


# --------------------------------------------------------------------------- 2. CLI


def _cli_table(cli: list[str], proj: Path) -> None:
    served = {**os.environ, "STOCKADE_SERVER": "require"}
    for _ in range(3):  # the first makes the state dir's launcher, the next starts the server
        _cli(cli, "run", "--project", str(proj), "--session", "cli", "--", "true", cwd=proj)
    _cli(cli, "run", "--project", str(proj), "--session", "cli", "--", "true", cwd=proj, env=served)
    time.sleep(1)
    name = "bench-cli"
    _cli(cli, "start", "--project", str(proj), "--name", name, "--idle-timeout", "10m", cwd=proj)
    try:
        pyc = [sys.executable, "-c", "pass"]
        fns = {
            "`stockade exec NAME -- true` (served)": _timed([*cli, "exec", name, "--", "true"], proj, served),
            "`stockade run -- true` (served, one session)": _timed(
                [*cli, "run", "--project", str(proj), "--session", "cli", "--", "true"], proj, served),
            "python -c pass (with site, as the CLI starts)": _timed(pyc, proj),
        }
        res = interleaved(fns, N_CLI)
    finally:
        _cli(cli, "stop", name, cwd=proj)
    ref = median(res["`stockade run -- true` (served, one session)"])
    _head(f"== 2. the CLI as typed in a shell (median and p90 of {N_CLI}, interleaved; ratio vs served run; CLI: {' '.join(cli)})")
    for k, xs in res.items():
        print(_row(k, xs, f"{median(xs) / ref:5.2f}x served run"))


# --------------------------------------------------------------------------- 3. start to first exec


def _starts(cli: list[str], proj: Path) -> None:
    import stockade

    _settle()
    served = {**os.environ, "STOCKADE_SERVER": "require"}
    api_total, api_start, api_stop = "API: Sandbox(persistent=True) + first sb.exec", "  of which the start", \
        "  stop (sb.close())"
    cli_total, cli_start, cli_stop = "CLI: `stockade start` + first `stockade exec`", "  of which `stockade start`", \
        "  `stockade stop`"
    warm_total, warm_start = "  same, claiming a pre-warmed sandbox", "    of which `stockade start`"
    parts: dict[str, list[float]] = {k: [] for k in (api_total, api_start, api_stop, cli_total, cli_start,
                                                     warm_total, warm_start, cli_stop)}

    def api() -> None:
        t0 = time.perf_counter()
        sb = stockade.Sandbox(proj, persistent=True)
        t1 = time.perf_counter()
        try:
            _ok("sb.exec", sb.exec(["true"]))
            t2 = time.perf_counter()
        finally:
            sb.close()
        t3 = time.perf_counter()
        parts[api_total].append(t2 - t0)
        parts[api_start].append(t1 - t0)
        parts[api_stop].append(t3 - t2)

    def cmdline(warm: bool) -> None:
        want = None
        if warm:  # ready before the sample: `stockade warm`, until `stockade ps --json` shows it
            _cli(cli, "warm", "--project", str(proj), "--ttl", "60s", cwd=proj, env=served)
            want = _wait_warm(cli, proj)
            time.sleep(0.05)
        t0 = time.perf_counter()
        sid = _cli(cli, "start", "--project", str(proj), "--idle-timeout", "10m", cwd=proj, env=served).strip()
        t1 = time.perf_counter()
        try:
            if want is not None and sid != want:
                raise SystemExit(f"bench: `stockade start` did not claim pre-warmed sandbox {want} (started {sid})")
            _timed([*cli, "exec", sid, "--", "true"], proj, served)()
            t2 = time.perf_counter()
        finally:
            _cli(cli, "stop", sid, cwd=proj)
        t3 = time.perf_counter()
        parts[warm_total if warm else cli_total].append(t2 - t0)
        parts[warm_start if warm else cli_start].append(t1 - t0)
        if not warm:
            parts[cli_stop].append(t3 - t2)

    api()  # warm-up: the holder's interpreter and the module files in the page cache
    cmdline(False)
    cmdline(True)
    _settle()
    for v in parts.values():
        v.clear()
    for _ in range(N_START):
        api()
        _settle()
        cmdline(False)
        _settle()
        cmdline(True)
        _settle()
    _head(f"== 3. start to the end of the first exec of `true` (median and p90 of {N_START}, interleaved; "
          "stop after it)")
    for k, xs in parts.items():
        print(_row(k, xs))


# --------------------------------------------------------------------------- 4. pre-warmed


def _wait_warm(cli: list[str], proj: Path, timeout: float = 30.0) -> str:
    """Until `stockade ps --json` lists a warm sandbox for ``proj``; its id."""
    end = time.monotonic() + timeout
    while True:
        rows = json.loads(_cli(cli, "ps", "--json", cwd=proj))
        for d in rows:
            if d.get("status") == "warm" and d.get("project") == str(proj):
                return str(d["id"])
        if time.monotonic() > end:
            raise SystemExit(f"bench: no warm sandbox for {proj} after {timeout:g} s: {rows}")
        time.sleep(0.05)


def _prewarmed(cli: list[str], proj: Path) -> None:
    import stockade
    from stockade import live
    from stockade.core.request import RunRequest
    from stockade.live import registry

    _settle()
    served = {**os.environ, "STOCKADE_SERVER": "require"}
    run = [*cli, "run", "--project", str(proj), "--", "true"]
    plain = _timed(run, proj, served)
    claiming = _timed(run, proj, served)
    plain_name, claim_name = "`stockade run -- true` (served, nothing to claim)", "  same, claiming a pre-warmed sandbox"
    warm_name = "  (`stockade warm` until it serves: paid ahead)"
    api_name, api_claim = "stockade.run(['true']) (nothing to claim)", "  same, claiming one warmed for its options"
    res: dict[str, list[float]] = {plain_name: [], claim_name: [], warm_name: [], api_name: [], api_claim: []}

    def claimed(sid: str, what: str) -> None:
        lv = registry.read(sid)
        if lv is None or not lv.data.get("claimed"):
            raise SystemExit(f"bench: {what} did not claim pre-warmed sandbox {sid}: {lv and lv.data}")

    for i in range(N_START + 2):  # two warm-up rounds
        t0 = time.perf_counter()
        plain()
        t1 = time.perf_counter()
        _cli(cli, "warm", "--project", str(proj), "--ttl", "60s", cwd=proj, env=served)
        tw = time.perf_counter()
        sid = _wait_warm(cli, proj)
        time.sleep(0.05)
        t2 = time.perf_counter()
        claiming()
        t3 = time.perf_counter()
        claimed(sid, "`stockade run`")
        _settle()
        # the API: a sandbox warmed for stockade.run's own options, as [prewarm] warms one
        # after an API start (`stockade warm` readies one for the CLI's options)
        t4 = time.perf_counter()
        _ok("stockade.run", stockade.run(["true"], project=proj))
        t5 = time.perf_counter()
        req = RunRequest(("true",), project=proj)
        lv = live.start(live.StartSpec(req, detached=True, idle=60.0, warm=True, warm_key=live.warm_key(req)))
        time.sleep(0.05)
        t6 = time.perf_counter()
        _ok("stockade.run", stockade.run(["true"], project=proj))
        t7 = time.perf_counter()
        claimed(lv.id, "stockade.run")
        _settle()
        if i >= 2:
            res[plain_name].append(t1 - t0)
            res[claim_name].append(t3 - t2)
            res[warm_name].append(tw - t1)
            res[api_name].append(t5 - t4)
            res[api_claim].append(t7 - t6)
    _head(f"== 4. a one-shot run claiming a pre-warmed sandbox (`stockade warm`, then `stockade ps --json` shows it "
          f"warm) vs nothing to claim (median and p90 of {N_START}, interleaved)")
    against = {plain_name: plain_name, claim_name: plain_name, api_name: api_name, api_claim: api_name}
    for k, xs in res.items():
        ref = median(res[against[k]]) if k in against else None
        print(_row(k, xs, "" if ref is None else f"{(median(xs) - ref) * 1e3:+6.2f} ms vs nothing to claim"))
    print("  (each run a new session: a pre-warmed sandbox is claimed only by a run or start without --session)")


if __name__ == "__main__":
    main()
