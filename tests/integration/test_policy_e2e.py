"""Seed 002's acceptance criteria end to end, against the real kernel, as root and as uid 65534.

Every check is made from the host side: the secret's bytes absent from the
sandbox's output, host files unchanged, the audit stream's contents.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.conftest import User

pytestmark = pytest.mark.cli_paths  # every test with a `user`: in-process and served (one run path)


def _secret() -> str:
    return f"STOCKADE-SECRET-{secrets.token_hex(10)}"


def _host_tmpdir(prefix: str) -> Path:
    """Under /var/tmp: the sandbox has its own /tmp, so only a path it never mounts shows a leak."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    d.chmod(0o755)
    return d


def _absent(err: str, path: Path) -> bool:
    """The tool's "No such file" error names this very path (coreutils quotes it for ls)."""
    return re.search(rf"{re.escape(str(path))}'?: No such file or directory", err) is not None


@pytest.fixture
def proj(project: Path, user: User) -> Path:
    return project


def _write(user: User, path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    user.own(path)


def _run(user: User, proj: Path, session: str, *argv: str, extra: tuple[str, ...] = (), env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return user.cli(["run", "--project", str(proj), "--session", session, *extra, "--", *argv], cwd=proj, env=env)


def _log(user: User, session: str, *flags: str) -> list[dict[str, object]]:
    r = user.cli(["log", session, "--json", *flags])
    assert r.returncode == 0, r.stderr.decode()
    return [json.loads(x) for x in r.stdout.decode().splitlines() if x.strip()]


def test_ac2_env_file_masked_example_readable(user: User, proj: Path) -> None:
    s1, s2, s3 = _secret(), _secret(), _secret()
    _write(user, proj / ".env", f"API_KEY={s1}\n")
    _write(user, proj / "config" / ".env.production", f"X={s2}\n")
    _write(user, proj / "deploy" / "server.pem", f"-----BEGIN PRIVATE KEY-----\n{s3}\n")
    _write(user, proj / ".env.example", "API_KEY=changeme\n")
    r = _run(user, proj, "ac2", "sh", "-c",
             "cat .env; cat config/.env.production; cat deploy/server.pem; echo; cat .env.example; "
             "ls -a; echo new > .env 2>&1 || echo WRITE-FAILED")
    out = r.stdout.decode() + r.stderr.decode()
    for s in (s1, s2, s3):
        assert s not in out
    assert "API_KEY=changeme" in out
    # absent by default: not even listed
    listing = out.split("API_KEY=changeme", 1)[1]
    assert ".env.example" in listing and "\n.env\n" not in listing
    # the host file is untouched whatever the sandbox wrote
    assert (proj / ".env").read_text() == f"API_KEY={s1}\n"
    blocked = _log(user, "ac2", "--blocked-only")
    targets = {str(e["target"]) for e in blocked}
    assert any(t.endswith(".env") and "example" not in t for t in targets), targets
    assert any("server.pem" in t for t in targets)
    assert all(e["result"] == "blocked" for e in blocked)
    assert s1 not in json.dumps(blocked)


def test_ac2_mask_mode_empty(user: User, proj: Path) -> None:
    s = _secret()
    _write(user, proj / ".env", s)
    r = _run(user, proj, "empty", "sh", "-c", "wc -c < .env; echo x >> .env || echo WRITE-FAILED",
             extra=("--mask-mode", "empty"))
    out = r.stdout.decode()
    assert s not in out + r.stderr.decode()
    assert out.split()[0] == "0"
    if user.name == "root":
        # root inside keeps CAP_DAC_OVERRIDE (a range of ids is mapped) and writes a
        # 0444 file as root does anywhere: the write lands in the change set, which
        # marks it refused, and apply never takes it
        st = user.cli(["status", "--json", "empty"], cwd=proj)
        assert b".env" in st.stdout and b"refused" in st.stdout, st.stdout.decode()
        ap = user.cli(["apply", "empty"], cwd=proj)
        assert ap.returncode != 0 or b".env" not in ap.stdout, (ap.stdout + ap.stderr).decode()
    else:
        assert "WRITE-FAILED" in out
    assert (proj / ".env").read_text() == s


def test_ac1_home_ssh_key_invisible(user: User, proj: Path) -> None:
    s = _secret()
    base = _host_tmpdir("stockade-ac1-")
    home = base / "home"  # $HOME of the caller, so its ~/.ssh rules apply
    key = home / ".ssh" / "id_rsa"
    _write(user, key, s, 0o600)
    key.parent.chmod(0o700)
    user.own(home)
    other = base / "other-project"
    _write(user, other / "notes.txt", s)
    (proj.parent / "sibling-project").mkdir()
    try:
        r = _run(user, proj, "ac1", "sh", "-c",
                 f"cat {key}; ls -a {key.parent}; cat {other / 'notes.txt'}; echo LS; ls {proj.parent}; echo DONE",
                 env={"HOME": str(home)})
        out, err = r.stdout.decode(), r.stderr.decode()
        assert "DONE" in out and s not in out + err
        # absent, not merely unreadable: each error names its own path
        for p in (key, key.parent, other / "notes.txt"):
            assert _absent(err, p), (p, err)
        assert out.split("LS\n", 1)[1] == "proj\nDONE\n", out
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_ac3_secret_variables_absent(user: User, proj: Path) -> None:
    s = _secret()
    env = {"AWS_SECRET_ACCESS_KEY": s, "GITHUB_TOKEN": s + "g", "CI": "true", "MY_API_KEY": s + "k",
           "HARMLESS": "ghp_" + "x" * 36}
    r = _run(user, proj, "ac3", "env", env=env, extra=("--env", "EXPLICIT=1"))
    assert r.returncode == 0, r.stderr.decode()
    out = r.stdout.decode()
    names = {line.split("=", 1)[0] for line in out.splitlines() if "=" in line}
    assert {"PATH", "CI", "EXPLICIT"} <= names
    assert not names & {"AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN", "MY_API_KEY", "HARMLESS"}
    assert s not in out and "ghp_" not in out
    blocked = {str(e["target"]) for e in _log(user, "ac3", "--blocked-only")}
    assert {"AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN"} <= blocked
    assert s not in json.dumps(_log(user, "ac3"))


def test_ac4_read_only_blocks_writes(user: User, proj: Path) -> None:
    before = (proj / "README.md").read_bytes()
    r = _run(user, proj, "ac4", "sh", "-c", "echo x > README.md; echo y > new.txt; rm src/main.py; echo rc=$?",
             extra=("--read-only",))
    err = r.stderr.decode() + r.stdout.decode()
    assert "Read-only file system" in err
    assert (proj / "README.md").read_bytes() == before
    assert not (proj / "new.txt").exists() and (proj / "src" / "main.py").exists()
    diff = user.cli(["diff", "ac4"], cwd=proj)
    assert b"new.txt" not in diff.stdout
    blocked = _log(user, "ac4", "--blocked-only")
    assert any(e.get("policy") == "read-only" for e in blocked), blocked


def test_ac4_denied_command_refused_before_spawn(user: User, proj: Path) -> None:
    marker = proj / "ran"
    _write(user, proj / ".stockade.toml", '[commands]\ndeny = ["touch"]\n')
    r = _run(user, proj, "cmd", "touch", str(marker))
    assert r.returncode == 2 and b"denied by workspace" in r.stderr
    assert not marker.exists()
    diff = user.cli(["diff", "cmd"], cwd=proj)
    assert b"ran" not in diff.stdout
    blocked = _log(user, "cmd", "--blocked-only")
    assert any("touch" in str(e["target"]) for e in blocked)


def test_session_deny_beats_global_allow(user: User, proj: Path) -> None:
    s = _secret()
    data = _host_tmpdir("stockade-data-")
    try:
        _write(user, data / "shared.txt", s)
        user.own(data)
        cfg = user.home / ".config" / "stockade" / "config.toml"
        _write(user, cfg, f'[[paths]]\npath = "{data}"\naccess = "ro"\n')
        user.own(user.home / ".config")
        r = _run(user, proj, "deny", "cat", str(data / "shared.txt"))
        assert s in r.stdout.decode(), r.stderr.decode()  # granted globally
        r = user.cli(["deny", str(data), "--session", "deny", "--project", str(proj)], cwd=proj)
        assert r.returncode == 0, r.stderr.decode()
        r = _run(user, proj, "deny", "cat", str(data / "shared.txt"))
        assert s not in r.stdout.decode() and r.returncode != 0
        assert _absent(r.stderr.decode(), data / "shared.txt"), r.stderr.decode()
        why = user.cli(["policy", "why", str(data / "shared.txt"), "--session", "deny", "--project", str(proj), "--json"], cwd=proj)
        assert why.returncode == 0, why.stderr.decode()
        d = json.loads(why.stdout)
        assert d["access"] == "denied" and d["source"] == "session"
        assert [o["source"] for o in d["overridden"]] == ["global"]
        text = user.cli(["policy", "why", str(data / "shared.txt"), "--session", "deny", "--project", str(proj)], cwd=proj)
        assert b"layer: session" in text.stdout
        # `allow --remove` takes the session rule away again: the global allow is back
        r = user.cli(["allow", "--remove", str(data), "--session", "deny", "--project", str(proj)], cwd=proj)
        assert r.returncode == 0, r.stderr.decode()
        r = _run(user, proj, "deny", "cat", str(data / "shared.txt"))
        assert s in r.stdout.decode()
    finally:
        shutil.rmtree(data, ignore_errors=True)


def test_session_allow_unmasks_one_file(user: User, proj: Path) -> None:
    _write(user, proj / "fixtures" / "test.key", "not-a-real-key")
    r = _run(user, proj, "unmask", "cat", "fixtures/test.key")
    assert b"not-a-real-key" not in r.stdout
    r = user.cli(["allow", str(proj / "fixtures" / "test.key"), "--session", "unmask", "--project", str(proj)], cwd=proj)
    assert r.returncode == 0, r.stderr.decode()
    r = _run(user, proj, "unmask", "cat", "fixtures/test.key")
    assert b"not-a-real-key" in r.stdout, r.stderr.decode()


def test_malformed_config_exit_2_nothing_run(user: User, proj: Path) -> None:
    _write(user, proj / ".stockade.toml", 'read_only = true\n[env]\nalow = ["X"]\n')
    r = _run(user, proj, "bad", "touch", "made")
    assert r.returncode == 2
    msg = r.stderr.decode()
    assert ".stockade.toml:3: env.alow: unknown key" in msg and "allow" in msg
    assert not (proj / "made").exists()
