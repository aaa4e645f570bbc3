"""The image recipe fits the project and the chart: it copies every package pyproject installs (and
nothing .dockerignore drops), keeps the base image's torch, and is the Ray version the chart declares.
No image is built here (no container daemon in the test environment)."""

from __future__ import annotations

import re
import tomllib
from fnmatch import fnmatch

import yaml
from chart_support import CHART, ROOT

DOCKERFILE = (ROOT / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
IGNORED = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
           if line.strip() and not line.startswith("#")]


def _arg(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE, re.MULTILINE)
    assert match, f"Dockerfile has no ARG {name}=..."
    return match.group(1)


def _copied() -> list[str]:
    sources: list[str] = []
    for line in re.findall(r"^COPY (.+)$", DOCKERFILE, re.MULTILINE):
        parts = [p for p in line.split() if not p.startswith("--")]
        sources += parts[:-1]
    return sources


def test_copies_every_installed_package_and_the_files_pip_needs() -> None:
    copied = {s.rstrip("/") for s in _copied()}
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= copied, f"packages pip installs but the image lacks: {packages - copied}"
    assert {"pyproject.toml", PYPROJECT["project"]["readme"]} <= copied
    for source in copied:
        assert (ROOT / source).exists(), f"COPY {source}: no such path"
        assert not any(fnmatch(source, pattern) for pattern in IGNORED), f"COPY {source} is in .dockerignore"


def test_build_context_leaves_out_local_state() -> None:
    for heavy in (".venv", ".git", "tests", "benchmarks"):
        assert heavy in IGNORED


def test_torch_comes_from_the_base_image() -> None:
    assert not re.search(r"pip install[^\n]*\btorch\b", DOCKERFILE), "torch must not be installed again"
    install = re.search(r"pip install ([^\n]*) \.", DOCKERFILE)
    assert install and "--constraint /tmp/base-constraints.txt" in install.group(1)
    run = DOCKERFILE[DOCKERFILE.index("\nRUN "):]
    assert run.index("import torch") < run.index("pip install"), "the constraints pin the base image's torch"


def test_image_matches_the_chart() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert _arg("RAY_VERSION") == values["rayVersion"]
    assert chart["appVersion"] == PYPROJECT["project"]["version"], "the default image tag is the package version"
    base = _arg("BASE_IMAGE")
    assert "${RAY_VERSION}" in base
    python_tag = re.search(r"-py3(\d+)", base)
    assert python_tag, base
    minimum = PYPROJECT["project"]["requires-python"].removeprefix(">=3.")
    assert int(python_tag.group(1)) >= int(minimum)
