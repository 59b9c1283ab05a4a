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
        "listen: {port: 70000}\nlog_level: LOUD\nengines:\n  a: {kind: tgi, url: 'ftp://x'}\n"
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


ENGINE = "engines:\n  a: {kind: vllm, url: 'http://h:1', abort: {api_key: '${KEY}'}}\n"
ROUTES = "routes: [{prefix: /, engine: a}]\n"


# Values YAML happily produces and the runtime cannot use: each must be a located problem.
@pytest.mark.parametrize(("location", "line"), [
    ("upstream.first_byte_timeout_s", "upstream: {first_byte_timeout_s: .nan}"),
    ("upstream.connect_timeout_s", "upstream: {connect_timeout_s: .inf}"),
    ("upstream.read_timeout_s", "upstream: {read_timeout_s: -.inf}"),
    ("upstream.keepalive_timeout_s", "upstream: {keepalive_timeout_s: 1.0e+300}"),
    ("upstream.first_byte_timeout_s", "upstream: {first_byte_timeout_s: true}"),
    ("upstream.max_connections", "upstream: {max_connections: 100000000000000000000}"),
    ("downstream.idle_timeout_s", "downstream: {idle_timeout_s: .nan}"),
    ("downstream.body_timeout_s", "downstream: {body_timeout_s: .inf}"),
    ("downstream.write_buffer_bytes", "downstream: {write_buffer_bytes: 100000000000000000000}"),
    ("downstream.max_body_bytes", "downstream: {max_body_bytes: false}"),
    ("engines.a.abort.timeout_s",
     "engines:\n  a: {kind: vllm, url: 'http://h:1', abort: {timeout_s: .nan}}"),
    ("engines.a.abort.retries",
     "engines:\n  a: {kind: vllm, url: 'http://h:1', abort: {retries: true}}"),
    ("lifecycle.grace_period_s", "lifecycle: {grace_period_s: .inf}"),
    ("engines.a.abort.path",
     "engines:\n  a: {kind: vllm, url: 'http://h:1', abort: {path: \"/abort\\nx\"}}"),
    ("listen.port", "listen: {port: true}"),
])
def test_nan_infinite_huge_and_boolean_numbers_are_refused(location: str, line: str) -> None:
    engines = "" if line.startswith("engines") else ENGINE
    message = problems_of(f"{line}\n{engines}{ROUTES}", env={"KEY": "k"})
    assert f"  - {location}:" in message, f"expected a problem at {location} in:\n{message}"


def test_api_key_surrounding_whitespace_is_dropped() -> None:
    """A key read from a file or a Kubernetes Secret usually ends with a newline."""
    settings = parse_config(ENGINE + ROUTES, "<test>", env={"KEY": f"  {SECRET}\n"})
    key = settings.engines["a"].abort.api_key
    assert key is not None and key.get_secret_value() == SECRET, "expected the key stripped"
    blank = parse_config(ENGINE + ROUTES, "<test>", env={"KEY": " \n"})
    assert blank.engines["a"].abort.api_key is None, "a blank key means no key"


def test_api_key_with_an_inner_control_character_is_refused_without_echo() -> None:
    message = problems_of(ENGINE + ROUTES, env={"KEY": "sk-very\nsecret"})
    assert "  - engines.a.abort.api_key:" in message and "control characters" in message, message
    assert "secret" not in message.replace("problem", ""), f"the key leaked:\n{message}"
