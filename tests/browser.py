"""A headless Chromium driven over the DevTools protocol (aiohttp's websocket client), for page tests.

Chromium runs in its own session and is killed with all its processes on `close`. Each call
opens a short DevTools connection to the page: load a URL, evaluate JavaScript, take a screenshot.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import aiohttp

from peer.process.lifetime import tied_to_me


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    def __init__(self, workdir: Path, width: int = 1400, height: int = 1100, timeout: float = 30.0):
        binary = find_chromium()
        if binary is None:
            raise RuntimeError("no Chromium found (Debian: apt-get install chromium)")
        profile = workdir / "chromium-profile"
        profile.mkdir(parents=True, exist_ok=True)
        self.log = open(workdir / "chromium.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            tied_to_me(  # a killed test run takes its browser along
                [
                    binary,
                    "--headless",
                    "--no-sandbox",  # tests run as root in a container
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                    "--no-first-run",
                    "--remote-debugging-port=0",
                    "--remote-debugging-address=127.0.0.1",
                    f"--user-data-dir={profile}",
                    f"--window-size={width},{height}",
                    "about:blank",
                ],
                signal.SIGTERM,
            ),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"Chromium did not start: {(workdir / 'chromium.log').read_text()[-2000:]}")
            time.sleep(0.1)
        self.port = int(port_file.read_text().split()[0])
        self.timeout = timeout
        self._ids = itertools.count(1)

    def _page_ws(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/list", timeout=self.timeout) as r:
            targets = json.loads(r.read())
        return next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")

    async def _session(self, calls: list[tuple[str, dict]]) -> list[dict]:
        results = []
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(
                self._page_ws(), max_msg_size=0, timeout=aiohttp.ClientWSTimeout(ws_close=self.timeout)
            ) as ws,
        ):
            for method, params in calls:
                call_id = next(self._ids)
                await ws.send_str(json.dumps({"id": call_id, "method": method, "params": params}))
                while True:
                    frame = await asyncio.wait_for(ws.receive(), self.timeout)
                    if frame.type != aiohttp.WSMsgType.TEXT:
                        raise RuntimeError(f"{method}: the DevTools connection ended ({frame.type.name})")
                    message = json.loads(frame.data)
                    if message.get("id") == call_id:
                        break
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                results.append(message["result"])
        return results

    def call(self, method: str, **params) -> dict:
        return asyncio.run(self._session([(method, params)]))[0]

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_until(self, expression: str, timeout: float, what: str = ""):
        """Evaluate `expression` until it is truthy; its value."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(Exception):  # a page still loading, a DevTools hiccup: look again
                value = self.evaluate(expression)
                if value:
                    return value
            if time.monotonic() > deadline:
                text = self.evaluate("document.body ? document.body.innerText : ''")
                raise AssertionError(f"page: no {what or expression} within {timeout} s; it shows:\n{text[:3000]}")
            time.sleep(0.5)

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        # the whole group, even when the main process has exited already: its helpers may not have
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self.log.close()
