"""The command line of the network allowlist (issue 16): bad input is one line naming
the option or key, exit 2, and nothing created; session host rules (`allow --host`,
`deny --host`, `allow --list`) and `policy why --host` / `policy show`. Through the
in-process and the served CLI, as root and unprivileged. No proxy runs here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ..conftest import User
from .test_bad_input import check_bad, listing

pytestmark = pytest.mark.cli_paths  # every test with a `user`: in-process and served

# (argv, what the one line must say); "existing" is a session of the project
BAD: list[tuple[list[str], str]] = [
    (["run", "--session", "brandnew", "--allow-host", "pypi.org", "--", "true"],
     "--allow-host needs --net allow (the network mode is none); add --net allow"),
    (["run", "--session", "existing", "--net", "host", "--allow-host", "pypi.org", "--", "true"],
     "--allow-host needs --net allow (the network mode is host)"),
    (["run", "--session", "brandnew", "--net", "allow", "--allow-host", "*", "--", "true"],
     "--allow-host: '*': '*' alone would allow every host"),
    (["run", "--net", "allow", "--allow-host", "foo*.example.org", "--", "true"],
     "--allow-host: 'foo*.example.org': '*' only as the whole first label"),
    (["run", "--session", "brandnew", "--net", "allow", "--allow-host", "0177.0.0.1", "--", "true"],
     "--allow-host: '0177.0.0.1': write an IPv4 address as four decimal numbers"),
    (["run", "--net", "allow", "--allow-host", "2130706433", "--", "true"], "--allow-host: '2130706433'"),
    (["run", "--session", "brandnew", "--net", "allow", "--allow-host", "@nope", "--", "true"],
     "--allow-host: unknown preset '@nope'; known presets: @debian, @github, @npm, @pypi"),
    (["run", "--net", "allow", "--allow-host", "pypi.org:70000", "--", "true"],
     "--allow-host: 'pypi.org:70000': port 70000 is out of range (1-65535)"),
    (["run", "--net", "allow", "--allow-host", "a..b", "--", "true"], "--allow-host: 'a..b': empty label"),
    (["run", "--net", "allow", "--allow-host", "[::1", "--", "true"], "--allow-host: '[::1': missing ']'"),
    (["run", "--session", "brandnew", "--forward", "3128", "--", "true"], "--forward: port 3128 is the sandbox's own proxy"),
    (["run", "--forward", "53", "--", "true"], "--forward: port 53 is the sandbox's own DNS responder"),
    (["run", "--session", "existing", "--forward", "0", "--", "true"], "--forward: port 0 is out of range (1-65535)"),
    (["run", "--forward", "http", "--", "true"], "--forward: port 'http' is not a port number (1-65535)"),
    (["run", "--session", "brandnew", "--net", "host", "--forward", "5432", "--", "true"],
     "--forward: the host's network already reaches its ports"),
    (["run", "--net", "open", "--", "true"], "--net: invalid choice: 'open'"),
    (["explain", "--net", "allow", "--allow-host", "*", "--", "true"], "--allow-host: '*'"),
    (["allow", "--host", "*", "--session", "existing"], "allow --host: '*': '*' alone"),
    (["allow", "--host", "evil..example"], "allow --host: 'evil..example': empty label"),
    (["deny", "--host", "evil.example:0", "--session", "existing"], "deny --host: 'evil.example:0': port 0 is out of range"),
    (["allow", "--host", "@nope", "--session", "existing"], "allow --host: unknown preset '@nope'; known presets:"),
    (["allow", "--host", "pypi.org", "--session", "nosuch"], "no session named 'nosuch'; list them with `stockade list`"),
    (["deny", "--host", "pypi.org", "--session", "nosuch"], "no session named 'nosuch'"),
    (["allow", "/usr", "--host", "pypi.org", "--session", "existing"], "allow: give a PATH or --host HOST, not both"),
    (["allow", "--host", "pypi.org", "--rw", "--session", "existing"], "allow --host: --rw is for paths"),
    (["allow", "--session", "existing"], "allow: give a PATH, or --host HOST[:PORT], or --list"),
    (["deny", "--session", "existing"], "deny: give a PATH, or --host HOST[:PORT]"),
    (["allow", "--host", "never.example", "--remove", "--session", "existing"],
     "session existing has no host rule for never.example"),
    (["allow", "--list", "--session", "nosuch"], "no session named 'nosuch'"),
    (["allow", "--list", "/usr", "--session", "existing"], "allow --list takes no PATH"),
    (["allow", "--json", "--session", "existing"], "allow: --json is for --list"),
    (["policy", "why", "--host", "pypi.org:99999"], "--host 'pypi.org:99999': port 99999 is out of range"),
    (["policy", "why", "--host", "[::1"], "--host '[::1': expected HOST[:PORT]"),
    (["policy", "why"], "policy why: give a PATH, or --host HOST[:PORT] (not both)"),
    (["policy", "why", "/usr", "--host", "pypi.org"], "policy why: give a PATH, or --host HOST[:PORT] (not both)"),
]


def test_bad_network_input_creates_nothing(user: User, project: Path) -> None:
    r = user.cli(["run", "--session", "existing", "--", "true"], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    for argv, says in BAD:
        check_bad(user, project, argv, says)
    assert not (user.state / "sessions" / "brandnew").exists()
    assert not (user.state / "sessions" / "existing" / "policy.json").exists()


@pytest.mark.parametrize("toml,says", [
    ('[network]\nallow = [\n  "pypi.org",\n  "*",\n]\n', ".stockade.toml:4: network.allow[1]: '*': '*' alone"),
    ('[network]\ndeny = ["x.org:0"]\n', ".stockade.toml:2: network.deny[0]: 'x.org:0': port 0 is out of range"),
    ('[network]\nallow = ["@corp"]\n', ".stockade.toml:2: network.allow[0]: unknown preset '@corp'"),
    ('[network]\nforward = [5432, "3128"]\n', ".stockade.toml:2: network.forward[1]: port 3128"),
    ('[network]\nresolver = "dns.example"\n', ".stockade.toml:2: network.resolver: resolver 'dns.example': expected IP:PORT"),
    ('[network]\nmode = "open"\n', ".stockade.toml:2: network.mode: invalid value 'open'"),
    ('[network]\nhosts = ["x.org"]\n', ".stockade.toml:2: network.hosts: unknown key; valid keys here: allow, deny"),
])
def test_bad_network_config_creates_nothing(user: User, project: Path, toml: str, says: str) -> None:
    r = user.cli(["run", "--session", "existing", "--", "true"], cwd=project)  # the state dir as a user has it
    assert r.returncode == 0, r.stderr.decode()
    (project / ".stockade.toml").write_text(toml)
    user.own(project / ".stockade.toml")
    for argv in (["run", "--session", "brandnew", "--", "true"], ["run", "--net", "allow", "--", "true"],
                 ["policy", "why", "--host", "pypi.org"]):
        check_bad(user, project, argv, says)


def test_session_host_rules(user: User, project: Path) -> None:
    def ok(argv: list[str]) -> str:
        r = user.cli(argv, cwd=project)
        assert r.returncode == 0, (argv, r.stderr.decode())
        return r.stdout.decode()

    ok(["run", "--session", "s1", "--", "true"])
    out = ok(["allow", "--host", "PyPI.org.", "--session", "s1"])
    assert out == ("session s1: allowed host pypi.org (effective for the next connection of a running "
                   "--net allow run, and the next run)\n")
    ok(["deny", "--host", "evil.example:443", "--session", "s1"])
    ok(["allow", "--host", "@github", "--session", "s1"])
    ok(["allow", "/usr/share", "--session", "s1"])
    ok(["deny", "--host", "pypi.org", "--session", "s1"])  # replaces the session's allow of it
    doc = json.loads(ok(["allow", "--list", "--json", "--session", "s1"]))
    assert doc["session"] == "s1" and doc["file"] == str(user.state / "sessions" / "s1" / "policy.json")
    assert [(p["path"], p["access"]) for p in doc["paths"]] == [("/usr/share", "ro")]
    assert [(h["host"], h["action"]) for h in doc["hosts"]] == [
        ("evil.example:443", "deny"), ("@github", "allow"), ("pypi.org", "deny")]
    text = ok(["allow", "--list", "--session", "s1"])
    assert "ro      /usr/share" in text and "deny    evil.example:443" in text and "allow   @github" in text

    # why: the rule, the file (with its line) and the tier; the default port is 443
    pfile = str(user.state / "sessions" / "s1" / "policy.json")
    text = ok(["policy", "why", "--host", "evil.example", "--session", "s1"])
    assert text.startswith("evil.example:443: BLOCKED (layer: session)\n")
    assert f"denied by 'evil.example:443' from {pfile}:" in text and "(session)" in text
    assert "the network mode is none" in text
    doc = json.loads(ok(["policy", "why", "--host", "github.com:22", "--json", "--session", "s1"]))
    assert doc["allowed"] is True and doc["port"] == 22 and doc["rule"]["pattern"] == "github.com:22"
    assert doc["rule"]["preset"] == "github" and doc["rule"]["tier"] == "session" and doc["rule"]["source"] == pfile
    text = ok(["policy", "why", "--host", "nope.example", "--session", "s1"])
    assert "no rule allows nope.example:443 (stockade allow --host nope.example)" in text
    text = ok(["policy", "why", "--host", "[::1]:5432", "--session", "s1"])
    assert "no rule allows the address [::1]:5432" in text

    # show: every host rule with its tier and where it was given; the project's config too
    (project / ".stockade.toml").write_text('[network]\nmode = "allow"\nallow = ["@npm"]\n')
    user.own(project / ".stockade.toml")
    text = ok(["policy", "show", "--session", "s1"])
    assert f"network  allow (workspace ({project}/.stockade.toml:2))" in text
    rows = [ln.split() for ln in text.splitlines() if ln.startswith("host ")]
    assert ["host", "allow", "registry.npmjs.org:443", "workspace", f"{project}/.stockade.toml:3", "preset", "npm"] in rows
    assert ["host", "deny", "pypi.org", "session", f"{pfile}:{rows_line(pfile, 'pypi.org')}"] in rows
    doc = json.loads(ok(["policy", "show", "--json", "--session", "s1"]))
    assert doc["network"]["mode"] == "allow"
    assert {"pattern": "evil.example:443", "action": "deny", "tier": "session", "source": pfile, "preset": None,
            "line": rows_line(pfile, "evil.example:443")} in doc["network"]["rules"]
    text = ok(["policy", "why", "--host", "registry.npmjs.org", "--session", "s1"])
    assert text.startswith("registry.npmjs.org:443: ALLOWED (layer: workspace)") and "note:" not in text

    # removal (allow --remove and deny --remove alike), then the list is empty of hosts
    ok(["allow", "--host", "evil.example:443", "--remove", "--session", "s1"])
    ok(["deny", "--host", "@GitHub", "--remove", "--session", "s1"])
    ok(["allow", "--host", "pypi.org", "--remove", "--session", "s1"])
    doc = json.loads(ok(["allow", "--list", "--json", "--session", "s1"]))
    assert doc["hosts"] == [] and len(doc["paths"]) == 1


def rows_line(pfile: str, host: str) -> int:
    """The line of ``host``'s entry in the session's policy.json (what provenance names)."""
    for no, text in enumerate(Path(pfile).read_text().splitlines(), 1):
        if json.dumps(host) in text:
            return no
    raise AssertionError(f"{host} not in {pfile}")


def test_mode_and_rules_reach_the_plan(user: User, project: Path) -> None:
    """The config's mode, the command line's mode over it, and the rules, in `explain`."""
    def explain(*opts: str) -> str:
        r = user.cli(["explain", *opts, "--", "true"], cwd=project)
        assert r.returncode == 0, r.stderr.decode()
        return r.stdout.decode()

    assert "network:     none" in explain()
    (project / ".stockade.toml").write_text('[network]\nmode = "allow"\nallow = ["@pypi"]\nforward = [5432]\n')
    user.own(project / ".stockade.toml")
    text = explain("--allow-host", "*.example.org:443")
    assert "network:     allow" in text and "5432" in text
    assert "files.pythonhosted.org:443" in text and "*.example.org:443" in text
    assert "network:     none" in explain("--net", "none")
    text = explain("--net", "host")
    assert "network:     host" in text and "5432" not in text.split("mounts")[0]


@pytest.mark.parametrize("kw,says", [
    ({"allow_hosts": ["pypi.org"]}, "--allow-host needs --net allow"),
    ({"network": "allow", "allow_hosts": ["*"]}, "--allow-host: '*'"),
    ({"network": "allow", "allow_hosts": ["@nope"]}, "unknown preset '@nope'"),
    ({"network": "host", "forward": [5432]}, "--forward: the host's network already reaches its ports"),
    ({"forward": [3128]}, "--forward: port 3128"),
    ({"network": "open"}, "--net 'open' is not a network mode"),
])
def test_api_bad_network_input_creates_nothing(api_project: Path, state_dir: Path, kw: dict[str, object],
                                               says: str) -> None:
    """The API refuses what the command line refuses, with the same words, before a
    session of its own is left behind (a named one, new, included)."""
    import stockade
    from stockade.errors import UsageError

    assert stockade.run(["true"], project=api_project, session="existing").returncode == 0
    for session in (None, "brandnew", "existing"):
        before = listing(state_dir)
        with pytest.raises(UsageError) as ei:
            stockade.run(["true"], project=api_project, session=session, **kw)  # type: ignore[arg-type]
        assert says in str(ei.value) and "\n" not in str(ei.value)
        assert listing(state_dir) == before, session
        assert not (state_dir / "sessions" / "brandnew").exists()
