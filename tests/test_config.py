"""Config validation: every problem located, secrets never echoed, start-up failures explained."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.config import parse_config
from sidecar.errors import ConfigError

SECRET = "sk-very-secret-value"


def problems_of(text: str, env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(text, "<test>", env=env or {})
    return str(info.value)


@pytest.mark.parametrize("text", [
    # an error on the whole engine renders the engine's mapping
    "engines:\n  local:\n    abort: {api_key: '${KEY}'}\n    kind: vllm\n    url: http://h/v1\n"
    "routes: [{prefix: /, engine: local}]\n",
    # a misspelled key under abort
    f"engines:\n  local: {{kind: vllm, url: 'http://h:1', abort: {{apikey: {SECRET}}}}}\n"
    "routes: [{prefix: /, engine: local}]\n",
    # a wrong type for the key
    f"engines:\n  local: {{kind: vllm, url: 'http://h:1', abort: {{api_key: [{SECRET}]}}}}\n"
    "routes: [{prefix: /, engine: local}]\n",
    # a YAML syntax error on the key's line
    f"engines:\n  local: {{kind: vllm, url: 'http://h:1', abort: {{api_key: {SECRET}: x}}}}\n"
    "routes: [{prefix: /, engine: local}]\n",
])
def test_secrets_never_appear_in_config_errors(text: str) -> None:
    message = problems_of(text, env={"KEY": SECRET})
    assert SECRET not in message, f"expected the key masked, got:\n{message}"
    assert "problem" in message, message


def test_every_problem_is_located() -> None:
    message = problems_of(
        "listen: {port: 70000}\nlog_level: LOUD\nengines:\n  a: {kind: sglang, url: 'ftp://x'}\n"
        "routes:\n  - {prefix: v1, engine: b}\n")
    for location in ("listen.port", "log_level", "engines.a.kind", "engines.a.url",
                     "routes.0.prefix", "routes.0.engine"):
        assert f"  - {location}:" in message, f"expected a problem at {location} in:\n{message}"


def test_log_level_is_case_insensitive() -> None:
    settings = parse_config("log_level: debug\nengines:\n  a: {kind: vllm, url: 'http://h:1'}\n"
                            "routes: [{prefix: /, engine: a}]\n", "<test>", env={})
    assert settings.log_level == "DEBUG", settings.log_level


def test_listen_on_the_default_admin_port_is_a_config_error() -> None:
    message = problems_of("listen: {port: 9090}\nengines:\n  a: {kind: vllm, url: 'http://h:1'}\n"
                          "routes: [{prefix: /, engine: a}]\n")
    assert "admin.port" in message, f"expected the clash with the default admin port, got {message}"


def test_unusable_listen_address_exits_1_with_a_message(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("listen: {host: 'no such host!', port: 0}\nadmin: null\n"
                      "engines:\n  a: {kind: vllm, url: 'http://127.0.0.1:1'}\n"
                      "routes: [{prefix: /, engine: a}]\n")
    result = subprocess.run([sys.executable, "-m", "sidecar", "--config", str(config)],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1, (
        f"expected exit 1, got {result.returncode}; stderr:\n{result.stderr}")
    assert "cannot listen" in result.stderr and "Traceback" not in result.stderr, result.stderr
