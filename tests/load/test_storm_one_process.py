"""Storms never make the sidecar count a one-process engine as having several API-server
processes (:data:`sidecar.abort.MULTI_RESENDS`), so its lone disconnects keep one abort call.

A request the engine surely knew and confirmed only after 2 re-sends marks the engine as having
several processes for 60 s, and from then every first call goes out on ``abort.fanout`` (8)
connections at once. After a storm that loop is busy, and the one-process engine's end, sent
right after the first call, can wait unread in the socket across both re-sends: that is no
miss, and must not mark it (:attr:`sidecar.confirm.Confirmation.unread`,
:meth:`sidecar.abort_queue.Resend.judge`). Before that check, a later storm's first calls went 8
wide in 9 of 25 runs of ``python -m bench``'s storm phase (6 storms each), and this test failed
in 1 of 5 runs (the storms vary: it cannot fail every time); with it, 0 of 10 bench runs.

Real processes on 127.0.0.1, as ``python -m bench``'s storm runs them (``bench.procs``): the
fake engine (:mod:`bench.engine`, one process: an abort call stops every stream it names), the
sidecar through its CLI, and the load client (:mod:`bench.client`). Each storm opens 1,000
streams at 100 ms per token and resets 500 at once; a lone disconnect follows each storm, and
the engine's records must show it named in exactly one call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.procs import LoadClient, Proc, http_get, start_engine, start_sidecar
from tests.harness.load.common import size_from_env

pytestmark = [pytest.mark.load, pytest.mark.timeout(600)]

STORMS = 6  # as python -m bench's storm phase
N = size_from_env("CANCEL_SIDECAR_STORM_ONE_N", 1000)
INTERVAL_US = 100_000


def namings(records: dict[str, Any], tag: str) -> int:
    """How many abort calls the engine took whose body names the stream ``tag``'s engine id."""
    engine_id = f"chatcmpl-{records['request_ids'][tag]}"
    return sum(engine_id in ids for _, ids in records["aborts"])


async def test_storms_never_mark_a_one_process_engine_as_several(tmp_path: Path) -> None:
    engine = await start_engine(tmp_path)
    procs: list[Proc] = [engine]
    try:
        sidecar = await start_sidecar(tmp_path, engine.port, 1)
        procs.append(sidecar)
        client = await LoadClient.start(tmp_path)
        procs.append(client.proc)
        lone_calls = []
        for storm in range(STORMS):
            await http_get(engine.port, "/bench/reset", "POST")
            result = await client.call("storm", port=sidecar.port, n=N, close=N // 2,
                                       interval_us=INTERVAL_US, settle_s=1.0)
            assert len(result["closed"]) >= N // 2 - N // 20, (
                f"storm {storm}: expected ~{N // 2} streams reset at once, {result}")
            # A lone client leaves: the engine's first call is one call, unless the storm
            # marked it as having several processes (then 8 at once).
            await http_get(engine.port, "/bench/reset", "POST")
            lone = await client.call("storm", port=sidecar.port, n=2, close=1,
                                     interval_us=INTERVAL_US, settle_s=0.5)
            (tag,) = lone["closed"]
            _, records = await http_get(engine.port, "/bench/records")
            lone_calls.append(namings(records, tag))
        print(f"calls naming the lone disconnect after each storm: {lone_calls}")
        assert lone_calls == [1] * STORMS, (
            f"expected one abort call per lone disconnect after each storm (a one-process "
            f"engine never counted as several), got {lone_calls}")
    finally:
        for proc in reversed(procs):
            await proc.stop()
