"""The record of in-flight engine work: what a killed sidecar process leaves to abort.

The sidecar exists because an engine keeps generating when nobody can stop it; a sidecar process
that dies (SIGKILL, the OOM killer, a crash) is that case for every request it carried. So each
proxy process (the single process, or each ``--workers`` worker) writes down, per request, the
engine work it started (engine, ids) when the request's body has gone whole to the engine, and
writes its end when the request is over (its response relayed, or its abort's outcome known).
Whoever finds the record of a dead process aborts what is left in it: the supervisor at once
when a worker dies, the next start before it listens when the whole sidecar died.

Files, in ``lifecycle.record_dir``, per process (``<pid>-<random>``: never reused)::

    <name>.lock   flock(LOCK_EX) held by its writer for its life; the kernel drops it when the
                  process dies, however it dies: a free lock means a dead writer
    <name>.log    lines appended with one write(2) each, never read back by the writer:
                  "+<seq> <json>\\n"  {"sidecar_id", "at" (unix s), "sent_at" (CLOCK_MONOTONIC s,
                                      the body's last byte upstream), "engines": [{"name",
                                      "url", "ids"}]}
                  "-<seq>\\n"          that request is over

The failure model is the death of a process, not of the machine: a write(2) to a regular file
is in the page cache when it returns and survives a SIGKILL, so there is no fsync per request
(a node crash loses the record, and the engine with it). A small write(2) is never torn by a
signal. The writer keeps its live lines in memory and, past ``COMPACT_BYTES`` written, rewrites
the file with only those (write to a temporary file, rename over): the file stays within
``COMPACT_BYTES`` plus one line per request in flight.

Two live sidecars never share a record: each process writes only its own files, and a reader
takes a file's lock before reading it (held: its writer lives, skip it). A file is created
under a temporary name, locked, then renamed into place, so no reader ever sees it unlocked.
A request whose end was written is never named again; one that ended at the engine while its
end was not yet written (the process died in between) may be: the engine ignores an id it
does not know (``sidecar.abort``).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import suppress
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from pathlib import Path

from engine import EngineAdapter
from sidecar.abort import Aborter

log = logging.getLogger(__name__)

COMPACT_BYTES = 1 << 20  # written to the log before it is rewritten with the live lines only


@dataclass(frozen=True, slots=True)
class Orphan:
    """One request a dead process left: its engine work, per engine ``(name, url, ids)``."""

    sidecar_id: str
    at: float  # time.time() when its body went whole to the engine
    sent_at: float  # time.monotonic() (CLOCK_MONOTONIC: one clock for every process) of that
    engines: tuple[tuple[str, str, tuple[str, ...]], ...]


class InflightRecord:
    """One process's record (module docstring). :meth:`add` and :meth:`done` are one write(2)
    each, from the event loop's thread; an ``OSError`` there (a full disk) is logged once and
    the record stops (requests are served on, unrecorded). Raises ``OSError`` from
    :meth:`open` if the directory cannot be made or written."""

    def __init__(self, directory: Path, name: str, fd: int, lock_fd: int) -> None:
        self.directory = directory
        self.name = name
        self._fd = fd
        self._lock_fd = lock_fd
        self._live: dict[int, bytes] = {}  # seq -> its "+" line
        self._seq = 0
        self._written = 0
        self._compact_at = COMPACT_BYTES  # written bytes that start the next compaction
        self._failed = False
        self._engines: dict[tuple[str, str], str] = {}  # (name, url) -> its JSON, up to "ids"

    @classmethod
    def open(cls, directory: Path) -> InflightRecord:
        """A new record of this process in ``directory`` (made, mode 0700, if missing)."""
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        name = f"{os.getpid()}-{secrets.token_hex(4)}"
        lock_tmp = directory / f".{name}.lock"
        lock_fd = os.open(lock_tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fd = os.open(directory / f"{name}.log",
                         os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            os.rename(lock_tmp, directory / f"{name}.lock")  # visible only once locked
        except BaseException:
            os.close(lock_fd)
            with suppress(OSError):
                os.unlink(lock_tmp)
            raise
        return cls(directory, name, fd, lock_fd)

    def add(self, sidecar_id: str, sent_at: float,
            engines: list[tuple[str, str, tuple[str, ...]]]) -> int:
        """Write that a request's body went whole to its engines (``(name, url, ids)`` each;
        ``sent_at``: ``time.monotonic()``); returns its sequence number for :meth:`done`."""
        self._seq = seq = self._seq + 1
        parts = []
        for name, url, ids in engines:
            head = self._engines.get((name, url))
            if head is None:
                head = self._engines[name, url] = json.dumps(
                    {"name": name, "url": url}, separators=(",", ":"))[:-1] + ',"ids":'
            # The list by json's own C escaper, without json.dumps's encoder set up per call
            # (3.4 -> 0.5 us warm, more on this cold path: python -m bench.ab).
            parts.append(head + "[" + ",".join(map(encode_basestring_ascii, ids)) + "]}")
        # sidecar_id: 32 hex characters (sidecar.ticket.new_request_id), nothing to escape;
        # floats: repr, valid JSON.
        line = (f'+{seq} {{"sidecar_id":"{sidecar_id}","at":{time.time()!r},'
                f'"sent_at":{sent_at!r},"engines":[{",".join(parts)}]}}\n').encode()
        self._live[seq] = line
        self._write(line)
        return seq

    def done(self, seq: int) -> None:
        """Write that request ``seq`` is over (its response relayed, or its abort's outcome
        known)."""
        if self._live.pop(seq, None) is not None:
            self._write(b"-%d\n" % seq)
            if self._written > self._compact_at:
                self._compact()

    @property
    def live(self) -> int:
        """Requests recorded and not over."""
        return len(self._live)

    def _write(self, data: bytes) -> None:
        if self._failed:
            return
        try:
            os.write(self._fd, data)
        except OSError as exc:
            self._failed = True
            log.error("the record of in-flight requests (%s) cannot be written (%s): from now "
                      "on a killed sidecar leaves this process's requests running at the "
                      "engine", self.directory / f"{self.name}.log", exc)
            return
        self._written += len(data)

    def _compact(self) -> None:
        """Rewrite the log with the live lines only (a temporary file renamed over it)."""
        path = self.directory / f"{self.name}.log"
        tmp = self.directory / f".{self.name}.log"
        data = b"".join(self._live.values())
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC,
                         0o600)
        except OSError as exc:
            log.warning("the record of in-flight requests could not be compacted (%s); "
                        "writing on", exc)
            return
        try:
            os.write(fd, data)
            os.rename(tmp, path)
        except OSError as exc:
            os.close(fd)
            log.warning("the record of in-flight requests could not be compacted (%s); "
                        "writing on", exc)
            return
        os.close(self._fd)
        self._fd = fd
        self._written = len(data)
        # Past twice what is live: a compaction's cost stays proportional to what it drops.
        self._compact_at = max(COMPACT_BYTES, 2 * len(data))

    def close(self) -> None:
        """At a clean exit (nothing in flight, or what is left was aborted): remove the files."""
        for suffix in (".log", ".lock"):
            with suppress(OSError):
                os.unlink(self.directory / f"{self.name}{suffix}")
        os.close(self._fd)
        os.close(self._lock_fd)


def orphans(directory: Path) -> Iterator[tuple[str, list[Orphan]]]:
    """The records in ``directory`` whose writer is dead: ``(name, requests it left)`` each,
    the files removed once read (the caller aborts what they name). A record whose lock is held
    (its writer lives: this process's own, another worker's, another sidecar's) is skipped. A
    line that is not whole or not understood is logged and skipped."""
    if not directory.is_dir():
        return
    for lock_path in sorted(directory.glob("*.lock")):
        name = lock_path.name[:-len(".lock")]
        try:
            lock_fd = os.open(lock_path, os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # another reader took it
        try:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its writer lives
            log_path = directory / f"{name}.log"
            try:
                data = log_path.read_bytes()
            except FileNotFoundError:
                data = b""
            left = _parse(data, log_path)
            yield name, left
            for path in (log_path, lock_path):
                with suppress(OSError):
                    os.unlink(path)
        finally:
            os.close(lock_fd)


def _parse(data: bytes, path: Path) -> list[Orphan]:
    live: dict[bytes, Orphan] = {}
    lines = data.split(b"\n")
    if lines and lines[-1]:
        log.warning("%s: its last line is not whole (skipped)", path)
    for number, line in enumerate(lines[:-1], 1):
        try:
            if line.startswith(b"-"):
                live.pop(line[1:], None)
                continue
            seq, _, body = line[1:].partition(b" ")
            if not line.startswith(b"+") or not seq.isdigit():
                raise ValueError("neither +SEQ nor -SEQ")
            entry = json.loads(body)
            live[seq] = Orphan(
                str(entry["sidecar_id"]), float(entry["at"]), float(entry["sent_at"]),
                tuple((str(e["name"]), str(e["url"]), tuple(str(i) for i in e["ids"]))
                      for e in entry["engines"]))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("%s line %d: not understood (%s), skipped", path, number, exc)
    return list(live.values())


@dataclass
class Recovered:
    """What :func:`recover` found: the records read (their names: ``<pid>-<random>``), the
    requests aborted per engine name, and the sidecar ids of every request left."""

    records: list[str]
    aborted: Counter[str]
    sidecar_ids: list[str]


def recover(directory: Path, adapters: Mapping[str, EngineAdapter], aborter: Aborter,
            why: str) -> Recovered:
    """Abort what dead processes left in the records in ``directory`` (:func:`orphans`): each
    request's ids at each engine, by :meth:`Aborter.abort_orphan` (fanned out, re-sent through
    the registration window). ``why`` says who died, for the log (``worker died``, ``found at
    start``). An engine the config no longer has, by name and url, is logged (WARNING) and
    skipped: its ids are not aborted. Raises ``OSError`` if the directory cannot be read."""
    found = Recovered([], Counter(), [])
    aborted = found.aborted
    for name, left in orphans(directory):
        found.records.append(name)
        found.sidecar_ids.extend(orphan.sidecar_id for orphan in left)
        skipped = 0
        for orphan in left:
            for engine_name, url, ids in orphan.engines:
                engine = adapters.get(engine_name)
                if engine is None or engine.base_url != url or not engine.aborts or not ids:
                    skipped += 1
                    log.warning("request %s left by a dead sidecar process (%s): engine %s at "
                                "%s is not in the config (or no longer at that url): its %d "
                                "id(s) are not aborted", orphan.sidecar_id, why, engine_name,
                                url, len(ids))
                    continue
                aborter.abort_orphan(engine, ids, orphan.sidecar_id, orphan.sent_at)
                aborted[engine_name] += 1
        if left:
            log.warning("%d request(s) left running by a dead sidecar process (%s; record %s): "
                        "aborting them%s; counted in cancel_sidecar_recovered_requests_total",
                        len(left), why, directory / f"{name}.log",
                        f" ({skipped} engine(s) skipped)" if skipped else "")
    return found
