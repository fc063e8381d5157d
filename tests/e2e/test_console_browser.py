"""The console in a real browser (headless Chromium over the DevTools protocol, tests/browser.py)
against `llmgw up`'s stack with its admin API: log in with the ready file's token, make a tenant
and a key in the forms, use the key through Envoy with the OpenAI SDK, find the requests on the
tenant's usage page and in their session's timeline, revoke the key and see the SDK refused.
Screenshots of each step are saved in the test's directory (their paths printed)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.browser import Tab, binary, chromium
from tests.e2e.conftest import stack_settings
from tests.eventually import eventually_awaited
from tools.launcher import banner
from tools.stack import Stack

pytestmark = pytest.mark.skipif(
    binary() is None,
    reason="no chromium binary (/usr/bin/chromium): `make test` installs Debian's chromium when"
    " run as root with apt-get; elsewhere `apt-get install chromium`",
)
TENANT = "browser-co"
REQUESTS = 3
# The screenshots, kept after the run (make test removes its temporary directory).
ARTIFACTS = Path(__file__).resolve().parents[2] / ".artifacts" / "console"
WITHIN_S = 30.0  # the ledger's batch and extauthz's follower on a busy machine: a bound, not a pace


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = stack_settings().model_copy(update={"admin": True})
    with Stack(settings, tmp_path_factory.mktemp("console-stack")) as running:
        yield running


class Shots:
    """Screenshots, numbered in the order taken, in `directory`."""

    def __init__(self, tab: Tab, directory: Path) -> None:
        self.tab = tab
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.paths: list[Path] = []

    async def take(self, name: str) -> None:
        path = await self.tab.screenshot(self.directory / f"{len(self.paths) + 1:02d}-{name}.png")
        print(f"screenshot: {path}")
        self.paths.append(path)


async def test_an_operator_uses_the_console_in_a_browser(stack: Stack, tmp_path: Path) -> None:
    info = stack.ready_info()
    console, token = info["console_url"], info["admin_token"]
    assert console == f"{info['admin_url']}/console/" and console in banner(info)
    async with chromium(tmp_path / "chromium") as tab:
        shots = Shots(tab, ARTIFACTS)
        await tab.goto(console)
        await tab.fill("input[name=token]", token)
        await shots.take("login")
        await tab.click("#login")
        assert await tab.evaluate("location.pathname") == "/console/tenants"
        assert await tab.evaluate("document.cookie") == ""  # HttpOnly: no script reads it

        await tab.fill("#create-tenant input[name=id]", TENANT)
        await tab.fill("#create-tenant input[name=name]", "Browser <Co>")
        await shots.take("tenants")
        await tab.click("#create-tenant button")
        assert await tab.evaluate("location.pathname") == f"/console/tenants/{TENANT}"
        await tab.click("#create-key button")
        key = await tab.text("#secret")
        assert key.startswith("sk-")
        await shots.take("key-made")

        client = openai.AsyncOpenAI(base_url=stack.base_url, api_key=key, max_retries=0)
        model = stack.serving[0].model
        messages: list[openai.types.chat.ChatCompletionMessageParam] = [
            {"role": "user", "content": "hello"}
        ]

        async def works() -> bool:  # extauthz follows the database: soon, not at once
            try:
                await client.models.list()  # the tenant's first request, once the key works
            except openai.AuthenticationError:
                return False
            return True

        await eventually_awaited(works, WITHIN_S, "the key made in the console works", 0.2)
        first = await client.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=8
        )
        session = first.headers["x-session-id"]
        same = client.with_options(default_headers={"x-session-id": session})
        for _ in range(REQUESTS - 1):  # streamed: their decode is apart from their TTFT
            stream = await same.chat.completions.create(
                model=model, messages=messages, max_tokens=8, stream=True
            )
            async for _chunk in stream:
                pass

        usage = f"{console}tenants/{TENANT}/usage"

        async def listed() -> bool:  # the ledger writes in batches: reloaded until there
            await tab.goto(usage)
            links = await tab.evaluate(
                "[...document.querySelectorAll('a.session')].map(a => a.textContent)"
            )
            sessions = await tab.text("#sessions")
            counted = re.search(rf"{re.escape(session)}\t.*\t{REQUESTS}\t", sessions)
            day = re.search(rf"\d{{4}}-\d\d-\d\d\t{REQUESTS + 1}\t", await tab.text("#days"))
            return session in links and counted is not None and day is not None

        await eventually_awaited(listed, WITHIN_S, f"{session}: {REQUESTS} requests listed", 0.5)
        assert await tab.evaluate("document.querySelectorAll('svg rect.requests').length") == 30
        await shots.take("usage")

        await tab.click("a.session")
        assert await tab.evaluate("location.pathname") == f"/console/sessions/{session}"
        rows = await tab.evaluate(
            "[...document.querySelectorAll('#requests tr.request')]"
            ".map(r => [...r.cells].map(c => c.textContent.trim()))"
        )
        assert [r[0] for r in rows] == [str(i) for i in range(1, REQUESTS + 1)]
        assert all(r[7] == "ok" and r[5] != "—" for r in rows), rows  # each with its pod
        assert all(float(r[9]) > 0 for r in rows), rows  # its TTFT
        assert all(float(r[10]) > 0 for r in rows[1:]), rows  # a streamed one's decode
        stages = await tab.evaluate(
            "[...new Set([...document.querySelectorAll('svg rect')].map(r => r.classList[0]))]"
        )
        assert {"prefill", "decode"} <= set(stages), stages
        await shots.take("session")

        await tab.goto(f"{console}tenants/{TENANT}")
        await tab.click("button.revoke")
        assert "revoked" in await tab.text("#keys")
        await shots.take("revoked")

        async def refused() -> bool:
            try:
                await client.chat.completions.create(model=model, messages=messages, max_tokens=2)
            except openai.AuthenticationError:
                return True
            return False

        await eventually_awaited(refused, WITHIN_S, "the revoked key refused with 401", 0.2)
        await client.close()

        await tab.goto(f"{console}tiers")
        await shots.take("tiers")
        await tab.goto(f"{console}events")
        await shots.take("events")
    assert all(p.stat().st_size > 1000 for p in shots.paths)
