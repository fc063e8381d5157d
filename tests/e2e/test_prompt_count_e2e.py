"""Prompts reserved and charged through the real stack (Envoy, Redis, extauthz, the ledger,
simulated pods), read where an operator reads them: the ledger's record (`llmgw usage --json`).

With the served model's tokenizer configured (the stack's `tokenizer`: extauthz reserves by it,
the pods count by it), a dense prompt reserves exactly its count. Without it, a stream the client
leaves before its first token is charged the prompt's UTF-8 bytes, at least what any byte-level
tokenizer makes of it, not the estimate (characters / 4, a quarter of it for CJK text)."""

from __future__ import annotations

import http.client
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from extauthz.types import PerMinuteLimits
from llmgw.facts import MESSAGE_TOKENS
from tests import tiny_tokenizer
from tests.e2e.conftest import stack_settings
from tests.e2e.test_ledger_e2e import LIMITS, recorded, records
from tests.e2e.test_ratelimit_e2e import MODEL, add_tenant, auth, reservations
from tests.eventually import eventually
from tests.http import call
from tools.stack import Stack

CJK = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(4000))
EMOJI = "".join(chr(0x1F300 + i % 300) for i in range(1000))
ROOMY = PerMinuteLimits(tpm=1_000_000)


def start(tmp_path: Path, tokenizer: Path | None) -> Stack:
    (tmp_path / "limits.yaml").write_text(LIMITS)
    settings = stack_settings(pods=1).model_copy(
        update={"tiers_file": tmp_path / "limits.yaml", "tokenizer": tokenizer}
    )
    return Stack(settings, tmp_path / "stack")


@pytest.fixture
def tokenizer(tmp_path: Path) -> Path:
    return tiny_tokenizer.write(tmp_path / "tiny")


@pytest.fixture
def counted_stack(tmp_path: Path, tokenizer: Path) -> Iterator[Stack]:
    with start(tmp_path, tokenizer) as running:
        yield running


@pytest.fixture
def estimating_stack(tmp_path: Path) -> Iterator[Stack]:
    with start(tmp_path, None) as running:
        yield running


def rendered(text: str) -> str:
    """The tiny model's chat template around one user message (tools/tinymodel.py)."""
    return f"<s>user: {text}</s>\n<s>assistant: "


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}


def test_with_the_tokenizer_dense_prompts_reserve_exactly_their_count(
    counted_stack: Stack, tokenizer: Path
) -> None:
    key = add_tenant(counted_stack, "pc-counted", "standard", ROOMY)
    for text in (CJK, EMOJI):
        exact = tiny_tokenizer.tokens(tokenizer, rendered(text))
        reply = call("POST", f"{counted_stack.base_url}/chat/completions", chat(text, max_tokens=5),
                     auth(key))  # fmt: skip
        assert reply.status == 200, reply.body
        assert reply.json()["usage"]["prompt_tokens"] == exact  # the pod counts alike
        rid = reply.headers["x-request-id"]
        row = recorded(counted_stack, {rid})[rid]
        assert row["reserved_tokens"] == exact + 5  # the prompt's count and the output cap
        assert exact >= 3 * len(text)  # a token a byte here: the estimate was a quarter of that


def pods_active(stack: Stack) -> int:
    with urllib.request.urlopen(
        f"{stack.admin_url}/stats?filter=^cluster.pods.upstream_rq_active$"
    ) as r:
        text = r.read().decode()
    return sum(int(line.rsplit(":", 1)[1]) for line in text.splitlines() if line.strip())


def tenant_chats(stack: Stack, tenant: str) -> list[dict[str, Any]]:
    """The tenant's chat requests in the ledger (add_tenant's probes list the models)."""
    return [
        r
        for r in records(stack)
        if r["tenant"] == tenant and r["endpoint"].endswith("/chat/completions")
    ]


def test_without_it_a_stream_left_before_its_first_token_is_charged_its_utf8_bytes(
    estimating_stack: Stack, tokenizer: Path
) -> None:
    stack = estimating_stack
    key = add_tenant(stack, "pc-estimated", "standard", ROOMY)
    assert call("PUT", f"{stack.pod_url(0)}/admin/faults", {"hang": True}).status == 200
    url = urlsplit(stack.base_url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=30)
    body = json.dumps(chat(CJK, max_tokens=5, stream=True))
    conn.request("POST", f"{url.path}/chat/completions", body,
                 {**auth(key), "content-type": "application/json"})  # fmt: skip
    # Admitted, and at the pod (which says nothing yet): the client hangs up.
    eventually(lambda: reservations(stack, "pc-estimated"), 20.0, "the request admitted")
    eventually(lambda: pods_active(stack) > 0, 20.0, "the request at the pod")
    conn.sock.close()  # type: ignore[union-attr]
    conn.close()
    eventually(lambda: tenant_chats(stack, "pc-estimated"), 30.0, "the outcome recorded")
    rows = tenant_chats(stack, "pc-estimated")
    assert len(rows) == 1, rows
    (row,) = rows
    assert (row["outcome"], row["stream"], row["completion_tokens"]) == ("aborted", True, 0)
    utf8 = len(CJK.encode()) + len("user") + 2 * MESSAGE_TOKENS
    assert row["prompt_tokens"] == utf8
    assert row["prompt_tokens"] >= tiny_tokenizer.tokens(tokenizer, rendered(CJK))
    assert row["reserved_tokens"] < row["charged_tokens"] == row["prompt_tokens"]
