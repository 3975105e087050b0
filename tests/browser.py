"""A headless Chromium driven through the DevTools protocol over a pipe, for the viewer tests.

`--remote-debugging-pipe` gives the protocol on file descriptors 3 (commands in) and 4
(replies and events out), as NUL-terminated JSON: no driver, no websocket package and no
second port. One Browser per test module; each page is a tab of it.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any, Optional

# The flags CI's machines need (no sandbox as root, no network beyond loopback, no GPU) and
# software WebGL, which Model Explorer draws its graph with.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-unsafe-swiftshader", "--use-angle=swiftshader", "--hide-scrollbars",
         "--remote-debugging-pipe")


def chromium() -> Optional[str]:
    """The Chromium binary on PATH (Debian's package installs `chromium`), or None."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def _as_fds_3_and_4(read_end: int, write_end: int) -> None:
    # Out of the way first: either end may itself be descriptor 3 or 4. (pass_fds=(3, 4)
    # keeps the result open: the other descriptors are closed after this runs.)
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (read_end, write_end)]
    os.dup2(high[0], 3)
    os.dup2(high[1], 4)


class Browser:
    """A headless Chromium with a fresh profile; `close()` ends it and deletes the profile."""

    def __init__(self, binary: str, size: tuple[int, int] = (1400, 900)):
        self.profile = tempfile.mkdtemp(prefix="fxamp-chromium-")
        to_chrome, self._out = os.pipe()
        self._in, from_chrome = os.pipe()
        args = [binary, *FLAGS, f"--user-data-dir={self.profile}",
                f"--window-size={size[0]},{size[1]}", "about:blank"]
        self.process = subprocess.Popen(
            args, pass_fds=(3, 4), stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, preexec_fn=lambda: _as_fds_3_and_4(to_chrome, from_chrome))
        os.close(to_chrome)
        os.close(from_chrome)
        self._buffer, self._id = b"", 0

    def _read(self) -> dict:
        while b"\0" not in self._buffer:
            chunk = os.read(self._in, 1 << 16)
            if not chunk:
                raise EOFError("Chromium closed the DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, session: Optional[str] = None, **params: Any) -> dict:
        """Send one DevTools command and return its result (events are dropped)."""
        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def open(self, url: str) -> "Page":
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        page = Page(self, session)
        self.send("Page.navigate", session, url=url)
        return page

    def close(self) -> None:
        try:
            self.process.kill()
            self.process.wait(timeout=10)
        finally:
            os.close(self._in)
            os.close(self._out)
            shutil.rmtree(self.profile, ignore_errors=True)


class Page:
    def __init__(self, browser: Browser, session: str):
        self.browser, self.session = browser, session

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited if a promise)."""
        result = self.browser.send("Runtime.evaluate", self.session, expression=expression,
                                   returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def text(self) -> str:
        """The page's visible text ('' before it has a body)."""
        return self.evaluate("document.body ? document.body.innerText : ''")

    def wait_for(self, expression: str, timeout: float = 60.0) -> Any:
        """Poll a JavaScript expression until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout:g} s for {expression}")
            time.sleep(0.25)

    def screenshot(self, path: Optional[str] = None) -> bytes:
        """The page as PNG bytes (also written to `path`)."""
        data = base64.b64decode(
            self.browser.send("Page.captureScreenshot", self.session, format="png")["data"])
        if path is not None:
            with open(path, "wb") as f:
                f.write(data)
        return data

    def count_colours(self, png: bytes, colours: list[str]) -> dict[str, int]:
        """How many pixels of a PNG (a screenshot) have exactly each colour ("#rrggbb"),
        counted by the page's own canvas."""
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        return self.evaluate(f"""(async () => {{
            const image = new Image(); image.src = {json.dumps(url)}; await image.decode();
            const canvas = new OffscreenCanvas(image.width, image.height);
            const context = canvas.getContext('2d'); context.drawImage(image, 0, 0);
            const pixels = context.getImageData(0, 0, image.width, image.height).data;
            const counts = {{}};
            for (const c of {json.dumps(colours)}) {{
                const [r, g, b] = [1, 3, 5].map(i => parseInt(c.slice(i, i + 2), 16));
                let n = 0;
                for (let i = 0; i < pixels.length; i += 4)
                    if (pixels[i] == r && pixels[i + 1] == g && pixels[i + 2] == b) n++;
                counts[c] = n;
            }}
            return counts; }})()""")

    def close(self) -> None:
        self.browser.send("Target.closeTarget", targetId=self.browser.send(
            "Target.getTargetInfo", self.session)["targetInfo"]["targetId"])

