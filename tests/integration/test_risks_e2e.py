"""The risk summary end to end: a real sandboxed run writes risky files, then
`stockade diff --risks` (text and JSON), `status --json` and `export` report each risk
with its paths and reason, and never the secret itself. Root and uid 65534, in-process
and served CLI."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tests.conftest import User
from tests.integration.test_idns import mapped  # noqa: F401  (a fixture)

pytestmark = pytest.mark.cli_paths  # in-process and served

_AWS = "AKIAIOSFODNN7EXAMPLE"
_GH = "ghp_" + "Z9y8X7w6V5" * 4

SCRIPT = (
    "mkdir -p .github/workflows && printf 'on: push\\n' > .github/workflows/ci.yml"
    " && printf '#!/bin/sh\\necho hi\\n' > tool.sh && chmod 755 tool.sh"
    " && chmod 755 src/main.py"
    " && printf '{\"dependencies\": {\"left-pad\": \"1.3.0\", \"evil-pkg\": \"^2\"},"
    " \"scripts\": {\"postinstall\": \"node x.js\"}}\\n' > package.json"
    " && printf 'requests==2.32.0\\nflask\\n' > requirements.txt"
    f" && printf 'KEY = \"{_AWS}\"\\nTOKEN = \"{_GH}\"\\n' > settings.py"
    " && ln -s /etc/passwd passwd-link && ln -s README.md readme-link"
    " && printf 'export X=1\\n' > .envrc"
    " && rm -r olddir"
    " && head -c 2097152 /dev/zero > model.bin"
    " && printf 'x\\n' > suid && chmod 4755 suid"
)

EXPECT = {
    "held-back": {".envrc", "passwd-link"},
    "ci-config": {".github/workflows/ci.yml"},
    "executable": {"tool.sh"},
    "mode-exec": {"src/main.py"},
    "build-hook": {"package.json"},
    "dependencies": {"package.json", "requirements.txt"},
    "mass-deletion": {"olddir"},
    "large-binary": {"model.bin"},
    "secret": {"settings.py"},
    "symlink": {"passwd-link", "readme-link"},
}


def _risky_session(user: User, project: Path) -> None:
    old = project / "olddir"
    old.mkdir()
    for i in range(4):
        (old / f"f{i}").write_text(f"{i}\n")
    user.own(project)
    r = user.cli(["run", "--session", "s", "--", "sh", "-c", SCRIPT], cwd=project)
    assert r.returncode == 0, r.stderr


def _by_rule(risks: list[dict[str, object]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for r in risks:
        out.setdefault(str(r["rule"]), set()).update(str(p) for p in r["paths"])  # type: ignore[attr-defined]
    return out


def _suid_in_layer(user: User) -> bool:
    """Whether the sandbox's chmod 4755 kept its setuid bit in the session's layer (host side)."""
    hits = list(user.state.glob("**/upper/suid"))
    return bool(hits) and bool(os.lstat(hits[0]).st_mode & stat.S_ISUID)


def test_diff_risks_status_and_export(user: User, project: Path) -> None:
    _risky_session(user, project)
    before = {p.name for p in project.iterdir()}

    r = user.cli(["diff", "--risks", "s"], cwd=project)
    assert r.returncode == 0, r.stderr
    text = r.stdout.decode()
    for rule, paths in EXPECT.items():
        assert any(line.split()[1:2] == [rule] for line in text.splitlines()), (rule, text)
        for p in paths:
            assert f" {p}\n" in text, (p, text)
    assert "new package(s) in package.json: evil-pkg, left-pad" in text
    assert "postinstall" in text and "leads out of the project" in text
    assert b"risk(s)" in r.stderr and b"high" in r.stderr

    j = user.cli(["diff", "--risks", "--json", "s"], cwd=project)
    assert j.returncode == 0, j.stderr
    data = json.loads(j.stdout)
    got = _by_rule(data["risks"])
    for rule, paths in EXPECT.items():
        assert paths <= got.get(rule, set()), (rule, got)
    assert _suid_in_layer(user), "the sandbox's chmod 4755 left no setuid bit: the setuid rule is not exercised"
    assert got.get("setuid") == {"suid"}
    assert data["counts"]["high"] == sum(1 for x in data["risks"] if x["severity"] == "high")
    assert all(set(x) == {"rule", "severity", "paths", "reason"} for x in data["risks"])

    st = user.cli(["status", "--json", "s"], cwd=project)
    assert st.returncode == 0, st.stderr
    assert json.loads(st.stdout)["risks"] == data["risks"]

    dest = user.home / "bundle"
    ex = user.cli(["export", "s", str(dest)], cwd=project)
    assert ex.returncode == 0, ex.stderr
    bundle = json.loads((dest / "risks.json").read_text())
    assert bundle["risks"] == data["risks"] and bundle["counts"] == data["counts"]
    assert json.loads((dest / "status.json").read_text())["risks"] == data["risks"]

    # the secrets are named, never shown
    for out in (r.stdout, r.stderr, j.stdout, st.stdout, (dest / "risks.json").read_bytes()):
        assert _AWS.encode() not in out and _GH.encode() not in out
    # a report, nothing applied
    assert {p.name for p in project.iterdir()} == before and not (project / "settings.py").exists()

    # a pathspec narrows it
    n = json.loads(user.cli(["diff", "--risks", "--json", "s", "requirements.txt"], cwd=project).stdout)
    assert [(x["rule"], x["paths"]) for x in n["risks"]] == [("dependencies", ["requirements.txt"])]


def test_diff_risks_nothing_and_bad_input(user: User, project: Path) -> None:
    r = user.cli(["run", "--session", "quiet", "--", "true"], cwd=project)
    assert r.returncode == 0, r.stderr
    e = user.cli(["diff", "--risks", "quiet"], cwd=project)
    assert e.returncode == 0 and e.stdout == b"", e.stderr
    assert b"no changes in session quiet: nothing to assess" in e.stderr
    ej = user.cli(["diff", "--risks", "--json", "quiet"], cwd=project)
    assert ej.returncode == 0 and json.loads(ej.stdout)["risks"] == [], ej.stderr

    bad = user.cli(["diff", "--risks", "--stat", "quiet"], cwd=project)
    assert bad.returncode == 2 and b"--risks and --stat" in bad.stderr and bad.stdout == b""
    gone = user.cli(["diff", "--risks", "--session", "nosuch"], cwd=project)
    assert gone.returncode == 2 and b"nosuch" in gone.stderr and len(gone.stderr.splitlines()) == 1


# a session whose sandbox gave files to its other ids (0700 dirs, 0600 files the caller
# cannot open, test_idns's ``mapped``): the risk summary reads them through
# linux/idns's child, as diff does


@pytest.mark.parametrize("user", ["unpriv"], indirect=True)
def test_risks_read_through_the_sandbox_ids(user: User, project: Path, mapped: tuple[Path, int]) -> None:  # noqa: F811
    sdir, _ = mapped
    (sdir / "upper" / "d" / "f").write_text(f"token = {_GH}\n")  # as root: stays 0600, owned by a subordinate id
    r = user.py(f"open({str(sdir / 'upper' / 'd' / 'f')!r}).read()")
    assert r.returncode != 0 and b"PermissionError" in r.stderr  # the caller itself cannot read it
    j = user.cli(["diff", "--risks", "--json", sdir.name], cwd=project)
    assert j.returncode == 0, j.stderr
    got = {(x["rule"], x["severity"]): x for x in json.loads(j.stdout)["risks"]}
    assert got[("secret", "high")]["paths"] == ["d/f"] and "GitHub token" in got[("secret", "high")]["reason"]
    assert got[("symlink", "high")]["paths"] == ["h/link"]
    assert ("secret", "medium") not in got  # nothing left unread
    assert _GH.encode() not in j.stdout


def test_python_api(api_project: Path) -> None:
    import stockade
    from stockade.changes.risks import Risk, format_risks

    r = stockade.run(["sh", "-c", "printf '#!/bin/sh\\n' > t.sh && chmod 755 t.sh && ln -s /etc/hosts h"],
                     project=api_project, session="api")
    assert r.returncode == 0, r.stderr
    with stockade.Sandbox(api_project, session="api") as sb:
        risks = sb.changes().risks()
        only = sb.changes().risks(["t.sh"])
    assert all(isinstance(x, Risk) for x in risks)
    assert {(x.rule, x.paths, x.severity) for x in risks} >= {("executable", ("t.sh",), "medium"),
                                                              ("symlink", ("h",), "high")}
    assert [(x.rule, x.paths) for x in only] == [("executable", ("t.sh",))]
    assert "t.sh" in format_risks(risks)


HOSTILE_LINK = (
    "ln -s \"$(printf '/etc/x\\n\\033[2J\\033[31mFORGED-LINE')\" evil-link"
    " && printf '{\"scripts\": {\"postinstall\\\\n\\\\u001b[31mFAKE\": \"x\"}}\\n' > package.json"
)


def test_what_the_sandbox_wrote_cannot_forge_a_line(user: User, project: Path) -> None:
    """A symlink target or a script name the sandbox chose, quoted in a risk's reason or a
    held-back reason, is escaped in the text reports (the JSON keeps it exact)."""
    user.own(project)
    r = user.cli(["run", "--session", "h", "--", "sh", "-c", HOSTILE_LINK], cwd=project)
    assert r.returncode == 0, r.stderr
    for argv in (["diff", "--risks", "h"], ["status", "h"], ["apply", "--dry-run", "h"]):
        t = user.cli(argv, cwd=project)
        out = t.stdout.decode("utf-8", "replace") + t.stderr.decode("utf-8", "replace")
        bad = sorted({repr(c) for c in out if c != "\n" and (ord(c) < 0x20 or 0x7f <= ord(c) <= 0x9f)})
        assert bad == [], (argv, out)
        assert not any(ln.lstrip().startswith(("\x1b", "FORGED-LINE", "[31m")) for ln in out.splitlines()), out
    risks = user.cli(["diff", "--risks", "h"], cwd=project).stdout.decode()
    assert "/etc/x\\n\\x1b[2J\\x1b[31mFORGED-LINE" in risks, risks
    j = json.loads(user.cli(["diff", "--risks", "--json", "h"], cwd=project).stdout)
    assert any("/etc/x\n\x1b[2J" in r["reason"] for r in j["risks"]), j
