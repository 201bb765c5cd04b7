"""make book-check, the browser half: the book opened in headless Chromium, every page.

    python scripts/book_browser.py                 every page of build/book/; screenshots of the
                                                   start page and of the first and last stage's
    python scripts/book_browser.py --book DIR --shots DIR --chromium PATH

For each page it waits for the load event, then fails the run on: a console error or an uncaught
exception (what a broken script or a blocked resource reports), an image that did not load
(complete with a natural width of 0), or any request that is not to a local file (the book must
read offline; the browser is also started with every host name unresolvable, so such a request
would fail rather than fetch). Screenshots go to build/book/shots/: the start page, and for the
first and the last stage's page their top, their lesson diff and their first picture.

Chromium is driven over its DevTools protocol on a pipe (--remote-debugging-pipe: JSON messages
separated by NUL bytes on file descriptors 3 and 4), so the check needs nothing but the Debian
package `chromium` (apt-get install chromium; .ci/run installs it) and the standard library.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from workbook.build import stages

REPO = stages.REPO

VIEWPORT = {"width": 1200, "height": 800}
LOAD_TIMEOUT = 30.0
# Images that do not load (zero natural width), and how many there are, once the page has loaded.
IMAGES_JS = """(() => {
  const all = Array.from(document.images);
  return {count: all.length,
          broken: all.filter(i => !(i.complete && i.naturalWidth > 0))
                     .map(i => i.getAttribute('src'))};
})()"""
# Scroll the first element a selector matches to the middle of the window (false: there is none).
SCROLL_JS = """(selector => {
  const element = document.querySelector(selector);
  if (!element) return false;
  element.scrollIntoView({block: selector.startsWith('img') ? 'center' : 'start'});
  return true;
})(%s)"""


class BrowserError(RuntimeError):
    pass


def find_chromium(given: str | None) -> str:
    for name in ([given] if given else ["chromium", "chromium-browser", "google-chrome"]):
        found = shutil.which(name) if name else None
        if found:
            return found
    raise BrowserError("no Chromium found: apt-get install chromium (Debian), or pass --chromium")


class Chromium:
    """A headless Chromium and one tab, driven over the DevTools protocol on a pipe."""

    def __init__(self, binary: str, log_path: Path):
        self.profile = tempfile.mkdtemp(prefix="book-chromium-")
        commands_read, self._commands = os.pipe()  # we write, Chromium reads on its fd 3
        self._replies, replies_write = os.pipe()  # Chromium writes on its fd 4, we read

        def onto_3_and_4():
            # Move both ends above the low numbers first, so that neither dup2 clobbers the other.
            high_read = fcntl.fcntl(commands_read, fcntl.F_DUPFD, 10)
            high_write = fcntl.fcntl(replies_write, fcntl.F_DUPFD, 10)
            os.dup2(high_read, 3)
            os.dup2(high_write, 4)

        args = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--mute-audio", "--hide-scrollbars",
                "--host-resolver-rules=MAP * ~NOTFOUND", f"--user-data-dir={self.profile}",
                "--remote-debugging-pipe", "about:blank"]
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, close_fds=False,
                                     preexec_fn=onto_3_and_4)
        os.close(commands_read)
        os.close(replies_write)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []
        self.session: str | None = None

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise BrowserError("Chromium did not answer in time")
            if self.proc.poll() is not None:
                raise BrowserError(f"Chromium exited with status {self.proc.returncode} "
                                   f"(its output: {self._log.name})")
            ready, _, _ = select.select([self._replies], [], [], 0.5)
            if ready:
                chunk = os.read(self._replies, 1 << 20)
                if not chunk:
                    raise BrowserError(f"Chromium closed the pipe (its output: {self._log.name})")
                self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, params: dict | None = None, *, session: bool = True,
             timeout: float = LOAD_TIMEOUT) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session and self.session:
            message["sessionId"] = self.session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error'].get('message')}")
                return reply.get("result", {})
            if "method" in reply:
                self.events.append(reply)

    def wait_for(self, method: str, timeout: float = LOAD_TIMEOUT) -> dict:
        deadline = time.monotonic() + timeout
        for i, event in enumerate(self.events):
            if event["method"] == method:
                return self.events.pop(i)
        while True:
            reply = self._read_message(deadline)
            if reply.get("method") == method:
                return reply
            if "method" in reply:
                self.events.append(reply)

    def open_tab(self) -> None:
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)
        attached = self.send("Target.attachToTarget",
                             {"targetId": target["targetId"], "flatten": True}, session=False)
        self.session = attached["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable")
        self.send("Emulation.setDeviceMetricsOverride",
                  {**VIEWPORT, "deviceScaleFactor": 1, "mobile": False})

    def close(self) -> None:
        with contextlib.suppress(BrowserError, OSError):
            self.send("Browser.close", session=False, timeout=5)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._commands, self._replies):
            os.close(fd)
        self._log.close()
        shutil.rmtree(self.profile, ignore_errors=True)


def problems_in(events: list[dict]) -> list[str]:
    """Console errors, uncaught exceptions, failed loads and network requests among the events."""
    found = []
    for event in events:
        method, params = event["method"], event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in
                            params.get("args", []))
            found.append(f"console {params['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            thrown = details.get("exception", {}).get("description") or details.get("text")
            found.append(f"uncaught exception: {thrown}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            found.append(f"console error ({entry.get('source')}): {entry.get('text')} "
                         f"{entry.get('url', '')}".rstrip())
        elif method == "Network.requestWillBeSent":
            url = params.get("request", {}).get("url", "")
            if not url.startswith(("file:", "data:", "about:")):
                found.append(f"a request to the network: {url}")
        elif method == "Network.loadingFailed":
            found.append(f"a load failed: {params.get('errorText')} "
                         f"({params.get('type', 'resource')})")
    return found


def check_page(browser: Chromium, page: Path, shots: list[tuple[str, str | None]],
               shot_dir: Path) -> tuple[list[str], int]:
    """Open one page; its problems and its image count. shots: (file name, CSS selector of what
    to scroll to first, or None for the top of the page)."""
    browser.events.clear()
    browser.send("Page.navigate", {"url": page.resolve().as_uri()})
    browser.wait_for("Page.loadEventFired")
    images = browser.send("Runtime.evaluate", {"expression": IMAGES_JS,
                                               "returnByValue": True})["result"]["value"]
    problems = [f"image not loaded: {src}" for src in images["broken"]]
    for name, selector in shots:
        if selector:
            scroll = {"expression": SCROLL_JS % json.dumps(selector), "returnByValue": True}
            found = browser.send("Runtime.evaluate", scroll)["result"]["value"]
            if not found:
                problems.append(f"nothing matches {selector} for the screenshot {name}")
                continue
            time.sleep(0.2)
        shot = browser.send("Page.captureScreenshot", {"format": "png"})
        (shot_dir / name).write_bytes(base64.b64decode(shot["data"]))
    problems += problems_in(browser.events)
    return problems, images["count"]


def shrink(shot: Path, target: Path) -> Path:
    """A screenshot as a 64-colour PNG (a fifth of the size; text stays sharp). Pillow comes
    with matplotlib (requirements.txt)."""
    from PIL import Image

    with Image.open(shot) as image:
        small = image.convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT)
        target.parent.mkdir(parents=True, exist_ok=True)
        small.save(target, optimize=True)
    return target


def main(argv: list[str] | None = None) -> int:
    build = Path(os.environ.get("WORKBOOK_BUILD_DIR", REPO / "build"))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--book", type=Path, default=build / "book")
    parser.add_argument("--shots", type=Path, default=None, help="default: <book>/shots")
    parser.add_argument("--chromium", default=None, help="the browser (default: chromium on PATH)")
    parser.add_argument("--readme-shot", type=Path, default=None,
                        help="also write the last stage's picture screenshot here, shrunk to a "
                             "palette PNG (the README's picture of the book)")
    args = parser.parse_args(argv)
    book, shot_dir = args.book.resolve(), (args.shots or args.book / "shots").resolve()
    if not (book / "index.html").is_file():
        print(f"[browser] {book / 'index.html'} is missing: run make book first")
        return 1
    shot_dir.mkdir(parents=True, exist_ok=True)
    # Screenshots: the start page, then the first and the last stage (found on disk).
    found = stages.all_stages()
    shots = {"index.html": [("start.png", None)]}
    for s in (found[0], found[-1]) if found else ():
        shots[f"{s.folder}.html"] = [(f"stage-{s.number:02d}.png", None),
                                     (f"stage-{s.number:02d}-diff.png", "#the-lesson-as-a-diff"),
                                     (f"stage-{s.number:02d}-picture.png", "img.nb-picture")]
    pages = sorted(book.glob("*.html"), key=lambda p: (p.name != "index.html", p.name))
    try:
        browser = Chromium(find_chromium(args.chromium), shot_dir / "chromium.log")
    except BrowserError as error:
        print(f"[browser] {error}")
        return 2
    failed, start = {}, time.perf_counter()
    try:
        version = browser.send("Browser.getVersion", session=False)
        print(f"[browser] {version.get('product')}: {len(pages)} pages of {book}", flush=True)
        browser.open_tab()
        for page in pages:
            problems, count = check_page(browser, page, shots.get(page.name, []), shot_dir)
            print(f"[browser] {page.name:<28} {count:3d} images  "
                  f"{'ok' if not problems else 'FAILED'}", flush=True)
            for p in problems:
                print(f"    {p}")
            if problems:
                failed[page.name] = problems
    except BrowserError as error:
        print(f"[browser] {error}")
        return 1
    finally:
        browser.close()
    taken = sorted(p.name for p in shot_dir.glob("*.png"))
    print(f"[browser] screenshots in {shot_dir}: {', '.join(taken)}")
    if args.readme_shot and found:
        small = shrink(shot_dir / f"stage-{found[-1].number:02d}-picture.png", args.readme_shot)
        print(f"[browser] {small} ({small.stat().st_size // 1024} KB)")
    if failed:
        print(f"[browser] FAILED: {', '.join(failed)} ({time.perf_counter() - start:.1f} s)")
        return 1
    print(f"[browser] all {len(pages)} pages loaded without a console error, a missing image or "
          f"a network request ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
