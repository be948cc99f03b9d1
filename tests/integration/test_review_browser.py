"""The review page in a real browser: headless Chromium (Debian's chromium and
chromium-driver, installed by scripts/test-tools.sh when root) driven by Selenium, against
`stockade review` running as the user under test (root and unprivileged) over a real
sandbox run's change set. A reviewer approves two files, rejects one, rejects one hunk of a
fourth, applies, and the project is read from the host; a screenshot shows a page; requests
without the token or from another origin are refused and change nothing; the rollback
button restores the project."""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..conftest import User, need, tree_snapshot
from .test_review_http import MULTI, _cmdlines, review, run, session_paths

pytestmark = pytest.mark.slow

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1400,1000")


@pytest.fixture
def browser() -> Iterator[Any]:
    need(Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists(),
         "headless Chromium is missing (apt-get install chromium chromium-driver; `make test` installs them)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        need(False, "selenium is not installed (pip install -e '.[dev]')")
        raise
    profile = tempfile.mkdtemp(prefix="stockade-chromium-")
    opts = webdriver.ChromeOptions()
    for f in FLAGS:
        opts.add_argument(f)
    opts.add_argument(f"--user-data-dir={profile}")
    opts.binary_location = CHROMIUM
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def png_colours(png: bytes) -> tuple[int, int, int]:
    """(width, height, distinct colours) of an 8-bit RGB or RGBA PNG, decoded here."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height, bpp = 8, b"", 0, 0, 0
    while pos < len(png):
        n, kind = struct.unpack(">I4s", png[pos:pos + 8])
        body = png[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, ctype = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and ctype in (2, 6), (depth, ctype)
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride = width * bpp
    prev = bytearray(stride)
    colours: set[bytes] = set()
    for y in range(height):
        ftype, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if ftype == 1:
                line[i] = (line[i] + a) & 0xFF
            elif ftype == 2:
                line[i] = (line[i] + b) & 0xFF
            elif ftype == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        colours.update(bytes(line[x:x + 3]) for x in range(0, stride, bpp))
        prev = line
    return width, height, len(colours)


def _post(page: Any, body: dict[str, Any], headers: dict[str, str]) -> int:
    req = urllib.request.Request(page.origin + "/api/apply", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_review_in_a_browser(user: User, project: Path, browser: Any) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    (project / "multi.txt").write_text(MULTI)
    user.own(project)
    before = tree_snapshot(project)
    run(user, project, "br",
        "echo one > one.txt; echo 'print(\"sandbox\")' > src/main.py; echo junk > junk.txt; "
        "sed -i 's/^line 2$/LINE 2/; s/^line 20$/LINE 20/; s/^line 39$/LINE 39/' multi.txt; "
        "echo later > later.txt; printf 'draft\\n' > edit.txt")
    # the page redraws its tree on every change: an element found just before is stale, look again
    wait = WebDriverWait(browser, 30, ignored_exceptions=(StaleElementReferenceException,))

    def css(sel: str) -> Any:
        return wait.until(EC.element_to_be_clickable((By.CSS_SELECTOR, sel)))

    with review(user, "br") as page:
        browser.get(page.url)
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
        assert "session br" in browser.find_element(By.ID, "session-name").text
        rows = browser.find_elements(By.CSS_SELECTOR, "#tree li.file")
        assert {r.get_attribute("data-path") for r in rows} == {"one.txt", "src/main.py", "junk.txt", "multi.txt",
                                                                "later.txt", "edit.txt"}
        assert "sed -i" in browser.find_element(By.ID, "runs").text  # the run that made them
        # approve two files, reject one
        css('#tree li[data-path="one.txt"] button.approve').click()
        css('#tree li[data-path="src/main.py"] button.approve').click()
        css('#tree li[data-path="junk.txt"] button.reject').click()
        # a Python file is coloured: its string and keyword (no HTML from the file: text nodes)
        css('#tree li[data-path="src/main.py"] .name').click()
        wait.until(lambda d: d.find_element(By.ID, "file-path").text == "src/main.py")
        assert [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#diff tr.add .tk-str")] == ['"sandbox"']
        assert [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#diff tr.del .tk-str")] == ["'hello'"]
        # a fifth, edited in the page's editor before it is applied
        css('#tree li[data-path="edit.txt"] .name').click()
        wait.until(lambda d: d.find_element(By.ID, "file-path").text == "edit.txt")
        css("#edit").click()
        editor = css("#editor")
        assert editor.get_attribute("value") == "draft\n"
        editor.clear()
        editor.send_keys("reviewed ünïcode\nsecond line\n")
        css("#save-edit").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, '#tree li[data-path="edit.txt"] .mark.edited'))
        # the fourth: three hunks, the middle one rejected (the others are then taken)
        css('#tree li[data-path="multi.txt"] .name').click()
        wait.until(lambda d: d.find_element(By.ID, "file-path").text == "multi.txt"
                   and len(d.find_elements(By.CSS_SELECTOR, "#diff .hunk")) == 3)
        css('#diff .hunk[data-index="1"] .hunk-reject').click()
        wait.until(lambda d: "rejected" in d.find_element(By.CSS_SELECTOR, '#diff .hunk[data-index="1"]')
                   .get_attribute("class"))
        assert [h.get_attribute("class") for h in browser.find_elements(By.CSS_SELECTOR, "#diff .hunk")] == \
            ["hunk approved", "hunk rejected", "hunk approved"]
        css("#view-toggle").click()  # side by side shows the same hunks
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#diff .hunk td.tx.add")) == 3)
        assert browser.find_element(By.ID, "summary").text == "4 to apply, 1 to discard, 1 left for later"
        png = browser.get_screenshot_as_png()
        width, height, colours = png_colours(png)
        assert width >= 800 and height >= 600 and colours > 40, (width, height, colours)
        assert tree_snapshot(project) == before  # deciding writes nothing
        css("#apply").click()
        wait.until(lambda d: d.find_elements(By.ID, "apply-id"))
        apply_id = browser.find_element(By.ID, "apply-id").get_attribute("data-apply-id")
        assert sorted(li.text for li in browser.find_elements(By.CSS_SELECTOR, "#applied-list li")) == \
            ["edit.txt (your edit)", "multi.txt (hunks 1, 3)", "one.txt", "src/main.py"]
        assert [li.text for li in browser.find_elements(By.CSS_SELECTOR, "#discarded-list li")] == ["junk.txt"]
        # the project, from the host
        assert (project / "one.txt").read_bytes() == b"one\n"
        assert (project / "src" / "main.py").read_bytes() == b'print("sandbox")\n'
        assert (project / "multi.txt").read_text() == MULTI.replace("line 2\n", "LINE 2\n").replace(
            "line 39\n", "LINE 39\n")
        assert (project / "edit.txt").read_bytes() == "reviewed ünïcode\nsecond line\n".encode()
        assert not (project / "junk.txt").exists() and not (project / "later.txt").exists()
        assert all((project / p).stat().st_uid == user.uid for p in ("one.txt", "multi.txt", "src/main.py"))
        wait.until(lambda d: [r.get_attribute("data-path") for r in d.find_elements(By.CSS_SELECTOR, "#tree li.file")]
                   == ["later.txt"])
        # refused: no token, a wrong one, another origin; nothing changes
        after = tree_snapshot(project)
        fp = page.get("/api/fingerprint")[1]["fingerprint"]
        body = {"fingerprint": fp, "files": {"later.txt": {"decision": "approve"}}}
        assert _post(page, body, {"Origin": page.origin}) == 403
        assert _post(page, body, {"Origin": page.origin, "X-Stockade-Token": "not-it"}) == 403
        assert _post(page, body, {"Origin": "http://evil.example", "X-Stockade-Token": page.token}) == 403
        assert _post(page, body, {"X-Stockade-Token": page.token}) == 403
        assert tree_snapshot(project) == after
        assert session_paths(user, project, "br") == {"later.txt": "added"}
        # the rollback button
        css("#rollback").click()
        wait.until(lambda d: d.find_elements(By.ID, "rolled-back"))
        assert apply_id in browser.find_element(By.ID, "rolled-back").text
        assert tree_snapshot(project) == before
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#tree li.file")) == 5)
        # live: a run in the session while the page is open shows up by itself
        run(user, project, "br", "echo fresh > fresh.txt")
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, '#tree li[data-path="fresh.txt"]'))
        assert "The change set changed" in browser.find_element(By.ID, "banner").text
        assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert session_paths(user, project, "br") == {"one.txt": "added", "src/main.py": "modified",
                                                  "multi.txt": "modified", "later.txt": "added",
                                                  "edit.txt": "added", "fresh.txt": "added"}


def test_conflicts_and_stale_pages_in_the_browser(user: User, project: Path, browser: Any) -> None:
    """The engine's conflict (a host edit) is shown with its paths and an "Apply anyway"
    button; a page applying after the change set moved on is told so and nothing is written."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    run(user, project, "cf", "echo sandbox >> README.md; echo a > a.txt")
    (project / "README.md").write_text("# edited on the host\n")
    # the page redraws its tree on every change: an element found just before is stale, look again
    wait = WebDriverWait(browser, 30, ignored_exceptions=(StaleElementReferenceException,))

    def css(sel: str) -> Any:
        return wait.until(EC.element_to_be_clickable((By.CSS_SELECTOR, sel)))

    with review(user, "cf") as page:
        browser.get(page.url)
        wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
        css('#tree li[data-path="README.md"] button.approve').click()
        css("#apply").click()
        wait.until(lambda d: "conflict" in d.find_element(By.ID, "error").text)
        assert "README.md" in browser.find_element(By.ID, "error").text
        assert (project / "README.md").read_text() == "# edited on the host\n"
        css("#force-apply").click()
        wait.until(lambda d: d.find_elements(By.ID, "apply-id"))
        assert (project / "README.md").read_text() == "# demo\nsandbox\n"
        # stale: a page that does not follow changes says the change set moved on, and an
        # apply from it is refused with nothing written
        css("#follow").click()
        css('#tree li[data-path="a.txt"] button.approve').click()
        run(user, project, "cf", "echo b > a.txt")
        wait.until(lambda d: "applying now would be refused" in d.find_element(By.ID, "banner").text)
        css("#apply").click()
        wait.until(lambda d: "changed since the page showed it" in d.find_element(By.ID, "error").text)
        assert not (project / "a.txt").exists()
        wait.until(lambda d: d.find_element(By.ID, "apply").get_attribute("disabled"))  # its decision was cleared
        assert session_paths(user, project, "cf") == {"a.txt": "added"}


def test_open_reaches_the_page_through_its_redirect_file(user: User, project: Path, browser: Any) -> None:
    """--open gives the browser file:// of a redirect page (never the tokened URL: that would
    sit in the browser's argv, readable by every local user); a real browser following it
    lands on the working page, and the file is gone once it has."""
    import time
    import urllib.parse

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from ..conftest import world_tmpdir

    run(user, project, "op", "echo x > x.txt")
    d = world_tmpdir("stockade-browser-")
    try:
        script = d / "browser"
        script.write_text(f"#!/bin/sh\necho \"$1\" > {d}/argv.tmp\nmv {d}/argv.tmp {d}/argv\n")
        script.chmod(0o755)
        user.own(d)
        with review(user, "op", "--open", env={"BROWSER": f"{script} %s"}) as page:
            deadline = time.monotonic() + 20
            while not (d / "argv").exists():
                assert time.monotonic() < deadline, "the browser was never started"
                time.sleep(0.1)
            opened = (d / "argv").read_text().strip()
            assert opened.startswith("file://") and page.token not in opened
            browser.get(opened)
            wait = WebDriverWait(browser, 30)
            wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
            assert browser.current_url == page.url
            # from the host side: with the page open, no process (Chromium's own included) has
            # the token in its argv
            assert not {pid: c for pid, c in _cmdlines().items() if page.token.encode() in c}
            assert {r.get_attribute("data-path") for r in
                    browser.find_elements(By.CSS_SELECTOR, "#tree li.file")} == {"x.txt"}
            f = Path(urllib.parse.unquote(urllib.parse.urlsplit(opened).path))
            deadline = time.monotonic() + 10
            while f.exists():
                assert time.monotonic() < deadline, "the redirect file outlived the page's first load"
                time.sleep(0.1)
    finally:
        shutil.rmtree(d, ignore_errors=True)
