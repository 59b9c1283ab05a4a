"""The record of in-flight engine work (:mod:`sidecar.inflight`), on real files and processes.

- a writer's record is skipped while it lives (its lock is held) and read once it is killed:
  exactly its requests not over, and the files are gone after;
- compaction keeps the live lines and bounds the file;
- a torn last line and a line not understood are skipped, the rest read;
- a start aborts what a dead process left at an engine of its config, and skips (with a
  WARNING) a record naming an engine it does not have.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar import server
from sidecar.config import parse_config
from sidecar.inflight import COMPACT_BYTES, orphans
from tests.fakes.kinds import VLLMEngine

WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from sidecar.inflight import InflightRecord
    record = InflightRecord.open(Path(sys.argv[1]))
    seqs = [record.add(f"req{i}", time.monotonic(), [("local", "http://127.0.0.1:1",
                                                     (f"chatcmpl-req{i}",))]) for i in range(5)]
    for seq in seqs[:2]:
        record.done(seq)  # req0 and req1 are over
    print(record.name, flush=True)
    time.sleep(60)
""")


@contextmanager
def writer(script: str, directory: Path) -> Iterator[str]:
    """Run ``script`` (a writer of a record in ``directory`` that prints the record's name,
    then sleeps) in a process of its own; yields the name; SIGKILL at the end, as the OOM
    killer would."""
    proc = subprocess.Popen([sys.executable, "-c", script, str(directory)],
                            stdout=subprocess.PIPE, cwd=Path(__file__).parent.parent)
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline().decode().strip()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_a_live_writer_s_record_is_skipped_and_a_killed_one_s_read(tmp_path: Path) -> None:
    with writer(WRITER, tmp_path) as name:
        assert (tmp_path / f"{name}.lock").exists() and (tmp_path / f"{name}.log").exists()
        assert list(orphans(tmp_path)) == [], "a live writer's record must be skipped"
        assert (tmp_path / f"{name}.log").exists(), "a live writer's record must be left alone"
    (found,) = list(orphans(tmp_path))
    assert found[0] == name
    assert sorted(o.sidecar_id for o in found[1]) == ["req2", "req3", "req4"], found
    assert found[1][0].engines == (("local", "http://127.0.0.1:1", ("chatcmpl-req2",)),)
    assert not list(tmp_path.iterdir()), "the files must be gone once read"


ODD_IDS = ('chatcmpl-"quoted"', "cmpl-back\\slash", "resp_\u00e9\u2028\n\t", "plain-0")
ODD_WRITER = textwrap.dedent(f"""
    import sys, time
    from pathlib import Path
    from sidecar.inflight import InflightRecord
    record = InflightRecord.open(Path(sys.argv[1]))
    record.add("odd", 1.0, [("e", "http://x:1", {ODD_IDS!r}), ("f", "http://y:2", ("one",))])
    print(record.name, flush=True)
    time.sleep(60)
""")


def test_ids_of_any_characters_are_read_back_unchanged(tmp_path: Path) -> None:
    """Each id list is written with json's own escaper (not ``json.dumps``): quotes,
    backslashes, non-ASCII, line separators and control characters in an id come back as they
    were, several ids and several engines in one line."""
    with writer(ODD_WRITER, tmp_path):
        pass
    (found,) = list(orphans(tmp_path))
    assert found[1][0].engines == (("e", "http://x:1", ODD_IDS), ("f", "http://y:2", ("one",))), (
        found)


COMPACTING_WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from sidecar.inflight import InflightRecord
    record = InflightRecord.open(Path(sys.argv[1]))
    kept = [record.add(f"kept{i}", 1.0, [("e", "http://x:1", (f"id-kept{i}",))])
            for i in range(10)]
    for i in range(20000):  # ~4 MB of lines added and ended
        record.done(record.add(f"r{i}", 1.0, [("e", "http://x:1", (f"id-r{i}",))]))
    record.done(kept[0])
    print(record.name, flush=True)
    time.sleep(60)
""")


def test_compaction_keeps_the_live_lines_and_bounds_the_file(tmp_path: Path) -> None:
    with writer(COMPACTING_WRITER, tmp_path) as name:
        size = (tmp_path / f"{name}.log").stat().st_size
    assert size <= COMPACT_BYTES + 4096, f"expected the log compacted, it has {size} bytes"
    (found,) = list(orphans(tmp_path))
    assert sorted(o.sidecar_id for o in found[1]) == [f"kept{i}" for i in range(1, 10)]


def test_a_torn_or_unknown_line_is_skipped(tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "1-ab.lock").write_bytes(b"")
    good = (b'+1 {"sidecar_id":"a","at":1.0,"sent_at":1.0,"engines":[{"name":"e",'
            b'"url":"http://x:1","ids":["i1"]}]}\n')
    (tmp_path / "1-ab.log").write_bytes(good + b"?? what\n" + b'+2 {"sidecar_id":"b"')
    with caplog.at_level(logging.WARNING, logger="sidecar.inflight"):
        (found,) = list(orphans(tmp_path))
    assert [o.sidecar_id for o in found[1]] == ["a"]
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "not whole" in messages and "line 2: not understood" in messages, messages


async def test_a_start_aborts_what_a_dead_process_left_and_skips_unknown_engines(
        tmp_path: Path, record_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    fake = VLLMEngine("k")
    await fake.start()
    try:
        _dead_record(record_dir, [("left1", "local", fake.url), ("gone1", "gone", fake.url),
                                  ("moved", "local", "http://127.0.0.1:1")])
        tree: dict[str, Any] = {
            "listen": {"host": "127.0.0.1", "port": 0}, "admin": None,
            "engines": {"local": {"kind": "vllm", "url": fake.url,
                                  "abort": {"api_key": "k"}}},
            "routes": [{"prefix": "/", "engine": "local"}]}
        settings = parse_config(yaml.safe_dump(tree), "<test>", env={})
        assert settings.lifecycle.record_dir == record_dir
        with caplog.at_level(logging.WARNING, logger="sidecar.inflight"):
            servers = await server.start(settings)
            try:
                assert await fake.watch.until(lambda: any(
                    "chatcmpl-left1" in c.ids for c in fake.calls), 5.0), fake.calls
                await asyncio.sleep(0.3)
            finally:
                await servers.stop()
        named = {i for c in fake.calls for i in c.ids}
        assert named == {"chatcmpl-left1"}, named
        messages = " ".join(r.getMessage() for r in caplog.records)
        assert "engine gone at" in messages and "chatcmpl" not in messages.split(
            "engine gone")[0][-200:], messages
        assert "engine local at http://127.0.0.1:1 is not in the config" in messages, messages
        assert not (record_dir / "1-ab.log").exists()
    finally:
        await fake.stop()


def _dead_record(directory: Path, requests: list[tuple[str, str, str]]) -> None:
    """A record as a dead process leaves it (its lock file free): one line per ``(sidecar id,
    engine name, engine url)``, its id ``chatcmpl-<sidecar id>``."""
    directory.mkdir(parents=True)
    (directory / "1-ab.lock").write_bytes(b"")
    (directory / "1-ab.log").write_text("".join(
        f'+{n} {{"sidecar_id":"{rid}","at":1.0,"sent_at":1.0,"engines":'
        f'[{{"name":"{name}","url":"{url}","ids":["chatcmpl-{rid}"]}}]}}\n'
        for n, (rid, name, url) in enumerate(requests, 1)))
