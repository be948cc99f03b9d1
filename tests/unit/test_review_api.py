"""`stockade.review.serve` as an API (the MCP server and tests use it), and the page's data:
the marks of each change, held-back reasons, a file's sides."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from stockade.errors import SessionNotFound, UsageError
from stockade.review import data, serve
from tests.unit.test_changes_support import Builder, overlay_shell


def _session(tmp_path: Path) -> Builder:
    b = Builder(tmp_path, {"mod": "old\n", "exe": "#!/bin/sh\n", "bin": b"\0\1\2", "gone": "g\n"})
    b.new_session()
    overlay_shell(b.session, "echo new >> mod; chmod 755 exe; printf '\\000\\003' > bin; rm gone; "
                  "ln -s mod lnk; echo evil > .envrc; mkdir d && echo x > d/x")
    return b


def test_serve_answers_with_its_token_and_close_ends_it(tmp_path: Path, state_dir: Path) -> None:
    b = _session(tmp_path)
    srv = serve(b.session.id)
    try:
        assert srv.url.startswith("http://127.0.0.1:") and srv.url.endswith(f"/?token={srv.token}")
        with urllib.request.urlopen(f"{srv.origin}/api/state?token={srv.token}", timeout=30) as r:
            st = json.load(r)
        assert st["session"] == b.session.id
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{srv.origin}/api/state?token=nope", timeout=30)
        assert e.value.code == 403
        # a second server of the same session: another port, another token
        with serve(b.session) as other:
            assert other.port != srv.port and other.token != srv.token
    finally:
        srv.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", srv.port), timeout=5).close()


def test_serve_refuses_bad_input_before_binding(tmp_path: Path, state_dir: Path) -> None:
    b = _session(tmp_path)
    with pytest.raises(SessionNotFound):
        serve("no-such-session")
    with pytest.raises(UsageError, match="loopback"):
        serve(b.session, host="0.0.0.0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(UsageError, match=f"port {port} on 127.0.0.1 is in use"):
            serve(b.session, port=port)


def test_the_pages_data(tmp_path: Path, state_dir: Path) -> None:
    b = _session(tmp_path)
    st = data.state(b.session)
    by = {c["path"]: c for c in st["changes"]}
    assert set(by) == {"mod", "exe", "bin", "gone", "lnk", ".envrc", "d", "d/x"}
    assert by["exe"]["marks"] == ["modified", "mode"] and (by["exe"]["old_mode"], by["exe"]["new_mode"]) == ("644", "755")
    assert by["bin"]["marks"] == ["modified", "binary"]
    assert by["lnk"]["marks"] == ["added", "symlink"]
    assert by["gone"]["status"] == "D" and by["d"]["has_children"] and by["d"]["is_dir"]
    assert by[".envrc"]["held_back"] and not by["mod"]["held_back"]
    assert st["living"] is False and st["runs"] == [] and st["applies"] == []
    # the risk summary of the header: stockade diff --risks's
    rules = {r["rule"]: r for r in st["risks"]}
    assert ".envrc" in rules["held-back"]["paths"] and "exe" in rules["mode-exec"]["paths"], rules
    assert all(set(r) == {"rule", "severity", "paths", "reason"} for r in st["risks"])
    assert len(st["fingerprint"]) == 32 and st["fingerprint"] == data.fingerprint_of(b.session)
    v = data.file_view(b.session, "mod")
    assert v["hunk_choice"] and v["editable"] and v["new_text"] == "old\nnew\n"
    assert [ln for h in v["hunks"] for ln in h["lines"]] == [[" ", "old\n"], ["+", "new\n"]]
    v = data.file_view(b.session, "lnk")
    assert v["new_link"] == "mod" and v["hunks"] == [] and not v["editable"]
    v = data.file_view(b.session, "bin")
    assert v["binary"] and v["hunks"] == [] and not v["editable"]
    v = data.file_view(b.session, "gone")
    assert [h["lines"] for h in v["hunks"]] == [[["-", "g\n"]]] and not v["hunk_choice"] and not v["editable"]
    with pytest.raises(UsageError, match="no change at 'keep'"):
        data.file_view(b.session, "keep")


def test_a_rejected_path_written_again_after_the_apply_is_not_discarded(
        tmp_path: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The apply checks the whole change set under its lock; a run between its end and the
    discard that writes a rejected path again keeps that path (the reviewer never saw it)."""
    from stockade.changes.apply import apply_changes
    from stockade.changes.scan import scan
    from stockade.review import decide

    b = _session(tmp_path)

    def apply_then_a_run(*a: object, **k: object) -> object:
        res = apply_changes(*a, **k)  # type: ignore[arg-type]
        overlay_shell(b.session, "echo again >> lnk.txt; echo again >> d/x")
        return res

    overlay_shell(b.session, "echo one > lnk.txt")
    monkeypatch.setattr(decide, "apply_changes", apply_then_a_run)
    fp = data.fingerprint_of(b.session)
    out = decide.carry_out(b.session, {"fingerprint": fp, "files": {
        "mod": {"decision": "approve"}, "lnk.txt": {"decision": "reject"}, "gone": {"decision": "reject"},
        "d/x": {"decision": "reject"}}})
    assert out.apply is not None and out.apply.applied == ("mod",)
    assert (b.project / "mod").read_text() == "old\nnew\n"
    assert out.discarded == ["gone"]
    assert out.discard_error == "not discarded: d/x, lnk.txt changed since the page showed it"
    left = {c.path for c in scan(b.session).changes}
    assert {"lnk.txt", "d/x", "d"} <= left and "gone" not in left and "mod" not in left
