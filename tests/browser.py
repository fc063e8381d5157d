"""A headless Chromium driven over the DevTools protocol: enough of a browser for the console's
test, without Playwright or a browser download (Debian's `chromium`, which `make test` installs).

`Chromium` starts the binary and reads the DevTools URL from its log; `Tab` is one page, attached
over the browser's one websocket (flattened sessions): navigate, evaluate, click and wait for the
next load, capture a screenshot. Every wait is bounded: a condition polled until a deadline.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from tests.eventually import eventually, eventually_async

BINARY = "/usr/bin/chromium"
LISTENING = re.compile(r"DevTools listening on (ws://\S+)")
START_S = 60.0  # a cold start on a busy 2-core machine
COMMAND_S = 30.0
LOAD_S = 30.0


def binary() -> str | None:
    """Debian's chromium, or one on the PATH; None: none here."""
    return BINARY if Path(BINARY).exists() else shutil.which("chromium")


class DevToolsError(RuntimeError):
    pass


class Connection:
    """The browser's websocket: commands answered by ID, events counted by method."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.events: dict[tuple[str | None, str], int] = {}  # (session, method) → how many
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for message in self.ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            data = json.loads(message.data)
            waiter = self._waiting.pop(data.get("id", -1), None)
            if waiter is not None and not waiter.done():
                waiter.set_result(data)
            elif "method" in data:
                key = (data.get("sessionId"), data["method"])
                self.events[key] = self.events.get(key, 0) + 1
        for waiter in self._waiting.values():  # the browser went away
            if not waiter.done():
                waiter.set_exception(DevToolsError("the DevTools connection closed"))

    async def send(self, method: str, session: str | None = None, **params: Any) -> dict[str, Any]:
        ident = next(self._ids)
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[ident] = waiter
        message: dict[str, Any] = {"id": ident, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        await self.ws.send_str(json.dumps(message))
        reply = await asyncio.wait_for(waiter, COMMAND_S)
        if "error" in reply:
            raise DevToolsError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply.get("result", {})
        return result

    async def close(self) -> None:
        await self.ws.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


class Tab:
    def __init__(self, connection: Connection, session: str) -> None:
        self.connection = connection
        self.session = session

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        return await self.connection.send(method, self.session, **params)

    def _loads(self) -> int:
        return self.connection.events.get((self.session, "Page.loadEventFired"), 0)

    async def goto(self, url: str) -> None:
        loads = self._loads()
        reply = await self.send("Page.navigate", url=url)
        if reply.get("errorText"):
            raise DevToolsError(f"{url}: {reply['errorText']}")
        await self._loaded_after(loads, url)

    async def click(self, selector: str) -> None:
        """Click the element (a form's button): the page it loads, loaded."""
        loads = self._loads()
        await self.evaluate(f"document.querySelector({json.dumps(selector)}).click()")
        await self._loaded_after(loads, selector)

    async def _loaded_after(self, loads: int, what: str) -> None:
        await eventually_async(lambda: self._loads() > loads, LOAD_S, f"a page loaded: {what}")

    async def evaluate(self, expression: str) -> Any:
        reply = await self.send(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in reply:
            raise DevToolsError(f"{expression}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    async def fill(self, selector: str, value: str) -> None:
        target = f"document.querySelector({json.dumps(selector)})"
        await self.evaluate(f"{target}.value = {json.dumps(value)}")

    async def text(self, selector: str = "body") -> str:
        return str(await self.evaluate(f"document.querySelector({json.dumps(selector)}).innerText"))

    async def screenshot(self, path: Path) -> Path:
        shot = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        await asyncio.to_thread(path.write_bytes, base64.b64decode(shot["data"]))
        return path


class Chromium:
    """The browser process: `async with Chromium(dir) as browser: tab = await browser.tab()`."""

    def __init__(self, directory: Path, executable: str = BINARY) -> None:
        self.directory = directory
        self.executable = executable
        self.log = directory / "chromium.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.connection: Connection | None = None
        self._http: aiohttp.ClientSession | None = None

    def _start(self) -> str:
        """Start it: its DevTools URL, from its log."""
        profile = self.directory / "profile"
        profile.mkdir(parents=True, exist_ok=True)
        argv = [
            self.executable,
            "--headless=new",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            "--no-sandbox",  # as root, Chromium's sandbox refuses to start
            "--disable-dev-shm-usage",  # a container's /dev/shm is small
            "--disable-gpu",
            "--no-first-run",
            "--no-default-browser-check",
            "--window-size=1280,1000",
            "about:blank",
        ]
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(argv, stdout=out, stderr=out, start_new_session=True)
        found: list[str] = []

        def listening() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise DevToolsError(f"chromium exited: {self.log.read_text(errors='replace')}")
            found[:] = LISTENING.findall(self.log.read_text(errors="replace"))
            return bool(found)

        eventually(listening, START_S, "chromium's DevTools URL in its log", every_s=0.1)
        return found[0]

    async def __aenter__(self) -> Chromium:
        url = await asyncio.to_thread(self._start)
        self._http = aiohttp.ClientSession()
        ws = await self._http.ws_connect(url, max_msg_size=0, timeout=aiohttp.ClientWSTimeout())
        self.connection = Connection(ws)
        return self

    async def tab(self) -> Tab:
        assert self.connection is not None
        target = await self.connection.send("Target.createTarget", url="about:blank")
        attached = await self.connection.send(
            "Target.attachToTarget", targetId=target["targetId"], flatten=True
        )
        tab = Tab(self.connection, attached["sessionId"])
        await tab.send("Page.enable")
        await tab.send("Runtime.enable")
        return tab

    async def __aexit__(self, *exc: object) -> None:
        if self.connection is not None:
            with contextlib.suppress(Exception):
                await self.connection.send("Browser.close")
            await self.connection.close()
        if self._http is not None:
            await self._http.close()
        if self.process is not None:
            await asyncio.to_thread(self._stop, self.process)

    @staticmethod
    def _stop(process: subprocess.Popen[bytes]) -> None:
        """Browser.close ends it; else its process group (its own: start_new_session)."""
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


@contextlib.asynccontextmanager
async def chromium(directory: Path) -> AsyncIterator[Tab]:
    """A browser with one tab, stopped at the end."""
    executable = binary()
    if executable is None:
        raise DevToolsError("no chromium binary")
    async with Chromium(directory, executable) as browser:
        yield await browser.tab()
