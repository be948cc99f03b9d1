"""`stockade review` over real HTTP (no browser), root and unprivileged: the server runs as
the user under test (`stockade review`, its URL read from its stdout), the sandbox runs are
real, and every claim about the project is read from the host's files.

Refusals (no token, a wrong one, another origin or host, no JSON) change nothing; a stale
page is a 409 with nothing written; hunks, edits and rejections land as exact bytes; the
engine's own conflicts are shown; rollback restores; a living sandbox's page follows it."""

from __future__ import annotations

import html
import json
import os
import re
import select
import shutil
import signal
import socket
import stat
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ..conftest import User, tree_snapshot, world_tmpdir

pytestmark = pytest.mark.slow


@dataclass
class Page:
    url: str
    proc: subprocess.Popen[bytes]

    @property
    def origin(self) -> str:
        u = urllib.parse.urlsplit(self.url)
        return f"{u.scheme}://{u.netloc}"

    @property
    def token(self) -> str:
        return urllib.parse.parse_qs(urllib.parse.urlsplit(self.url).query)["token"][0]

    def request(self, method: str, path: str, body: Any = None, *, token: str | None = "",
                headers: dict[str, str] | None = None) -> tuple[int, Any]:
        """``token``: "" the page's own, None none, else that one (in the query for a GET,
        in the header for a POST, as the page does)."""
        tok = self.token if token == "" else token
        h = dict(headers or {})
        url = self.origin + path
        data = None
        if method == "GET" and tok is not None:
            url += ("&" if "?" in path else "?") + "token=" + urllib.parse.quote(tok)
        if method == "POST":
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            h.setdefault("Content-Type", "application/json")
            h.setdefault("Origin", self.origin)
            if tok is not None:
                h["X-Stockade-Token"] = tok
        h = {k: v for k, v in h.items() if v is not None}
        req = urllib.request.Request(url, data=data, method=method, headers=h)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                raw = r.read()
                status = r.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw

    def get(self, path: str, **kw: Any) -> tuple[int, Any]:
        return self.request("GET", path, **kw)

    def post(self, path: str, body: Any, **kw: Any) -> tuple[int, Any]:
        return self.request("POST", path, body, **kw)

    def state(self) -> dict[str, Any]:
        status, body = self.get("/api/state")
        assert status == 200, body
        return body  # type: ignore[no-any-return]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stuck(pid: int) -> str:
    """What a process that does not end shows of itself in /proc: its signal masks and
    where each of its threads waits (for a failure's message)."""
    out = []
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        out += [ln for ln in status.splitlines() if ln.startswith(("State", "SigBlk", "SigIgn", "SigCgt", "SigPnd"))]
        for t in sorted(os.listdir(f"/proc/{pid}/task")):
            wchan = Path(f"/proc/{pid}/task/{t}/wchan").read_text()
            name = Path(f"/proc/{pid}/task/{t}/comm").read_text().strip()
            out.append(f"thread {t} {name}: {wchan or '-'}")
    except OSError as e:
        out.append(f"({e})")
    return "; ".join(out)


@contextmanager
def review(user: User, sid: str, *args: str, env: dict[str, str] | None = None,
           stop: signal.Signals = signal.SIGINT) -> Iterator[Page]:
    """`stockade review SID` as the user; its URL from its stdout; Ctrl-C (or ``stop``) ends
    it (exit 0).
    Started with SIGINT at its default: a test run started in the background of a
    non-interactive shell inherits SIGINT ignored (POSIX), and so would the command,
    whose Ctrl-C is Python's KeyboardInterrupt, installed only where SIGINT is not."""
    p = subprocess.Popen([*user.prefix(), user.python, "-m", "stockade", "review", sid, *args],
                         env=user.env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=_default_sigint)
    try:
        assert p.stdout is not None and p.stderr is not None
        ready, _, _ = select.select([p.stdout], [], [], 60)
        line = p.stdout.readline().decode() if ready else ""
        if not line.startswith("http://127.0.0.1:"):
            p.kill()
            pytest.fail(f"`stockade review` printed no URL: {line!r} {p.stderr.read().decode()}")
        page = Page(line.strip(), p)
        yield page
        p.send_signal(stop)
        try:
            code = p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`stockade review` did not end on {stop.name} within 30 s: {_stuck(p.pid)}")
        assert code == 0, p.stderr.read().decode()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def run(user: User, project: Path, sid: str, script: str) -> None:
    r = user.cli(["run", "--session", sid, "--", "sh", "-c", script], cwd=project)
    assert r.returncode == 0, r.stderr.decode()


def session_paths(user: User, project: Path, sid: str) -> dict[str, str]:
    r = user.cli(["status", sid, "--json"], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    return {c["path"]: c["kind"] for c in json.loads(r.stdout)["changes"]}


MULTI = "".join(f"line {i}\n" for i in range(1, 41))


def test_refused_requests_change_nothing(user: User, project: Path) -> None:
    run(user, project, "rv", "echo new > new.txt; echo more >> README.md")
    before = tree_snapshot(project)
    with review(user, "rv") as page:
        fp = page.state()["fingerprint"]
        good = {"fingerprint": fp, "files": {"new.txt": {"decision": "approve"},
                                             "README.md": {"decision": "reject"}}}
        # data needs the token: none, a wrong one, the page itself without it
        for path in ("/api/state", "/api/fingerprint", "/api/file?path=new.txt", "/"):
            assert page.get(path, token=None)[0] == 403, path
            assert page.get(path, token="x" + page.token[1:])[0] == 403, path
        assert page.get("/static/app.js", token=None)[0] == 200  # assets hold no data
        # another Host (a DNS-rebinding page) is refused even with the token
        assert page.get("/api/state", headers={"Host": f"evil.example:{page.origin.rsplit(':', 1)[1]}"})[0] == 403
        # a change needs the token, the page's own origin and a JSON body
        refusals = [
            page.post("/api/apply", good, token=None),
            page.post("/api/apply", good, token="wrong"),
            page.post("/api/apply", good, headers={"Origin": None}),  # type: ignore[dict-item]
            page.post("/api/apply", good, headers={"Origin": "http://evil.example"}),
            page.post("/api/apply", good, headers={"Origin": "http://127.0.0.1:1"}),
            page.post("/api/apply", good, headers={"Origin": "null"}),
            page.post("/api/apply", good, headers={"Origin": page.origin.replace("127.0.0.1", "localhost")}),
            page.post("/api/apply", good, headers={"Origin": page.origin + "/"}),
            page.post("/api/rollback", {"apply_id": "x"}, headers={"Origin": "http://evil.example"}),
        ]
        assert [s for s, _ in refusals] == [403] * len(refusals), refusals
        assert {b["kind"] for _, b in refusals} == {"token", "origin"}
        status, body = page.post("/api/apply", json.dumps(good).encode(), headers={"Content-Type": "text/plain"})
        assert status == 415, body
        # nothing moved: the project (read from the host) and the session
        assert tree_snapshot(project) == before
        assert page.get("/api/fingerprint")[1]["fingerprint"] == fp
    assert session_paths(user, project, "rv") == {"new.txt": "added", "README.md": "modified"}


def test_hunks_edits_rejections_apply_and_rollback(user: User, project: Path) -> None:
    (project / "multi.txt").write_text(MULTI)
    (project / "tool.sh").write_text("#!/bin/sh\necho old\n")
    (project / "tool.sh").chmod(0o755)
    user.own(project)
    before = tree_snapshot(project)
    run(user, project, "rv",
        "sed -i 's/^line 2$/LINE 2/; s/^line 20$/LINE 20/; s/^line 39$/LINE 39/' multi.txt; "
        "echo 'echo sandbox' >> tool.sh; echo new > new.txt; echo later > later.txt")
    with review(user, "rv") as page:
        st = page.state()
        assert {c["path"] for c in st["changes"]} == {"multi.txt", "tool.sh", "new.txt", "later.txt"}
        assert [r["exit"] for r in st["runs"]] == [0] and "multi.txt" in st["runs"][0]["command"]
        status, view = page.get("/api/file?path=multi.txt")
        assert status == 200 and view["hunk_choice"] and len(view["hunks"]) == 3, view
        assert [h["header"] for h in view["hunks"]] == ["@@ -1,5 +1,5 @@", "@@ -17,7 +17,7 @@",
                                                          "@@ -36,5 +36,5 @@"]
        status, body = page.post("/api/apply", {"fingerprint": st["fingerprint"], "files": {
            "multi.txt": {"decision": "approve", "hunks": [0, 3]}}})
        assert status == 400 and "no hunk 3 (it has 3" in body["error"], body
        status, tool = page.get("/api/file?path=tool.sh")
        assert tool["editable"] and tool["new_text"] == "#!/bin/sh\necho old\necho sandbox\n"
        status, res = page.post("/api/apply", {"fingerprint": st["fingerprint"], "files": {
            "multi.txt": {"decision": "approve", "hunks": [0, 2]},
            "tool.sh": {"decision": "approve", "content": "#!/bin/sh\necho reviewed\n"},
            "new.txt": {"decision": "reject"},
        }})
        assert status == 200, res
        assert sorted(res["applied"]) == ["multi.txt", "tool.sh"] and res["discarded"] == ["new.txt"]
        assert res["partial"] == {"multi.txt": [0, 2]} and res["edited"] == ["tool.sh"]
        # the project, from the host: exact bytes, the mode kept
        assert (project / "multi.txt").read_text() == MULTI.replace("line 2\n", "LINE 2\n").replace(
            "line 39\n", "LINE 39\n")
        assert (project / "tool.sh").read_bytes() == b"#!/bin/sh\necho reviewed\n"
        assert (project / "tool.sh").stat().st_mode & 0o777 == 0o755
        assert (project / "tool.sh").stat().st_uid == user.uid
        assert not (project / "new.txt").exists() and not (project / "later.txt").exists()
        # the applied and the rejected left the session; the undecided stays for later
        st2 = page.state()
        assert [c["path"] for c in st2["changes"]] == ["later.txt"]
        assert [a["id"] for a in st2["applies"]] == [res["apply_id"]]
        # rollback: the project as it was, the session's own versions back in it
        status, rb = page.post("/api/rollback", {"apply_id": res["apply_id"]})
        assert status == 200 and rb["rolled_back"] == res["apply_id"], rb
        assert tree_snapshot(project) == before
        status, view = page.get("/api/file?path=multi.txt")
        assert len(view["hunks"]) == 3  # the sandbox's whole version, hunk 2 included
        assert page.post("/api/rollback", {"apply_id": res["apply_id"]})[0] == 400  # already rolled back
        assert page.post("/api/rollback", {"apply_id": "no-such"})[0] == 400
    assert session_paths(user, project, "rv") == {"multi.txt": "modified", "tool.sh": "modified",
                                                  "later.txt": "added"}


def test_a_stale_page_writes_nothing(user: User, project: Path) -> None:
    run(user, project, "rv", "echo one > one.txt")
    with review(user, "rv") as page:
        st = page.state()
        run(user, project, "rv", "echo two > one.txt; echo x > two.txt")  # the change set moves on
        before = tree_snapshot(project)
        status, body = page.post("/api/apply", {"fingerprint": st["fingerprint"],
                                                "files": {"one.txt": {"decision": "approve"}}})
        assert status == 409 and body["kind"] == "stale", body
        status, body = page.post("/api/apply", {"fingerprint": st["fingerprint"],
                                                "files": {"one.txt": {"decision": "reject"}}})
        assert status == 409 and body["kind"] == "stale", body
        assert tree_snapshot(project) == before
        # a hunk the file no longer has, a path that is no change: refused, nothing written
        fp = page.state()["fingerprint"]
        assert page.post("/api/apply", {"fingerprint": fp, "files": {"one.txt": {"decision": "approve", "hunks": [0]}}})[0] == 400  # an added file: whole
        assert page.post("/api/apply", {"fingerprint": fp, "files": {"nope": {"decision": "approve"}}})[0] == 400
        assert page.post("/api/apply", {"fingerprint": fp, "files": {}})[0] == 400
        assert page.post("/api/apply", {"files": {"one.txt": {"decision": "approve"}}})[0] == 400
        assert tree_snapshot(project) == before
        # the page as it is now applies
        status, body = page.post("/api/apply", {"fingerprint": fp, "files": {"one.txt": {"decision": "approve"}}})
        assert status == 200, body
    assert (project / "one.txt").read_text() == "two\n"


def test_a_file_name_that_is_not_utf8_is_shown_and_applied(user: User, project: Path) -> None:
    """The sandbox chose the name (bytes 0xff 0xfe, no UTF-8): every answer failed with
    500 (a UTF-8 encoding of the walked name), and the page was unusable. It comes as a
    JSON escape, is asked for with ?pathj= (a URL cannot carry it), and applies as itself."""
    run(user, project, "rv", "printf 'odd\\n' > \"$(printf 'a\\377\\376.txt')\"")
    name = os.fsdecode(b"a\xff\xfe.txt")
    with review(user, "rv") as page:
        st = page.state()
        assert name in {c["path"] for c in st["changes"]}, st["changes"]
        status, view = page.get("/api/file?pathj=" + urllib.parse.quote(json.dumps(name)))
        assert status == 200, view
        status, res = page.post("/api/apply", {"fingerprint": st["fingerprint"],
                                               "files": {name: {"decision": "approve"}}})
        assert status == 200, res
    assert (project / os.fsdecode(b"a\xff\xfe.txt")).read_bytes() == b"odd\n"


def test_a_host_edit_is_the_engines_conflict(user: User, project: Path) -> None:
    run(user, project, "rv", "echo sandbox >> README.md")
    (project / "README.md").write_text("# edited on the host\n")  # after the session started
    with review(user, "rv") as page:
        st = page.state()
        body = {"fingerprint": st["fingerprint"], "files": {"README.md": {"decision": "approve"}}}
        status, res = page.post("/api/apply", body)
        assert status == 409 and res["kind"] == "conflict" and res["paths"] == ["README.md"], res
        assert (project / "README.md").read_text() == "# edited on the host\n"
        status, res = page.post("/api/apply", {**body, "force": True})
        assert status == 200, res
    assert (project / "README.md").read_text() == "# demo\nsandbox\n"


def test_bad_input(user: User, project: Path) -> None:
    r = user.cli(["review", "no-such-session"], cwd=project)
    assert r.returncode == 2 and r.stdout == b""
    assert r.stderr.decode().count("\n") == 1 and "no session named 'no-such-session'" in r.stderr.decode()
    run(user, project, "quiet", "true")
    r = user.cli(["review", "quiet"], cwd=project)
    assert r.returncode == 2 and r.stderr.decode().count("\n") == 1, r
    assert "nothing to review in session quiet" in r.stderr.decode()
    run(user, project, "rv", "echo x > x.txt")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = user.cli(["review", "rv", "--port", str(port)], cwd=project)
    assert r.returncode == 2 and r.stdout == b"", r
    assert r.stderr.decode() == f"stockade: port {port} on 127.0.0.1 is in use; pick another with --port, " \
                                "or leave --port out for a free one\n"
    r = user.cli(["review", "rv", "--port", "70000"], cwd=project)
    assert r.returncode == 2 and "--port 70000" in r.stderr.decode() and r.stderr.decode().count("\n") == 1


def test_a_living_sandboxs_page_follows_it(user: User, project: Path) -> None:
    r = user.cli(["start", "--name", "lv"], cwd=project, timeout=90)
    assert r.returncode == 0, r.stderr.decode()
    try:
        with review(user, "lv") as page:  # empty, but living: served
            st = page.state()
            assert st["changes"] == [] and st["living"] is True
            r = user.cli(["exec", "lv", "--", "sh", "-c", "echo live > live.txt"], cwd=project, timeout=60)
            assert r.returncode == 0, r.stderr.decode()
            deadline = time.monotonic() + 20
            while page.get("/api/fingerprint")[1]["fingerprint"] == st["fingerprint"]:
                assert time.monotonic() < deadline, "the fingerprint never moved"
                time.sleep(0.2)
            st = page.state()
            assert [c["path"] for c in st["changes"]] == ["live.txt"]
            body = {"fingerprint": st["fingerprint"], "files": {"live.txt": {"decision": "approve"}}}
            status, res = page.post("/api/apply", body)
            assert status == 409 and res["kind"] == "busy" and "stockade stop lv" in res["error"], res
            assert not (project / "live.txt").exists()
            r = user.cli(["stop", "lv"], timeout=60)
            assert r.returncode == 0, r.stderr.decode()
            status, res = page.post("/api/apply", {**body, "fingerprint": page.state()["fingerprint"]})
            assert status == 200, res
        assert (project / "live.txt").read_text() == "live\n"
    finally:
        user.cli(["stop", "lv"], timeout=60)


def test_a_sandbox_range_of_ids_is_reviewed_and_applied(user: User, subids: int, project: Path) -> None:
    """An unprivileged caller's sandbox gave entries to its other ids (0700, owned by 1000
    inside): the page reads and applies them through the id-mapped child (session/idrange),
    forked from the server's threads."""
    if user.name == "root":
        pytest.skip("the subordinate-range case is the unprivileged caller's")
    r = user.cli(["run", "--root", "--session", "ids", "--", "sh", "-c",
                  "mkdir -p own && printf 'one\\ntwo\\n' > own/f && chown -R 1000:1000 own && chmod 700 own && "
                  "echo more >> README.md"], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    assert (user.state / "sessions" / "ids" / "upper" / "own").stat().st_uid == subids + 1000
    before = tree_snapshot(project)
    with review(user, "ids") as page:
        st = page.state()
        assert {c["path"] for c in st["changes"]} == {"own", "own/f", "README.md"}
        status, view = page.get("/api/file?path=own/f")
        assert status == 200 and view["new_text"] == "one\ntwo\n", view
        status, res = page.post("/api/apply", {"fingerprint": st["fingerprint"], "files": {
            "own/f": {"decision": "approve", "content": "edited\n"}, "README.md": {"decision": "reject"}}})
        assert status == 200, res
        assert (project / "own" / "f").read_bytes() == b"edited\n"
        assert (project / "own" / "f").stat().st_uid == user.uid  # owned as every applied path is
        assert res["discarded"] == ["README.md"]
        status, rb = page.post("/api/rollback", {"apply_id": res["apply_id"]})
        assert status == 200, rb
        assert tree_snapshot(project) == before
    assert session_paths(user, project, "ids") == {"own": "added", "own/f": "added"}


def _cmdlines() -> dict[int, bytes]:
    got = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                got[int(d.name)] = (d / "cmdline").read_bytes()
            except OSError:
                pass  # ended meanwhile
    return got


def test_open_hands_the_page_to_the_browser_without_its_token(user: User, project: Path) -> None:
    """--open goes through the webbrowser module ($BROWSER is the user's choice of browser) but
    gives it file:// of a 0600 redirect page in a 0700 directory of the user's: the token is in
    no process's argv (any local user reads /proc/*/cmdline), and the page still loads through it."""
    from stockade.review.opener import redirect_page

    run(user, project, "rv", "echo x > x.txt")
    d = world_tmpdir("stockade-browser-")
    try:
        script = d / "browser"
        # records its argv, and stays a moment so the host side sees it in /proc
        script.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$0\" \"$@\" > {d}/argv.tmp\n"
                          f"mv {d}/argv.tmp {d}/argv\nsleep 2\n")
        script.chmod(0o755)
        user.own(d)
        with review(user, "rv", "--open", env={"BROWSER": f"{script} %s"}) as page:
            deadline = time.monotonic() + 20
            while not (d / "argv").exists():
                assert time.monotonic() < deadline, "the browser was never started"
                time.sleep(0.1)
            # from the host side: no process on the machine has the token in its argv
            leaks = {pid: c for pid, c in _cmdlines().items() if page.token.encode() in c}
            assert not leaks, leaks
            argv = (d / "argv").read_text().splitlines()
            assert len(argv) == 2 and page.token not in "\n".join(argv), argv
            opened = urllib.parse.urlsplit(argv[1])
            assert opened.scheme == "file", argv
            f = Path(urllib.parse.unquote(opened.path))
            st, dst = f.stat(), f.parent.stat()
            assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == user.uid, oct(st.st_mode)
            assert stat.S_IMODE(dst.st_mode) == 0o700 and dst.st_uid == user.uid, oct(dst.st_mode)
            assert f.read_text() == redirect_page(page.url)
            # another uid can neither list the directory nor read the file
            other = 65533 if user.uid == 65534 else 65534
            for cmd in (["ls", str(f.parent)], ["cat", str(f)]):
                r = subprocess.run(["setpriv", f"--reuid={other}", f"--regid={other}", "--clear-groups", *cmd],
                                   capture_output=True)
                assert r.returncode != 0 and b"Permission denied" in r.stderr, (cmd, r)
            # the browser follows the redirect: the page loads, and the file (token on disk) goes
            target = re.search(r'http-equiv="refresh" content="0;url=([^"]+)"', f.read_text())
            assert target is not None and html.unescape(target.group(1)) == page.url
            with urllib.request.urlopen(page.url, timeout=30) as r:
                assert r.status == 200 and b"<html" in r.read().lower()
            deadline = time.monotonic() + 10
            while f.exists():
                assert time.monotonic() < deadline, "the redirect file outlived the page's first load"
                time.sleep(0.1)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_open_removes_its_redirect_file_when_the_page_was_never_loaded(user: User, project: Path,
                                                                       stop: signal.Signals) -> None:
    """Ctrl-C, a service manager's SIGTERM and a closed terminal's SIGHUP all end the server
    the same way: exit 0, and the token's file on disk gone."""
    run(user, project, "rv", "echo x > x.txt")
    d = world_tmpdir("stockade-browser-")
    try:
        script = d / "browser"
        script.write_text(f"#!/bin/sh\necho \"$1\" > {d}/argv.tmp\nmv {d}/argv.tmp {d}/argv\n")
        script.chmod(0o755)
        user.own(d)
        with review(user, "rv", "--open", env={"BROWSER": f"{script} %s"}, stop=stop):
            deadline = time.monotonic() + 20
            while not (d / "argv").exists():
                assert time.monotonic() < deadline, "the browser was never started"
                time.sleep(0.1)
            f = Path(urllib.parse.unquote(urllib.parse.urlsplit((d / "argv").read_text().strip()).path))
            time.sleep(0.5)
            assert f.exists()  # nobody loaded the page: it waits for the browser
        assert not f.exists()  # gone with the server
    finally:
        shutil.rmtree(d, ignore_errors=True)
