"""The services' image, checked without a Docker engine: the Dockerfile's shape, the
requirements its build stage installs, and the package it installs (a real wheel build)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from deploy.image_requirements import LOCAL_STACK_ONLY, name, requirements

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("extauthz", "ratelimit", "router", "ledger", "admin")


def stages() -> list[list[str]]:
    """The Dockerfile's instructions (continuation lines joined), one list per stage."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("FROM "):
            out.append([])
        if out:
            out[-1].append(line)
    return out


def test_the_image_is_multi_stage_slim_non_root_with_a_grpc_health_check() -> None:
    build, final = stages()[0], stages()[-1]
    assert len(stages()) >= 2
    arg = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG PYTHON=python:3\.\d+-slim$", arg, re.M)
    assert final[0] == "FROM ${PYTHON}"
    assert any(i.startswith("COPY --from=") for i in final)
    # Nothing is built or installed in the final stage: no compiler, no pip install there.
    assert not [i for i in final if re.search(r"pip install|apt-get|gcc|build-essential", i)]
    assert any(i.startswith("RUN pip install") for i in build)
    user = next(i for i in final if i.startswith("USER "))
    assert user.split()[1].split(":")[0] not in ("0", "root")
    assert next(i for i in final if i.startswith("ENTRYPOINT")) == 'ENTRYPOINT ["python", "-m"]'
    health = next(i for i in final if i.startswith("HEALTHCHECK"))
    assert health.endswith('CMD ["python", "-m", "llmgw.health"]')


def test_the_image_leaves_out_only_the_local_stack_binaries() -> None:
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    # Each name left out still exists (a rename would silently put it back in the image).
    assert set(LOCAL_STACK_ONLY) <= {name(d) for d in deps}
    assert {name(d) for d in requirements(ROOT / "pyproject.toml")} == {
        name(d) for d in deps
    } - set(LOCAL_STACK_ONLY)


def test_the_installed_package_has_every_service_and_its_data_files(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for item in ("pyproject.toml", "README.md", "llmgw", *SERVICES, "tools"):
        copy = shutil.copytree if (ROOT / item).is_dir() else shutil.copy
        copy(ROOT / item, src / item)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(src), "-w", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=240,
    )
    wheel = next(tmp_path.glob("llmgw-*.whl"))
    files = set(zipfile.ZipFile(wheel).namelist())
    for service in SERVICES:
        assert f"{service}/__main__.py" in files
    assert "llmgw/health.py" in files
    assert "tools/cli.py" in files  # the `llmgw` console script's module
    for data in (ROOT).glob("*/**/*"):
        if data.suffix in (".lua", ".sql", ".j2") and data.parts[len(ROOT.parts)] in SERVICES:
            assert str(data.relative_to(ROOT)) in files, data
