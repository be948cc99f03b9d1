"""`stockade review --open`: hand the page to the user's browser without putting its token
in any process's argv (``/proc/PID/cmdline`` is readable by every local user, and the token
gives full review rights: apply, roll back).

The browser is given ``file://`` of a small HTML file that redirects to the tokened URL
(as Jupyter does). The file is 0600 in a 0700 directory of the user's own under the state
directory, so only the user (and root) can read it; it is removed once the page has been
loaded, or when the server ends; a server killed before that leaves it, and the next
``--open`` removes it (the file is named after its server's pid)."""

from __future__ import annotations

import html
import json
import os
import stat
import tempfile
from pathlib import Path

from ..errors import UsageError
from ..paths import state_dir


def _private_dir() -> Path:
    """``STATE/review-open``, made 0700; refused when it is not a directory of our own
    (another user's, or a symlink planted there)."""
    base = Path(state_dir())
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    d = base / "review-open"
    try:
        d.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = d.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise UsageError(f"{d} is not a directory of your own (uid {st.st_uid}); remove it and run "
                         "`stockade review --open` again")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(d, 0o700)  # ours, but made by hand with a looser mode: others must not enter it
    return d


def redirect_page(url: str) -> str:
    """The HTML that sends the browser on to ``url`` (meta refresh, and ``location.replace``
    so the file is not left in the tab's history)."""
    attr = html.escape(url, quote=True)
    js = json.dumps(url).replace("<", "\\u003c")
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">\n"
            f"<meta http-equiv=\"refresh\" content=\"0;url={attr}\">\n"
            "<title>stockade review</title></head>\n"
            f"<body><p>Opening the <a href=\"{attr}\">review page</a>&hellip;</p>\n"
            f"<script>window.location.replace({js});</script></body></html>\n")


def write_redirect(url: str) -> Path:
    """A new 0600 file (O_EXCL, in the private directory) redirecting to ``url``, named
    after this process; the files of servers that are gone (killed before they removed
    theirs) are removed first."""
    d = _private_dir()
    sweep(d)
    fd, name = tempfile.mkstemp(prefix=f"review-{os.getpid()}-", suffix=".html", dir=d)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, redirect_page(url).encode())
    finally:
        os.close(fd)
    return Path(name)


def remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def sweep(d: Path) -> list[Path]:
    """Remove the redirect files whose server process is gone; those removed."""
    from ..linux.procs import pid_alive

    gone: list[Path] = []
    for f in d.glob("review-*-*.html"):
        pid = f.name.split("-")[1]
        if pid.isdigit() and not pid_alive(int(pid)):
            remove(f)
            gone.append(f)
    return gone
