"""Bounded telemetry through the real stack: requests naming fresh models do not grow the
ledger's metrics page (README, Security: Bounded telemetry)."""

from __future__ import annotations

import re
import uuid

from tests.e2e.test_breaker_e2e import metrics
from tests.e2e.test_ratelimit_e2e import add_tenant, auth
from tests.eventually import eventually
from tests.http import call
from tools.stack import Stack

PER_MODEL = re.compile(r"^llmgw_ledger_(requests_total|tokens_total|ttft_seconds|duration_seconds)")


def per_model_series(page: str) -> list[str]:
    return [line for line in page.splitlines() if PER_MODEL.match(line)]


def entries(page: str) -> float:
    found = re.search(r"^llmgw_ledger_log_entries_total (\S+)$", page, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_fresh_model_names_do_not_grow_the_ledgers_metrics(stack: Stack) -> None:
    url = f"{stack.base_url}/chat/completions"
    run = uuid.uuid4().hex[:8]
    key = add_tenant(stack, f"hostile-{run}", "standard")
    page = metrics(stack, "ledger")
    before, logged = len(per_model_series(page)), entries(page)
    # Half a tenant's (answered 404 by the gateway: no pod serves the model), half nobody's (401).
    for i in range(400):
        headers = auth(key if i % 2 else f"sk-nobody-{run}")
        body = {"model": f"fresh-{run}-{i}", "messages": [{"role": "user", "content": "hi"}]}
        assert call("POST", url, body, headers).status in (401, 404, 429, 503)
    eventually(lambda: entries(metrics(stack, "ledger")) >= logged + 400, 20.0, "access log")
    page = metrics(stack, "ledger")
    assert f"fresh-{run}" not in page
    # At most two new tenants (this one, none) × two models (`other`, "": its GET /models), 4
    # outcome kinds, 4 token kinds, two histograms of 17 lines; without the bound ~38 a model.
    assert len(per_model_series(page)) - before <= 4 * (2 * 4 + 2 * 4 + 2 * 17)
