"""Shared fixtures: a fake engine and the sidecar, both real servers on 127.0.0.1.

The sidecar runs through :func:`sidecar.server.start`, the production wiring the CLI uses
(``AppRunner`` with handler cancellation on), never through aiohttp's test client. The event
loop is uvloop's, as in production.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import uvloop
import yaml
from prometheus_client import CollectorRegistry

from sidecar import server
from sidecar.config import Settings, parse_config
from tests.fakes.engine import FakeEngine
from tests.fakes.kinds import SGLangEngine
from tests.harness.support import Stalls


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item
                                   ) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Run every async test on uvloop, the loop production uses."""
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(autouse=True)
def record_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
               ) -> Path:
    """Each test's own ``XDG_STATE_HOME``, so the sidecars it starts (in this process, or
    through the CLI, which inherits the environment) keep their records of in-flight work
    (``lifecycle.record_dir``'s default, :mod:`sidecar.inflight`) apart from every other
    test's: a record a killed sidecar left is aborted by the next start in the same
    directory only. Returns the record directory."""
    state = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    return state / "cancel-sidecar"


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    fake = FakeEngine()
    await fake.start()
    yield fake
    await fake.stop()


@pytest_asyncio.fixture
async def sglang() -> AsyncIterator[SGLangEngine]:
    """The fake SGLang server of :mod:`tests.fakes.kinds`."""
    fake = SGLangEngine()
    await fake.start()
    yield fake
    await fake.stop()


def sidecar_settings(engine_url: str, *, confirm: bool = True, **overrides: Any) -> Settings:
    """A config for one vLLM-kind engine at ``engine_url``, free ports; ``overrides`` are merged
    into the YAML tree (e.g. ``upstream={"first_byte_timeout_s": 0.5}``). ``confirm=False``:
    ``abort.confirm_timeout_s: 0``, for an upstream that never ends an aborted response (a raw
    server of :mod:`tests.fakes.upstreams`): the upstream closed at once, one call, ``accepted``."""
    tree: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "engines": {"local": {"kind": "vllm", "url": engine_url,
                              "abort": {"api_key": "sekret-key", "timeout_s": 2.0,
                                        # one call per request: these tests count the
                                        # first call; the re-sends have tests of their own
                                        "resend_window_s": 0,
                                        **({} if confirm else {"confirm_timeout_s": 0})}}},
        "routes": [{"prefix": "/", "engine": "local"}],
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(tree.get(key), dict):
            tree[key] = {**tree[key], **value}
        else:
            tree[key] = value
    return parse_config(yaml.safe_dump(tree), "<test>", env={})


SidecarFactory = Callable[..., "asyncio.Future[server.Servers]"]


@pytest_asyncio.fixture
async def start_sidecar() -> AsyncIterator[Callable[..., Any]]:
    """Factory: ``await start_sidecar(settings)`` -> running :class:`server.Servers`."""
    running: list[server.Servers] = []

    async def start(settings: Settings, registry: CollectorRegistry | None = None
                    ) -> server.Servers:
        servers = await server.start(settings, registry or CollectorRegistry())
        running.append(servers)
        return servers

    yield start
    for servers in running:
        await servers.stop()


@pytest_asyncio.fixture
async def sidecar(engine: FakeEngine, start_sidecar: Callable[..., Any]) -> server.Servers:
    servers: server.Servers = await start_sidecar(sidecar_settings(engine.url))
    return servers


@pytest.fixture(scope="session", name="stalls")
def stall_monitor() -> Iterator[Stalls]:
    """Records when this test process did not run (see :class:`tests.harness.support.Stalls`)."""
    monitor = Stalls()
    yield monitor
    monitor.stop()
