"""The tenant → vLLM priority mapping, and the README's table of it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llmgw import priority

README = Path(__file__).resolve().parents[2] / "README.md"


def test_more_important_tenants_get_lower_vllm_priorities_from_0() -> None:
    mapped = [
        priority.vllm_priority(p) for p in range(priority.TENANT_MIN, priority.TENANT_MAX + 1)
    ]
    assert mapped == sorted(mapped, reverse=True)
    assert len(set(mapped)) == len(mapped)
    assert priority.vllm_priority(priority.TENANT_MAX) == 0 == priority.NEUTRAL
    assert priority.vllm_priority(priority.TENANT_MIN) == 9


@pytest.mark.parametrize("outside", [0, 11, -1])
def test_a_priority_outside_the_tenants_range_is_refused(outside: int) -> None:
    with pytest.raises(ValueError, match="outside"):
        priority.vllm_priority(outside)


def test_the_readme_table_is_the_mapping() -> None:
    text = README.read_text()
    rows = re.findall(r"^\| tenant priority \|(.*)\|$\n^\|[-| ]+\|$\n^\| vLLM `priority` \|(.*)\|$",
                      text, re.MULTILINE)  # fmt: skip
    assert len(rows) == 1, "README.md needs one tenant → vLLM priority table"
    tenants, vllm = ([int(c) for c in row.split("|")] for row in rows[0])
    assert tenants == list(range(priority.TENANT_MAX, priority.TENANT_MIN - 1, -1))
    assert vllm == [priority.vllm_priority(p) for p in tenants]
