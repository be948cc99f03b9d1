"""`stockade review --open`'s redirect file: 0600, in a 0700 directory of the caller's own,
refused when that directory is a symlink or another user's, and a page that sends the
browser on to the URL (escaped: the URL is data, not markup)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from stockade.errors import UsageError
from stockade.review import opener

URL = "http://127.0.0.1:4242/?token=abc-DEF_123"


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STOCKADE_STATE_DIR", str(tmp_path / "state"))
    return tmp_path / "state"


def test_the_file_is_private_and_redirects(state: Path) -> None:
    f = opener.write_redirect(URL)
    assert f.parent == state / "review-open"
    assert stat.S_IMODE(f.stat().st_mode) == 0o600 and f.stat().st_uid == os.geteuid()
    assert stat.S_IMODE(f.parent.stat().st_mode) == 0o700
    text = f.read_text()
    assert f'content="0;url={URL}"' in text and f'location.replace("{URL}")' in text
    g = opener.write_redirect(URL)
    assert g != f  # one file per server, never reused
    opener.remove(f)
    opener.remove(f)  # removing twice is fine (the page loaded, then the server stopped)
    assert not f.exists() and g.exists()


def test_a_loose_directory_of_ones_own_is_tightened(state: Path) -> None:
    (state / "review-open").mkdir(parents=True, mode=0o755)
    os.chmod(state / "review-open", 0o755)
    opener.write_redirect(URL)
    assert stat.S_IMODE((state / "review-open").stat().st_mode) == 0o700


def test_a_planted_symlink_or_foreign_directory_is_refused(state: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o777)
    state.mkdir()
    (state / "review-open").symlink_to(elsewhere)
    with pytest.raises(UsageError, match="not a directory of your own"):
        opener.write_redirect(URL)
    assert list(elsewhere.iterdir()) == []
    if os.geteuid() == 0:
        (state / "review-open").unlink()
        (state / "review-open").mkdir(mode=0o700)
        os.chown(state / "review-open", 65534, 65534)
        with pytest.raises(UsageError, match=r"not a directory of your own \(uid 65534\)"):
            opener.write_redirect(URL)


def test_markup_in_the_url_stays_data() -> None:
    page = opener.redirect_page('http://127.0.0.1:1/?token=x"><script>alert(1)</script>')
    assert "<script>alert" not in page and "\\u003cscript>" in page and "&quot;&gt;&lt;script&gt;" in page


def test_a_killed_servers_file_goes_with_the_next_open(state: Path) -> None:
    """A server killed before removing its file (SIGKILL) leaves it: the next --open
    removes the files of servers that are gone, never a live one's."""
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no process holds now
    d = state / "review-open"
    opener.write_redirect(URL)  # makes the directory
    dead = d / f"review-{gone.pid}-abc123.html"
    dead.write_text("stale")
    live = d / f"review-{os.getppid()}-def456.html"
    live.write_text("live")
    other = d / "notes.txt"
    other.write_text("not ours")
    f = opener.write_redirect(URL)
    assert not dead.exists() and live.exists() and other.exists() and f.exists()
    assert f.name.startswith(f"review-{os.getpid()}-")
