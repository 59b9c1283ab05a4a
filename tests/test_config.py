"""Config validation: every problem located, secrets never echoed, start-up failures explained."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine import ADAPTERS
from sidecar.config import parse_config
from sidecar.errors import ConfigError
from sidecar.runtime import describe_changes, pinned_for_workers, with_pinned
from tests.harness.cli_process import cli_process, config_tree

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


def test_an_unset_variable_is_one_problem_where_it_is_used() -> None:
    """``${VAR}`` unset expands to "": the url's own check ("input is empty") would name the
    same mistake a second time."""
    message = problems_of("engines:\n  a: {kind: vllm, url: '${ENGINE_URL}'}\n"
                          "listen: {port: 70000}\nroutes: [{prefix: /, engine: a}]\n")
    assert message.count("  - ") == 2, f"expected two problems, got:\n{message}"
    assert "  - engines.a.url: line 2: environment variable ENGINE_URL is not set" in message, (
        message)
    assert "  - listen.port: line 3:" in message, (
        f"expected the other problem still named:\n{message}")


@pytest.mark.parametrize(("text", "location"), [
    ("admin: {cancel_token: '${CANCEL_SIDECAR_CANCEL_TOKEN}'}\n"
     "engines:\n  a: {kind: vllm, url: 'http://h:1'}\nroutes: [{prefix: /, engine: a}]\n",
     "admin.cancel_token"),
    ("engines:\n  a: {kind: vllm, url: 'http://h:1', abort: {api_key: '${VLLM_API_KEY}'}}\n"
     "routes: [{prefix: /, engine: a}]\n", "engines.a.abort.api_key"),
], ids=["cancel_token", "api_key"])
def test_an_unset_secret_variable_is_never_told_to_take_a_default(
        text: str, location: str) -> None:
    """``${VAR:-default}`` is the fix for an ordinary setting; for a secret it would invite the
    secret written into the file."""
    message = problems_of(text)
    assert re.search(rf"  - {re.escape(location)}: line \d: environment variable", message), (
        message)
    assert ":-" not in message and "in the sidecar's environment" in message, (
        f"expected the fix to be the environment, not a default in the file, got:\n{message}")


@pytest.mark.parametrize(("text", "problems"), [
    # a misspelled key whose value is an unset variable: both
    ("engines:\n  a: {kind: vllm, url: 'http://h:1', ulr: '${NOPE}'}\n", 2),
    # an unset variable inside a value that is wrong anyway: both
    ("engines:\n  a: {kind: vllm, url: 'ftp://${HOST}:8000'}\n", 2),
    # a duplicate key and a range error at the same place: both
    ("listen: {port: 80, port: 70000}\nengines:\n  a: {kind: vllm, url: 'http://h:1'}\n", 2),
])
def test_an_unset_variable_never_hides_another_problem(text: str, problems: int) -> None:
    message = problems_of(text + "routes: [{prefix: /, engine: a}]\n")
    assert message.count("  - ") == problems, f"expected {problems} problems, got:\n{message}"


def test_a_routes_abort_list_names_engines_readably() -> None:
    """A route's ``abort`` list holds engine names, not secrets: a typo there is shown, and so
    are the engines defined (an engine's own ``abort`` mapping stays masked)."""
    message = problems_of(
        "engines:\n  router: {kind: openai, url: 'http://h:1'}\n"
        "  prefill: {kind: vllm, url: 'http://h:2', abort: {api_key: '${KEY}'}}\n"
        "routes:\n  - {prefix: /, engine: router, abort: [prefill, prefil]}\n"
        "  - {prefix: /v1, engine: rooter}\n", env={"KEY": SECRET})
    assert "(defined: prefill, router) (got 'prefil')" in message, message
    assert "(got 'rooter')" in message and SECRET not in message, message


def test_an_unset_variable_naming_an_engine_is_one_problem() -> None:
    message = problems_of("engines:\n  a: {kind: vllm, url: 'http://h:1'}\n"
                          "routes: [{prefix: /, engine: '${UNSET_E}'}]\n")
    assert message.count("  - ") == 1, f"expected one problem, got:\n{message}"
    assert "routes.0.engine: line 3: environment variable UNSET_E is not set" in message, message


def test_a_short_secret_is_masked_only_as_a_word() -> None:
    """``api_key: ${A:-def}``: the hint ``${PORT:-default}`` keeps its word whole (it neither
    shows ``***ault`` nor gives away where the key sits in it); the key itself never shows."""
    message = problems_of("engines:\n  a: {kind: vllm, url: 'http://h:1', "
                          "abort: {api_key: '${A:-def}'}}\nlisten: {port: '${PORT}'}\n"
                          "routes: [{prefix: /, engine: a}]\n")
    assert "${PORT:-default}" in message and "***ault" not in message, message


def test_log_level_is_case_insensitive() -> None:
    settings = parse_config("log_level: debug\nengines:\n  a: {kind: vllm, url: 'http://h:1'}\n"
                            "routes: [{prefix: /, engine: a}]\n", "<test>", env={})
    assert settings.log_level == "DEBUG", settings.log_level


def test_listen_on_the_default_admin_port_is_a_config_error() -> None:
    message = problems_of("listen: {port: 9090}\nengines:\n  a: {kind: vllm, url: 'http://h:1'}\n"
                          "routes: [{prefix: /, engine: a}]\n")
    assert "admin.port" in message, f"expected the clash with the default admin port, got {message}"


@pytest.mark.parametrize("other", [
    ("engines.a.url", "engines:\n  a: {kind: vllm, url: 'http://h:1/v1'}\n"),
    ("log_level", "log_level: LOUD\nengines:\n  a: {kind: vllm, url: 'http://h:1'}\n"),
], ids=["url-with-a-path", "bad-log-level"])
def test_the_port_clash_is_reported_with_the_other_problems(other: tuple[str, str]) -> None:
    """Before: a problem the model found elsewhere hid the clash (one fix, one more run)."""
    location, text = other
    message = problems_of("listen: {port: 9090}\n" + text + "routes: [{prefix: /, engine: a}]\n")
    assert f"  - {location}:" in message, f"expected the problem at {location}, got {message}"
    assert "  - admin.port:" in message, f"expected the port clash too, got {message}"


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


@pytest.mark.parametrize("section", ["listen", "admin"])
def test_an_empty_listen_host_is_refused(section: str) -> None:
    """aiohttp reads "" as every address: an unset ${HOST:-} opened the proxy to the network
    (found by a new-user test; only the admin listener warned)."""
    message = problems_of(f"{section}: {{host: '${{HOST:-}}'}}\n" + ENGINE + ROUTES,
                          env={"KEY": "k"})
    assert f"  - {section}.host:" in message and "must not be empty" in message, message


@pytest.mark.parametrize("workers", ["1", "2"])
def test_admin_port_in_use_exits_1_with_a_message(tmp_path: Path, workers: str) -> None:
    """Before, with --workers 2: a traceback from the supervisor's admin listener."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "c.yaml"
        config.write_text(f"listen: {{host: 127.0.0.1, port: 0}}\n"
                          f"admin: {{host: 127.0.0.1, port: {port}}}\n"
                          "engines:\n  a: {kind: vllm, url: 'http://127.0.0.1:1'}\n"
                          "routes: [{prefix: /, engine: a}]\n")
        result = subprocess.run([sys.executable, "-m", "sidecar", "--config", str(config),
                                 "--workers", workers],
                                capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1, (
        f"expected exit 1, got {result.returncode}; stderr:\n{result.stderr}")
    assert "Traceback" not in result.stderr and str(port) in result.stderr, result.stderr
    assert "cannot listen" in result.stderr or "cannot bind the admin address" in result.stderr, (
        result.stderr)


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


@pytest.mark.parametrize("key", ["\u043a\u043b\u044e\u0447-secret", "k\u00e9y-secret"],
                         ids=["cyrillic", "latin-1"])
def test_api_key_outside_ascii_is_refused_without_echo(key: str) -> None:
    """Before: accepted, then every abort call failed (UnicodeEncodeError on the abort wire) or
    sent other bytes than the readiness probe (latin-1 against UTF-8), while /readyz said ok."""
    message = problems_of(ENGINE + ROUTES, env={"KEY": key})
    assert "  - engines.a.abort.api_key:" in message and "must be ASCII" in message, message
    assert "secret" not in message.replace("problem", ""), f"the key leaked:\n{message}"
    message = problems_of(TOKEN_CONFIG, env={"KEY": "k", "T": key})
    assert "  - admin.cancel_token:" in message and "must be ASCII" in message, message


# --- engine urls with credentials -----------------------------------------------------------

URL_PASSWORD = "sk-URLPASS"


@pytest.mark.parametrize("url", [
    f"http://user:{URL_PASSWORD}@127.0.0.1:18000",
    f"https://user:{URL_PASSWORD}@engine.example:443/",
    f"http://:{URL_PASSWORD}@127.0.0.1:18000",
    "http://just-a-user@127.0.0.1:18000",
    f"http://user:p@{URL_PASSWORD}@127.0.0.1:18000",  # an unencoded @ in the password
    f"http://user:{URL_PASSWORD}@127.0.0.1:18000/v1",  # also a path: still no echo
])
def test_engine_url_with_credentials_is_refused_without_echo(url: str) -> None:
    """aiohttp turns URL credentials into Basic auth on every proxied request and refuses them
    next to the abort call's own Authorization: an engine never aborted, and the password in the
    logs and in /readyz. Refused at config time, pointing at abort.api_key."""
    message = problems_of(f"engines:\n  a: {{kind: vllm, url: '{url}'}}\n{ROUTES}")
    assert "  - engines.a.url:" in message and "abort.api_key" in message, (
        f"expected a problem at engines.a.url naming abort.api_key, got:\n{message}")
    assert URL_PASSWORD not in message, f"the URL password leaked:\n{message}"


def test_an_engine_urls_problems_are_named_next_to_the_configs_others() -> None:
    """A bad config names every problem: the url's path and port 0 too when another key of the
    engine is wrong (a model check was skipped once a field had a problem: only the unknown key
    was named)."""
    message = problems_of("engines:\n  a: {kind: vllm, url: 'http://h:1/v1', bogus: 1}\n"
                          f"  b: {{kind: vllm, url: 'http://h:0'}}\n{ROUTES}")
    for where, what in (("engines.a.url:", "must be an origin"), ("engines.a.bogus:", "unknown"),
                        ("engines.b.url:", "port 0")):
        assert any(where in line and what in line for line in message.splitlines()), (
            f"expected {where} ... {what} among the problems, got:\n{message}")


@pytest.mark.parametrize("text", [
    # the whole engines value rendered (a list where a mapping belongs)
    f"engines:\n  - {{kind: vllm, url: 'http://user:{URL_PASSWORD}@127.0.0.1:1'}}\n{ROUTES}",
    # the whole engine rendered (not a mapping either way)
    f"engines:\n  a: ['http://user:{URL_PASSWORD}@127.0.0.1:1']\n{ROUTES}",
    # a url-looking value anywhere else
    f"upstream: {{max_connections: 'http://user:{URL_PASSWORD}@h'}}\nengines:\n"
    f"  a: {{kind: vllm, url: 'http://h:1'}}\n{ROUTES}",
])
def test_url_userinfo_is_masked_wherever_a_value_is_rendered(text: str) -> None:
    message = problems_of(text)
    assert URL_PASSWORD not in message, f"the URL password leaked:\n{message}"
    assert "problem" in message, message


PASSWORD = "secretpw"


@pytest.mark.parametrize("value", [
    f"http:/alice:{PASSWORD}@127.0.0.1:8000",  # one slash
    f"http:alice:{PASSWORD}@127.0.0.1:8000",  # none
    f"alice:{PASSWORD}@127.0.0.1:8000",  # no scheme
    f"http://alice:secret\t{PASSWORD}@127.0.0.1:8000",  # whitespace in the userinfo
    f"http://alice:{PASSWORD}\n@127.0.0.1:8000",
    f"HTTP://alice:{PASSWORD}@127.0.0.1:8000",
    f"http://alice:{PASSWORD}@@127.0.0.1:8000",
    f"{PASSWORD}@127.0.0.1:8000",  # no ':' before the @: masked under a url key only
])
def test_userinfo_of_url_like_values_is_masked_whatever_the_form(value: str) -> None:
    """Not a URL parse: everything before the last @ of a url-like value is masked, wherever the
    value is rendered (the url, the whole engine, a route's engine)."""
    quoted = value.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")
    texts = [f'engines:\n  a: {{kind: vllm, url: "{quoted}"}}\n{ROUTES}']
    if ":" in value.partition("@")[0]:
        texts += [f'engines:\n  a: ["{quoted}"]\n{ROUTES}',
                  f'engines:\n  a: {{kind: vllm, url: "http://h:1"}}\n'
                  f'routes: [{{prefix: /, engine: "{quoted}"}}]\n']
    for text in texts:
        message = problems_of(text)
        assert PASSWORD not in message and "alice" not in message, (
            f"expected nothing before the @ shown, got:\n{message}")
        assert "***@127.0.0.1:8000" in message, f"expected the host still shown, got:\n{message}"


@pytest.mark.parametrize("url", [
    f"http://127.0.0.1:8000/?token={PASSWORD}", f"http://127.0.0.1:8000?api_key={PASSWORD}&x=1",
    f"http://127.0.0.1:8000/#{PASSWORD}", f"ftp://127.0.0.1:8000/?token={PASSWORD}",
    f"http://alice:x?{PASSWORD}@127.0.0.1:8000/?q=1",  # a '?' in the password: userinfo first
])
def test_a_urls_query_is_masked_where_the_url_is_refused(url: str) -> None:
    """A key passed as a query parameter is a secret like a password: the url is refused (an
    origin has no query) without echoing it."""
    message = problems_of(f"engines:\n  a: {{kind: vllm, url: '{url}'}}\n{ROUTES}")
    assert "  - engines.a.url:" in message, f"expected a problem at engines.a.url, got:\n{message}"
    assert PASSWORD not in message, f"the query's key leaked:\n{message}"
    assert "127.0.0.1:8000" in message, f"expected the host still shown, got:\n{message}"


def test_values_with_an_at_sign_but_no_userinfo_stay_readable() -> None:
    """An @ with no ':' before it, outside a url, is no userinfo (an e-mail address)."""
    message = problems_of(f"{ENGINE}routes: [{{prefix: /, engine: ops@example.com}}]\n",
                          env={"KEY": "k"})
    assert "  - routes.0.engine:" in message and "'ops@example.com'" in message, message


# --- admin.cancel_token ---------------------------------------------------------------------

TOKEN_CONFIG = "admin:\n  cancel_token: ${T}\n" + ENGINE + ROUTES


@pytest.mark.parametrize(("text", "token"), [
    (TOKEN_CONFIG, ""),
    (TOKEN_CONFIG, " \n"),
    ("admin: {cancel_token: ''}\n" + ENGINE + ROUTES, None),
    ("admin: {host: 127.0.0.1, port: 9090, cancel_token: '  '}\n" + ENGINE + ROUTES, None),
])
def test_empty_cancel_token_is_a_config_error_not_an_open_cancel_api(
        text: str, token: str | None) -> None:
    env = {"KEY": "k"} | ({"T": token} if token is not None else {})
    message = problems_of(text, env=env)
    assert "  - admin.cancel_token:" in message and "omit admin.cancel_token" in message, (
        f"expected an empty token refused at admin.cancel_token, got:\n{message}")


def test_cancel_token_from_a_secret_file_loses_its_newline_inner_controls_refused() -> None:
    settings = parse_config(TOKEN_CONFIG, "<test>", env={"KEY": "k", "T": f"{SECRET}\n"})
    assert settings.admin is not None and settings.admin.cancel_token is not None
    assert settings.admin.cancel_token.get_secret_value() == SECRET, "expected the token stripped"
    message = problems_of(TOKEN_CONFIG, env={"KEY": "k", "T": "sk-very\x7fsecret"})
    assert "  - admin.cancel_token:" in message and "control characters" in message, message
    assert "secret" not in message.replace("problem", ""), f"the token leaked:\n{message}"


def test_omitted_or_null_cancel_token_means_none() -> None:
    for admin in ("admin: {host: 127.0.0.1}\n", "admin: {cancel_token: null}\n"):
        settings = parse_config(admin + ENGINE + ROUTES, "<test>", env={"KEY": "k"})
        assert settings.admin is not None and settings.admin.cancel_token is None, admin


# --- documented defaults --------------------------------------------------------------------

@pytest.mark.parametrize(("sections", "listen", "admin"), [
    ("listen: {host: 0.0.0.0}\n", ("0.0.0.0", 8080), ("127.0.0.1", 9090)),
    ("admin: {host: 0.0.0.0, cancel_token: t}\n", ("127.0.0.1", 8080), ("0.0.0.0", 9090)),
    ("admin: {cancel_token: t}\n", ("127.0.0.1", 8080), ("127.0.0.1", 9090)),
    ("listen: {}\nadmin: {}\n", ("127.0.0.1", 8080), ("127.0.0.1", 9090)),
    ("listen: {port: 8081}\nadmin: {port: 9091}\n", ("127.0.0.1", 8081), ("127.0.0.1", 9091)),
])
def test_listen_and_admin_ports_default_to_8080_and_9090_when_omitted(
        sections: str, listen: tuple[str, int], admin: tuple[str, int]) -> None:
    settings = parse_config(sections + ENGINE + ROUTES, "<test>", env={"KEY": "k"})
    assert settings.admin is not None
    got = ((settings.listen.host, settings.listen.port), (settings.admin.host, settings.admin.port))
    assert got == (listen, admin), f"expected listen, admin {listen}, {admin}; got {got}"


def _readme_defaults(key: str) -> tuple[str, dict[str, str]]:
    """The config-table row for ``key`` in docs/configuration.md, and its per-kind defaults
    ("`/health` for vllm and sglang, `/v1/models` for openai" -> {"vllm": "/health", ...})."""
    docs = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
    rows = [line for line in docs.read_text().splitlines() if line.startswith(f"| `{key}`")]
    assert len(rows) == 1, f"expected one config-table row for {key} in {docs.name}, got {rows}"
    default = rows[0].split("|")[2]
    per_kind = {kind: path for path, kinds in re.findall(r"`([^`]+)` for ([a-z ,]+)", default)
                for kind in re.split(r",\s*|\s+and\s+", kinds.strip())}
    return rows[0], per_kind


def test_config_table_names_every_kind_and_its_default_paths() -> None:
    kinds, _ = _readme_defaults("engines.NAME.kind")
    _, health = _readme_defaults("engines.NAME.health_path")
    _, abort = _readme_defaults("engines.NAME.abort.path")
    for kind, adapter in ADAPTERS.items():
        assert f"`{kind.value}`" in kinds, f"expected kind {kind.value} in the table: {kinds}"
        assert health.get(kind.value) == adapter.default_health_path, (
            f"expected the table's health_path default for {kind.value} to be "
            f"{adapter.default_health_path}, got {health}")
        assert abort.get(kind.value) == adapter.default_abort_path, (
            f"expected the table's abort.path default for {kind.value} to be "
            f"{adapter.default_abort_path}, got {abort}")


# --- duplicate keys -------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "location", "lines"), [
    ("engines:\n  a: {kind: vllm, url: 'http://h:1'}\n  a: {kind: openai, url: 'http://h:2'}\n"
     + ROUTES, "engines.a", (2, 3)),
    ("listen:\n  port: 8081\n  host: 127.0.0.1\n  port: 8082\n" + ENGINE + ROUTES,
     "listen.port", (2, 4)),
    (ENGINE + ROUTES + "log_level: info\nlog_level: debug\n", "log_level", (4, 5)),
    (ENGINE + "routes:\n  - prefix: /\n    engine: a\n    prefix: /v1\n", "routes.0.prefix",
     (4, 6)),
    ("engines:\n  a:\n    kind: vllm\n    url: 'http://h:1'\n    abort: {api_key: x, api_key: y}\n"
     + ROUTES, "engines.a.abort.api_key", (5, 5)),
    # `<<` twice: PyYAML merges both silently, the second winning on shared keys
    ("x-a: &a {kind: vllm}\nx-b: &b {url: 'http://h:1'}\nengines:\n  a: {<<: *a, <<: *b}\n"
     + ROUTES, "engines.a.<<", (4, 4)),
    ("x-a: &a {kind: vllm, url: 'http://h:1'}\nengines:\n  a:\n    <<: *a\n    <<: *a\n"
     + ROUTES, "engines.a.<<", (4, 5)),
])
def test_duplicate_keys_are_located_errors_with_both_lines(
        text: str, location: str, lines: tuple[int, int]) -> None:
    message = problems_of(text, env={"KEY": "k"})
    first, second = lines
    assert f"  - {location}: duplicate key (line {first} and line {second})" in message, (
        f"expected a duplicate key at {location} (lines {first} and {second}), got:\n{message}")


@pytest.mark.parametrize("engines", [
    "engines:\n  a:\n    <<: *base\n    url: 'http://h:2'\n",
    "x-url: &url {url: 'http://h:2'}\nengines:\n  a: {<<: [*base, *url]}\n",
    # merged before its own mapping is read (a shallower mapping merges it): the keys it merged
    # itself are not its duplicates
    "x-deep: {a: {b: &mid {<<: *base, url: 'http://h:2'}}}\nengines:\n  a: {<<: *mid}\n",
])
def test_yaml_merge_keys_are_not_duplicates(engines: str) -> None:
    text = "x-engine: &base {kind: vllm, url: 'http://h:1'}\n" + engines + ROUTES
    message = problems_of(text)  # the x- keys are unknown keys, nothing else
    assert "duplicate" not in message and "  - x-engine:" in message, message


# --- misspelled secret-looking keys ---------------------------------------------------------

LEAK = "sk-LEAK5"


@pytest.mark.parametrize("section", [
    f"admin: {{cancel-token: {LEAK}}}",
    f"admin: {{CancelToken: {LEAK}}}",
    f"listen: {{port: 8080, password: {LEAK}}}",
    f"upstream: {{Auth_Header: {LEAK}}}",
    f"my_secret: {LEAK}",
    f"engines:\n  a: {{kind: vllm, url: 'http://h:1', x-api-key: {LEAK}}}",
    f"engines:\n  a: {{kind: vllm, url: 'http://h:1', credentials: [{LEAK}]}}",
    f"routes: [{{prefix: /, engine: a, bearer_TOKEN: {LEAK}}}]",
    f"lifecycle: {{passwd: {{nested: {LEAK}}}}}",
])
def test_unknown_keys_that_look_secret_have_their_values_masked(section: str) -> None:
    engines = "" if section.startswith("engines") else ENGINE
    routes = "" if section.startswith("routes") else ROUTES
    message = problems_of(f"{section}\n{engines}{routes}", env={"KEY": "k"})
    assert "unknown key (value not shown)" in message, message
    assert LEAK not in message, f"the value of a secret-looking key leaked:\n{message}"


@pytest.mark.parametrize(("section", "location"), [
    (f"admin: {{cancel_tokn: {LEAK}}}", "admin.cancel_tokn"),
    (f"admin: {{bearer: {LEAK}}}", "admin.bearer"),
    (f"listen: {{prot: {LEAK}}}", "listen.prot"),
    (f"engines:\n  a: {{kind: vllm, url: 'http://h:1', bearer: {LEAK}}}", "engines.a.bearer"),
    (f"x-anchor: &x {{value: {LEAK}}}", "x-anchor"),
    # an unknown key inside a mapping rendered whole (a mapping where a list belongs)
    (f"routes: {{prefix: /, engine: a, bearer: {LEAK}}}", "routes"),
])
def test_unknown_keys_never_show_their_values(section: str, location: str) -> None:
    """A typo's value may be anything (a token under a name the secret pattern misses): the
    key's name and location are what fixing it takes."""
    engines = "" if section.startswith("engines") else ENGINE
    routes = "" if section.startswith("routes") else ROUTES
    message = problems_of(f"{section}\n{engines}{routes}", env={"KEY": "k"})
    assert f"  - {location}:" in message, f"expected a problem at {location}, got:\n{message}"
    assert LEAK not in message, f"the value of an unknown key leaked:\n{message}"


def test_unknown_key_problem_names_the_key_without_a_value() -> None:
    message = problems_of(f"listen: {{prot: 8081}}\n{ENGINE}{ROUTES}", env={"KEY": "k"})
    assert "  - listen.prot: line 1: unknown key (value not shown)" in message, message
    assert "8081" not in message, message


# --- the open cancel API warning (CLI) ------------------------------------------------------

OPEN_API = "open to anyone who can reach it; set admin.cancel_token"
RELOAD_OPEN_API = "reload: after a restart (admin changes need one) the cancel API on"
UNREACHABLE = "http://127.0.0.1:1"  # nothing listens: the startup check logs "not ready"


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize(("admin", "warnings"), [
    ({"host": "0.0.0.0", "port": 0}, 1),
    ({"host": "0.0.0.0", "port": 0, "cancel_token": SECRET}, 0),
    ({"host": "127.0.0.1", "port": 0}, 0),
])
async def test_cancel_api_open_beyond_loopback_warns_once_at_start(
        tmp_path: Path, admin: dict[str, Any], warnings: int, workers: str) -> None:
    async with cli_process(tmp_path, config_tree(UNREACHABLE, admin=admin),
                           "--workers", workers) as cli:
        # logged after the warning, by the same process (the supervisor under --workers)
        await cli.wait_log("engine local not ready")
        lines = [line for line in cli.stderr_lines if OPEN_API in line]
        assert len(lines) == warnings, (
            f"expected {warnings} open-cancel-API warning(s), got {len(lines)}:\n{cli.stderr}")
        assert all('"WARNING"' in line and f"0.0.0.0:{cli.admin_port}" in line
                   for line in lines), lines
        assert SECRET not in cli.stderr, f"the token leaked:\n{cli.stderr}"


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_reload_that_drops_the_cancel_token_beyond_loopback_warns(
        tmp_path: Path, workers: str) -> None:
    admin = {"host": "0.0.0.0", "port": 0, "cancel_token": SECRET}
    tree = config_tree(UNREACHABLE, admin=admin)
    async with cli_process(tmp_path, tree, "--workers", workers) as cli:
        after = await cli.wait_log("engine local not ready")
        cli.write_config({**tree, "admin": {"host": "0.0.0.0", "port": 0}})
        cli.signal(signal.SIGHUP)
        await cli.wait_log(RELOAD_OPEN_API, after=after)
        for _ in range(int(workers)):  # every process that reloads has logged its reload
            after = await cli.wait_log("reload of", after=after)
        lines = [line for line in cli.stderr_lines if OPEN_API in line]
        assert len(lines) == 1 and RELOAD_OPEN_API in lines[0], (
            f"expected one reload warning, got {len(lines)}:\n{cli.stderr}")
        assert SECRET not in cli.stderr, f"the token leaked:\n{cli.stderr}"


RELOAD_LEAKS = ("secretpw", "HUNTER3TOK")


async def test_reload_log_of_a_bad_config_shows_no_userinfo_no_unknown_value(
        tmp_path: Path) -> None:
    """The ERROR line of a rejected SIGHUP reload renders problems as --check-config does."""
    async with cli_process(tmp_path, config_tree(UNREACHABLE)) as cli:
        after = await cli.wait_log("engine local not ready")
        cli.config.write_text(
            "admin: {host: 127.0.0.1, port: 0, cancel_tokn: HUNTER3TOK}\n"
            "x-a: &a {kind: vllm}\n"
            "engines:\n"
            "  local: {kind: vllm, url: 'http:/user:secretpw@127.0.0.1:8000'}\n"
            "  b: {kind: vllm, url: 'user:secretpw@127.0.0.1:8000'}\n"
            '  c: {kind: vllm, url: "http://user:secret\\tpw@127.0.0.1:8000"}\n'
            "  d: {<<: *a, <<: *a, url: 'http:user:secretpw@127.0.0.1:8000'}\n"
            "routes: [{prefix: /, engine: local}]\n")
        cli.signal(signal.SIGHUP)
        after = await cli.wait_log("keeping the running config", after=after)
        line = cli.stderr_lines[after - 1]
        for located in ("admin.cancel_tokn", "engines.local.url", "engines.b.url",
                        "engines.c.url", "engines.d.<<"):
            assert located in line, f"expected a problem at {located}, got:\n{line}"
        for leak in RELOAD_LEAKS:
            assert leak not in cli.stderr, f"{leak} leaked on reload:\n{cli.stderr}"


def test_a_misspelt_key_gets_the_close_key_of_its_section() -> None:
    """Unknown keys name the key their own section has that is closest (top level, a section,
    an engine inside the ``engines`` mapping, a route inside the list), and their line; none
    when nothing is close; the value is still never shown. A required key the typo names is
    not also reported missing."""
    text = problems_of(
        "rotues:\n  - prefix: /\n    engine: local\n    engnie: local\n"
        "engines:\n  local:\n    kind: vllm\n    url: http://127.0.0.1:8000\n"
        "    abrot: {}\n    zzz_secretish: hunter2\n"
        "listen: {prot: 8080}\n")
    assert "  - rotues: line 1: unknown key (value not shown); check its spelling and section; " \
           "did you mean 'routes'?" in text, text
    assert "listen.prot: line 11: unknown key" in text and "did you mean 'port'?" in text, text
    assert "engines.local.abrot: line 9: unknown key" in text and "did you mean 'abort'?" in text
    assert re.search(r"engines\.local\.zzz_secretish: line 10: unknown key \(value not shown\); "
                     r"check its spelling and section$", text, re.M), text
    assert "Field required" not in text and "hunter2" not in text, text
    assert text.count("  - ") == 4, f"expected the four unknown keys only, got:\n{text}"


def test_a_required_key_no_typo_names_is_still_missing() -> None:
    """Only the key a typo names is spared its "Field required": a far-off unknown key
    (``zzz``) leaves ``routes`` missing, located by the mapping that lacks it where there is
    one (a route without its prefix: that route's line)."""
    text = problems_of("engines:\n  a: {kind: vllm, url: 'http://h:1'}\nzzz: 1\n")
    assert "  - routes: Field required" in text and "  - zzz: line 3: unknown key" in text, text
    text = problems_of("engines:\n  a: {kind: vllm, url: 'http://h:1'}\nroutes:\n"
                       "  - engine: a\n")
    assert "  - routes.0.prefix: line 4: Field required" in text, text


NO_SCHEME = "has no scheme: write it as http://HOST:PORT (or https://HOST:PORT)"


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "vllm:8000", "localhost:8000",
                                 "[::1]:8000"])
def test_an_engine_url_without_its_scheme_says_to_write_it(url: str) -> None:
    """pydantic says "relative URL without a base" for an address, and takes a host name for
    the scheme (``vllm:8000``: "URL scheme should be 'http' or 'https'"): both are a missing
    scheme."""
    text = problems_of("routes:\n  - prefix: /\n    engine: local\nengines:\n  local:\n"
                       f"    kind: vllm\n    url: '{url}'\n")
    assert f"  - engines.local.url: line 7: {NO_SCHEME} (got '{url}')" in text, text


def test_a_wrong_scheme_is_named_as_such() -> None:
    text = problems_of("engines:\n  a: {kind: vllm, url: 'ftp://h:1'}\n" + ROUTES)
    assert "engines.a.url: line 2: URL scheme should be 'http' or 'https'" in text, text


# --- the newcomer's four mistakes: one located problem each, with its fix -------------------

@pytest.mark.parametrize(("text", "problem"), [
    # a misspelt key (and so a required key missing: not told twice)
    ("engines:\n  local: {kind: vllm, url: 'http://127.0.0.1:8000'}\n"
     "routes:\n  - prefx: /\n    engine: local\n",
     "routes.0.prefx: line 4: unknown key (value not shown); check its spelling and section; "
     "did you mean 'prefix'?"),
    ("engines:\n  local: {kind: vllm, url: 'http://127.0.0.1:8000'}\n"
     "rotues:\n  - prefix: /\n    engine: local\n",
     "rotues: line 3: unknown key (value not shown); check its spelling and section; "
     "did you mean 'routes'?"),
    # an engine url without its scheme
    ("engines:\n  local:\n    kind: vllm\n    url: 127.0.0.1:8000\n"
     "routes: [{prefix: /, engine: local}]\n",
     f"engines.local.url: line 4: {NO_SCHEME} (got '127.0.0.1:8000')"),
    # a route naming an engine not defined
    ("engines:\n  vllm-0: {kind: vllm, url: 'http://127.0.0.1:8000'}\n"
     "  router: {kind: openai, url: 'http://127.0.0.1:8001'}\n"
     "routes:\n  - prefix: /v1\n    engine: vllm0\n",
     "routes.0.engine: line 6: names no defined engine; did you mean 'vllm-0'? (defined: "
     "router, vllm-0) (got 'vllm0')"),
    # an unset environment variable
    ("engines:\n  local:\n    kind: vllm\n    url: ${VLLM_URL}\n"
     "routes: [{prefix: /, engine: local}]\n",
     "engines.local.url: line 4: environment variable VLLM_URL is not set; set it or write "
     "${VLLM_URL:-default}"),
], ids=["typo", "typo_top_level", "missing_scheme", "unknown_engine", "unset_variable"])
def test_each_common_mistake_is_one_problem_with_its_line_and_fix(text: str, problem: str
                                                                   ) -> None:
    message = problems_of(text)
    assert message == f"invalid config <test>: 1 problem(s)\n  - {problem}", (
        f"expected exactly the one problem\n  - {problem}\ngot:\n{message}")


def test_check_config_prints_the_file_line_of_each_problem(tmp_path: Path) -> None:
    """Through the CLI, as a newcomer runs it: exit 1 and the problems on stderr."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("engines:\n  local:\n    kind: vllm\n    url: 127.0.0.1:8000\n"
                   "routes:\n  - prefix: /\n    engnie: local\n")
    result = subprocess.run([sys.executable, "-m", "sidecar", "--check-config", "--config",
                             str(bad)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert result.stderr.splitlines() == [
        f"invalid config {bad}: 2 problem(s)",
        f"  - engines.local.url: line 4: {NO_SCHEME} (got '127.0.0.1:8000')",
        "  - routes.0.engnie: line 7: unknown key (value not shown); check its spelling and "
        "section; did you mean 'engine'?",
    ], result.stderr


@pytest.mark.parametrize(("kind", "hint"), [
    ("vLLM", "did you mean 'vllm'? (kinds are lower case)"),
    ("sglnag", "did you mean 'sglang'?"),
    ("tgi", "an OpenAI-compatible server with no kind of its own is kind 'openai'"),
    ("ollama", "an OpenAI-compatible server with no kind of its own is kind 'openai'"),
])
def test_an_unknown_kind_names_the_kind_meant(kind: str, hint: str) -> None:
    text = problems_of(f"engines:\n  a: {{kind: {kind}, url: 'http://h:1'}}\n" + ROUTES)
    assert "1 problem(s)" in text and "engines.a.kind: line 2: Input should be 'vllm', " in text
    assert hint in text and f"(got '{kind}')" in text, text


@pytest.mark.parametrize(("listen", "url"), [
    ("{host: 0.0.0.0, port: 8080}", "http://127.0.0.1:8080"),
    ("{host: 127.0.0.1, port: 9000}", "http://localhost:9000"),
    ("{host: 10.0.0.5, port: 8080}", "http://10.0.0.5:8080"),
])
def test_an_engine_url_that_is_the_sidecar_itself_is_a_loop(listen: str, url: str) -> None:
    text = problems_of(f"listen: {listen}\nengines:\n  a: {{kind: vllm, url: '{url}'}}\n"
                       + ROUTES)
    assert "1 problem(s)" in text and (
        "engines.a.url: line 3: is the sidecar's own listener") in text, text


def test_an_engine_on_another_port_or_host_is_no_loop() -> None:
    for listen, url in (("{host: 0.0.0.0, port: 8080}", "http://127.0.0.1:8000"),
                        ("{host: 127.0.0.1, port: 8080}", "http://10.0.0.5:8080")):
        parse_config(f"listen: {listen}\nengines:\n  a: {{kind: vllm, url: '{url}'}}\n"
                     + ROUTES, "<test>", env={})


def test_a_worker_keeps_its_supervisor_s_restart_only_values_and_no_secret() -> None:
    """``--worker-pinned`` (sidecar.runtime): the restart-only values of the config the
    supervisor started with, applied over the file a later worker reads; the reloadable ones
    stay the file's, and no secret is in the text (it goes on the worker's command line)."""
    base = ("engines: {local: {kind: vllm, url: 'http://127.0.0.1:8000',"
            " abort: {api_key: engine-secret-1}}}\n"
            "routes: [{prefix: /, engine: local}]\n"
            "admin: {cancel_token: cancel-secret-2}\n")
    started = parse_config(base + "lifecycle: {record_dir: /var/lib/a}\nlog_level: DEBUG\n"
                           "listen: {port: 8111}\ndownstream: {idle_timeout_s: 30}\n")
    now = parse_config(base + "lifecycle: {record_dir: /var/lib/b, grace_period_s: 7}\n"
                       "log_level: ERROR\nlisten: {port: 8222}\n"
                       "downstream: {idle_timeout_s: 60, max_body_bytes: 1000}\n")
    pinned = pinned_for_workers(started)
    assert "secret" not in pinned
    kept = with_pinned(now, pinned)
    assert kept.lifecycle.record_dir == Path("/var/lib/a")
    assert (kept.log_level, kept.listen.port, kept.downstream.idle_timeout_s) == ("DEBUG", 8111,
                                                                                  30)
    assert (kept.lifecycle.grace_period_s, kept.downstream.max_body_bytes) == (7, 1000)
    assert describe_changes(started, kept)[1] == []  # nothing restart-only differs
    assert kept.engines == now.engines and kept.admin == now.admin
