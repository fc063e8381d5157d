"""The layout is the architecture: imports run from the tools down to the services and from the
services down to the library, never up.

    tools/, sim/                     the `llmgw` command, the local stack, the simulated pods
       │
    extauthz/ ratelimit/ router/ ledger/ admin/   the services (the image: only these, llmgw/)
       │
    llmgw/                           the library: contracts and what every process is built on

Every import is read from the source (module level or inside a function), so an arrow that runs
up fails here before it fails in the image, which has no tools/ or sim/ to import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = "llmgw"
SERVICES = ("extauthz", "ratelimit", "router", "ledger", "admin")
TOOLS = ("tools", "sim")
# Not part of any package the image or the tools import; nothing in llmgw/ may reach them either.
OUTSIDE = ("tests", "bench", "deploy")
# The entry point of `python -m llmgw` (the `llmgw` command under its old name): a script that
# nothing imports, not the library.
ENTRY_POINTS = {"llmgw/__main__.py": {"tools"}}


def imported(path: Path) -> set[str]:
    """The top-level package of every absolute import in a module (relative ones stay inside)."""
    tops: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            tops.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
    return tops


def arrows(package: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for top in sorted(imported(path) & set(forbidden) - ENTRY_POINTS.get(rel, set())):
            found.append(f"{rel} imports {top}")
    return found


def test_the_library_imports_no_service_and_no_tool() -> None:
    assert arrows(LIBRARY, (*SERVICES, *TOOLS, *OUTSIDE)) == []


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_imports_no_tool(service: str) -> None:
    assert arrows(service, (*TOOLS, *OUTSIDE)) == []


def test_the_simulator_imports_no_service() -> None:
    """A simulated pod stands for vLLM: it knows the library's settings, not the gateway's parts."""
    assert arrows("sim", (*SERVICES, "tools", *OUTSIDE)) == []


def test_the_scan_sees_an_arrow(tmp_path: Path) -> None:
    """The scan reads imports inside functions too, and ignores relative ones."""
    module = tmp_path / "m.py"
    module.write_text("from . import x\n\ndef f():\n    from tools.stack import Stack\n")
    assert imported(module) == {"tools"}
