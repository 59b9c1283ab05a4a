"""The container image, built from the Dockerfile and run as a user runs it (marker ``image``).

Podman (Debian's 4.3, as root, runtime ``runc``) builds the Dockerfile and runs the image with
``--network host`` and a mounted config in front of the fake engine, which runs in this test
process on 127.0.0.1. Registry images cannot be pulled on the project's CI machines, so the
Dockerfile's ``BASE`` is a stand-in built here from Debian's packages (``mmdebstrap``: bookworm
minbase with Python 3.11 and pip, PEP 668 marker removed, ``python``/``pip`` links), imported
once under :data:`BASE_TAG` and reused by later runs. The build gets this machine's pip
configuration and CA bundle mounted read-only (its package index may be a local mirror).

Skipped, with the reason, without podman, runc or mmdebstrap, or when not root; ``.ci/run``
installs them (``apt-get install podman runc mmdebstrap``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from sidecar.server import ReadyLine
from tests.fakes.engine import FakeEngine, flood_sha256
from tests.fakes.kinds import LINGER_S, VLLMEngine, Work

ROOT = Path(__file__).resolve().parent.parent
BASE_TAG = "localhost/cancel-sidecar-test-base:bookworm"
IMAGE_TAG = "localhost/cancel-sidecar:ci"
IMAGE_UID = 10001  # the Dockerfile's USER
MMDEBSTRAP_S = 900.0  # guard: the stand-in base (~30 s to a few minutes, mostly downloads)
BUILD_S = 900.0  # guard: the image build (~20-60 s here)
READY_S = 60.0  # the container's ready line
EXIT_S = 30.0  # exit after SIGTERM, or after a bad config
# What the image's sidecar layers may add to the base (measured here: ~54 MB); a much larger
# image means something unintended (a compiler, a cache) went in.
MAX_ADDED_BYTES = 150 * 1024 * 1024

_MISSING = [tool for tool in ("podman", "runc", "mmdebstrap") if shutil.which(tool) is None]

pytestmark = [
    pytest.mark.image,
    # The first test also builds the base and the image (module fixture): minutes, not 120 s.
    pytest.mark.timeout(MMDEBSTRAP_S + BUILD_S + 300),
    pytest.mark.skipif(bool(_MISSING), reason=f"not installed: {', '.join(_MISSING)} "
                       "(Debian: apt-get install podman runc mmdebstrap)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="podman runs here as root only"),
]


@dataclass
class Podman:
    """The podman command line with this module's containers.conf and runtime."""

    env: dict[str, str]

    def run(self, *args: str, timeout_s: float = 60.0, check: bool = True
            ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(["podman", *args], env=self.env, capture_output=True, text=True,
                                timeout=timeout_s, check=False)
        if check:
            assert result.returncode == 0, (
                f"expected `podman {' '.join(args)}` to exit 0, got {result.returncode}:\n"
                f"{result.stdout}{result.stderr}")
        return result

    def size(self, tag: str) -> int:
        return int(self.run("image", "inspect", "--format", "{{.Size}}", tag).stdout)


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Podman:
    conf = tmp_path_factory.mktemp("podman") / "containers.conf"
    # The default ulimits ask for rlimits these machines refuse; runc, not crun (crun fails on
    # the hybrid cgroup hierarchy here).
    conf.write_text('[containers]\ndefault_ulimits = []\n\n[engine]\nruntime = "runc"\n')
    return Podman({**os.environ, "CONTAINERS_CONF": str(conf)})


def _build_base(podman: Podman, tmp: Path) -> None:
    tar = tmp / "base.tar"
    hook = ('rm -f "$1"/usr/lib/python3.11/EXTERNALLY-MANAGED; '
            'ln -sf python3 "$1"/usr/bin/python; '
            'test -e "$1"/usr/bin/pip || ln -s pip3 "$1"/usr/bin/pip')
    result = subprocess.run(
        ["mmdebstrap", "--variant=minbase",
         "--include=python3.11,python3-venv,python3-pip,ca-certificates",
         f"--customize-hook={hook}", "bookworm", str(tar)],
        capture_output=True, text=True, timeout=MMDEBSTRAP_S, check=False)
    assert result.returncode == 0, (
        f"expected mmdebstrap to build the stand-in base, got exit {result.returncode}:\n"
        f"{result.stderr[-4000:]}")
    podman.run("import", str(tar), BASE_TAG, timeout_s=300)
    tar.unlink()


def _read_only_mounts() -> list[str]:
    """This machine's pip configuration and CA bundle, for the build's ``pip`` steps."""
    mounts = []
    for path in ("/etc/pip.conf", "/etc/xdg/pip", "/etc/ssl/certs"):
        if os.path.exists(path):
            mounts += ["-v", f"{path}:{path}:ro"]
    return mounts


@pytest.fixture(scope="module")
def image(podman: Podman, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The image built from the Dockerfile on the stand-in base; its tag."""
    if podman.run("image", "exists", BASE_TAG, check=False).returncode != 0:
        _build_base(podman, tmp_path_factory.mktemp("base"))
    started = time.monotonic()
    podman.run("build", "--runtime", "runc", "--network", "host", "--pull=never",
               "--format", "docker",  # podman's own format drops HEALTHCHECK
               "--build-arg", f"BASE={BASE_TAG}", *_read_only_mounts(),
               "-t", IMAGE_TAG, "-f", str(ROOT / "Dockerfile"), str(ROOT), timeout_s=BUILD_S)
    print(f"image built in {time.monotonic() - started:.0f} s: {podman.size(IMAGE_TAG)} bytes "
          f"(base {podman.size(BASE_TAG)} bytes)", file=sys.stderr)
    return IMAGE_TAG


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Container:
    """``podman run`` attached: the container's stdout/stderr are the process's."""

    def __init__(self, podman: Podman, name: str, proc: asyncio.subprocess.Process) -> None:
        self.podman = podman
        self.name = name
        self.proc = proc
        self.stderr_lines: list[str] = []
        self.proxy_port = 0
        self.admin_port = 0
        self._reader: asyncio.Task[None] | None = None

    @property
    def stderr(self) -> str:
        return "".join(self.stderr_lines)

    async def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            self.stderr_lines.append(line.decode(errors="replace"))

    async def podman_async(self, *args: str, timeout_s: float = 30.0) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            "podman", *args, env=self.podman.env, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
        assert proc.returncode is not None
        return proc.returncode, out.decode(errors="replace")

    async def wait_exit(self, within_s: float = EXIT_S) -> int:
        try:
            code = await asyncio.wait_for(self.proc.wait(), within_s)
        except TimeoutError:
            raise AssertionError(f"expected the container to exit within {within_s} s, it did "
                                 f"not; stderr:\n{self.stderr}") from None
        if self._reader is not None:
            await asyncio.wait_for(self._reader, within_s)
        return code


@asynccontextmanager
async def container(podman: Podman, image: str, config: Path, *, env: dict[str, str] | None = None,
                    volumes: Sequence[str] = (), wait_ready: bool = True
                    ) -> AsyncIterator[Container]:
    """``podman run --rm --network host -v CONFIG:/etc/cancel-sidecar/sidecar.yaml:ro IMAGE``,
    plus ``-v`` for each of ``volumes`` (``SOURCE:DEST[:OPTIONS]``); with ``wait_ready`` reads
    the sidecar's ready line first. Removed at the end if still up."""
    name = f"cancel-sidecar-test-{uuid.uuid4().hex[:12]}"
    env_args = [a for k, v in (env or {}).items() for a in ("-e", f"{k}={v}")]
    volume_args = [a for v in volumes for a in ("-v", v)]
    proc = await asyncio.create_subprocess_exec(
        "podman", "run", "--rm", "--name", name, "--runtime", "runc", "--network", "host",
        *env_args, *volume_args, "-v", f"{config}:/etc/cancel-sidecar/sidecar.yaml:ro", image,
        env=podman.env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    box = Container(podman, name, proc)
    box._reader = asyncio.get_running_loop().create_task(box._read_stderr(),
                                                         name=f"stderr of {name}")
    try:
        if wait_ready:
            assert proc.stdout is not None
            try:
                line = (await asyncio.wait_for(proc.stdout.readline(), READY_S)).decode()
            except TimeoutError:
                line = ""
            ready = ReadyLine.parse(line)
            assert ready is not None and ready.admin_port is not None, (
                f"expected the container's ready line (proxy and admin addresses) within "
                f"{READY_S} s, got {line!r}; stderr:\n{box.stderr}")
            box.proxy_port, box.admin_port = ready.proxy_port, ready.admin_port
        yield box
    finally:
        if proc.returncode is None:
            with suppress(AssertionError, TimeoutError):
                await box.podman_async("rm", "-f", "-t", "0", name)
            with suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        if box._reader is not None:
            with suppress(TimeoutError):
                await asyncio.wait_for(box._reader, 5)


def _config(tmp_path: Path, engine_url: str, admin_port: int, **sections: Any) -> Path:
    tree: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": admin_port},
        "engines": {"local": {"kind": "vllm", "url": engine_url, "abort": {"timeout_s": 2.0}}},
        "routes": [{"prefix": "/", "engine": "local"}],
        "lifecycle": {"grace_period_s": 20.0},
    }
    tree.update(sections)
    path = tmp_path / "sidecar.yaml"
    path.write_text(yaml.safe_dump(tree))
    path.chmod(0o644)  # the container's user 10001 reads it
    return path


@pytest.fixture
def running_config(tmp_path: Path, engine: FakeEngine) -> Iterator[tuple[Path, int]]:
    admin = _free_port()
    yield _config(tmp_path, engine.url, admin), admin


async def test_image_serves_relays_aborts_and_drains_as_non_root(
        podman: Podman, image: str, engine: FakeEngine,
        running_config: tuple[Path, int]) -> None:
    config, admin = running_config
    health_url = f"http://127.0.0.1:{admin}/healthz"
    async with container(podman, image, config,
                         env={"CANCEL_SIDECAR_HEALTHCHECK_URL": health_url}) as box, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        proxy = f"http://127.0.0.1:{box.proxy_port}"
        assert box.admin_port == admin, f"expected admin on {admin}, got {box.admin_port}"

        async with session.get(health_url) as resp:
            assert resp.status == 200, f"expected /healthz 200, got {resp.status}"
        async with session.get(f"http://127.0.0.1:{admin}/readyz") as resp:
            body = await resp.json()
            assert resp.status == 200 and body["ready"], (
                f"expected /readyz 200 ready, got {resp.status} {body}")

        # The process in the container runs as the image's user, seen from the host.
        code, out = await box.podman_async("inspect", "--format", "{{.State.Pid}}", box.name)
        assert code == 0, f"expected podman inspect to work, got {code}: {out}"
        uids = psutil.Process(int(out.strip())).uids()
        assert (uids.real, uids.effective) == (IMAGE_UID, IMAGE_UID), (
            f"expected the sidecar to run as uid {IMAGE_UID}, got {uids}")

        # The image's HEALTHCHECK command, run by podman inside the container.
        code, out = await box.podman_async("healthcheck", "run", box.name)
        assert code == 0, f"expected `podman healthcheck run` to pass, got {code}: {out}"

        # A stream relayed byte for byte (4 MiB of SSE, as fast as it goes).
        size = 4 * 1024 * 1024
        async with session.get(f"{proxy}/flood?size={size}") as resp:
            digest = hashlib.sha256()
            length = 0
            async for chunk in resp.content.iter_any():
                digest.update(chunk)
                length += len(chunk)
        assert (length, digest.hexdigest()) == flood_sha256(size), (
            f"expected the /flood body byte for byte {flood_sha256(size)}, got "
            f"{(length, digest.hexdigest())}")

        # A client disconnect mid-stream reaches the engine's abort endpoint.
        resp = await session.post(f"{proxy}/v1/chat/completions?tokens=2000&interval=0.01",
                                  json={"model": "m", "stream": True, "messages": []})
        first = await asyncio.wait_for(resp.content.readline(), 10)
        assert first.startswith(b"data: "), f"expected an SSE event, got {first!r}"
        resp.close()  # the client leaves
        record = await engine.record.wait_abort(guard_s=10)
        started = engine.record.generations[-1].request_id
        # vLLM's chat route runs it as chatcmpl-<id> (engine.vllm).
        assert f"chatcmpl-{started}" in record.ids, (
            f"expected an abort naming chatcmpl-{started}, got {engine.record.aborts}")

        # SIGTERM while a stream runs: the stream finishes (drain), then exit 0.
        resp = await session.post(f"{proxy}/v1/chat/completions?tokens=40&interval=0.05",
                                  json={"model": "m", "stream": True, "messages": []})
        first = await asyncio.wait_for(resp.content.readline(), 10)
        assert first.startswith(b"data: "), f"expected an SSE event, got {first!r}"
        code, out = await box.podman_async("kill", "--signal", "TERM", box.name)
        assert code == 0, f"expected podman kill -s TERM to work, got {code}: {out}"
        rest = await asyncio.wait_for(resp.read(), 20)
        assert rest.endswith(b"data: [DONE]\n\n"), (
            f"expected the stream to finish after SIGTERM, got its end {rest[-200:]!r}")
        code = await box.wait_exit()
        assert code == 0, f"expected exit 0 after SIGTERM, got {code}; stderr:\n{box.stderr}"
        assert re.search(r"stopped in [\d.]+ s \(1 request\(s\) finished during the drain",
                         box.stderr), f"expected a drain of one request, got:\n{box.stderr}"


async def test_image_refuses_a_bad_mounted_config_with_located_errors(
        podman: Podman, image: str, tmp_path: Path) -> None:
    config = _config(tmp_path, "http://127.0.0.1:9", _free_port(),
                     listen={"host": "127.0.0.1", "port": 70000},
                     routes=[{"prefix": "/", "engine": "nowhere"}])
    async with container(podman, image, config, wait_ready=False) as box:
        code = await box.wait_exit()
    assert code == 1, f"expected exit 1 for a bad config, got {code}; stderr:\n{box.stderr}"
    # Each problem: its dotted location, its line in the file, what is wrong.
    for located in (r"listen\.port: line \d+: ",
                    r"routes\.0\.engine: line \d+: names no defined engine"):
        assert re.search(located, box.stderr), (
            f"expected {located!r} on stderr, got:\n{box.stderr}")


# --- a killed container and its restart -------------------------------------------------------

RECORD_DIR = "/var/lib/cancel-sidecar"  # the image's lifecycle.record_dir: $XDG_STATE_HOME/...
# Long enough that nothing ends on its own during a test: 2000 tokens 50 ms apart (100 s).
LONG = "tokens=2000&interval=0.05"
# What the load runs: (path, body) each, all streaming but the JSON chats; the completions
# carry 3 prompts each (3 engine ids).
LOAD = ([("/v1/chat/completions", {"messages": [], "stream": True})] * 4
        + [("/v1/chat/completions", {"messages": [], "stream": False})] * 2
        + [("/v1/completions", {"prompt": ["a", "b", "c"], "stream": True})] * 2)
QUIET_AFTER_RESTART_S = 2.0  # nothing runs at the engine this long after the restart listens


@pytest.fixture
async def blind_engine() -> AsyncIterator[VLLMEngine]:
    """The vLLM fake of :mod:`tests.fakes.kinds`: it generates blind to its connections, so a
    request whose client is gone runs on until an abort names its ids (or ``LINGER_S``)."""
    fake = VLLMEngine(seed=25)
    await fake.start()
    yield fake
    await fake.stop()


@pytest.fixture
def record_volume(podman: Podman) -> Iterator[str]:
    """A named podman volume, removed at the end."""
    name = f"cancel-sidecar-test-{uuid.uuid4().hex[:12]}"
    podman.run("volume", "create", name)
    yield name
    podman.run("volume", "rm", "--force", name, check=False)


def _live_records(logs: str) -> dict[str, list[str]]:
    """The requests a record's ``.log`` text (every file of the directory, one after another:
    sequence numbers are per file, so one file is expected) names as not over: sidecar id ->
    its engine ids (:mod:`sidecar.inflight`: ``+SEQ JSON`` when sent, ``-SEQ`` when over)."""
    live: dict[str, tuple[str, list[str]]] = {}
    for line in logs.splitlines():
        if line.startswith("-"):
            live.pop(line[1:], None)
        elif line.startswith("+"):
            seq, _, body = line[1:].partition(" ")
            entry = json.loads(body)
            live[seq] = (entry["sidecar_id"], [i for e in entry["engines"] for i in e["ids"]])
    return dict(live.values())


def _read_logs(directory: Path) -> str:
    return "".join(p.read_text() for p in sorted(directory.glob("*.log")))


async def _load_then_kill(box: Container, fake: VLLMEngine,
                          read_record: Callable[[], Awaitable[str]]
                          ) -> tuple[list[Work], dict[str, list[str]], float]:
    """Run :data:`LOAD` through the container until the engine runs all of it and the record
    names all of it, then ``podman kill --signal KILL``: the works it left, the record's live
    requests just before the kill, and the kill's ``time.monotonic()``."""
    proxy = f"http://127.0.0.1:{box.proxy_port}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def client(path: str, body: dict[str, Any]) -> None:
            async with session.post(f"{proxy}{path}?{LONG}", json={"model": "m", **body}) as r:
                await r.read()  # until the kill cuts it

        clients = [asyncio.ensure_future(client(path, body)) for path, body in LOAD]
        try:
            everything_runs = await fake.watch.until(
                lambda: len(fake.works) == len(LOAD) and all(
                    w.running and w.registered_at is not None for w in fake.works), 10)
            assert everything_runs, (
                f"expected the engine to run all {len(LOAD)} requests within 10 s, got "
                f"{[(w.path, w.running) for w in fake.works]}; stderr:\n{box.stderr}")
            ids = sorted(i for w in fake.works for i in w.engine_ids)
            # The record's line is written as the body goes upstream: poll the file for it.
            deadline = time.monotonic() + 5
            while True:
                record = _live_records(await read_record())
                if sorted(i for r in record.values() for i in r) == ids:
                    break
                assert time.monotonic() < deadline, (
                    f"expected the record in {RECORD_DIR} to name the engine ids {ids} within "
                    f"5 s, it names {record}")
                await asyncio.sleep(0.05)
            code, out = await box.podman_async("kill", "--signal", "KILL", box.name)
            killed = time.monotonic()
            assert code == 0, f"expected podman kill --signal KILL to work, got {code}: {out}"
            code = await box.wait_exit()
            assert code == 137, f"expected exit 137 (SIGKILL), got {code}; stderr:\n{box.stderr}"
        except BaseException:
            for task in clients:  # the container still serves them
                task.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
            raise
        results = await asyncio.wait_for(asyncio.gather(*clients, return_exceptions=True), 30)
        assert all(isinstance(r, aiohttp.ClientError) for r in results), (
            f"expected every client cut by the kill, got {results}")
    return list(fake.works), record, killed


async def _recovered(admin_port: int) -> float:
    """``cancel_sidecar_recovered_requests_total{reason="found_at_start"}``, summed."""
    async with aiohttp.ClientSession() as session, session.get(
            f"http://127.0.0.1:{admin_port}/metrics") as resp:
        text = await resp.text()
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == "cancel_sidecar_recovered_requests_total"
               and sample.labels.get("reason") == "found_at_start")


async def test_a_killed_container_s_work_is_aborted_by_its_restart_with_the_record_volume(
        podman: Podman, image: str, blind_engine: VLLMEngine, record_volume: str,
        tmp_path: Path) -> None:
    """SIGKILL to the container with streams and JSON requests in flight, then a new container
    with the same named volume at the record directory: before it listens it aborts everything
    the dead one left, so nothing runs at the engine 2 s after it listens."""
    fake = blind_engine
    config = _config(tmp_path, fake.url, _free_port())
    mountpoint = Path(podman.run("volume", "inspect", "--format", "{{.Mountpoint}}",
                                 record_volume).stdout.strip())
    volumes = [f"{record_volume}:{RECORD_DIR}"]

    async def read_record() -> str:
        return await asyncio.to_thread(_read_logs, mountpoint)

    async with container(podman, image, config, volumes=volumes) as box:
        # A new volume takes the image directory's owner and mode.
        stat = await asyncio.to_thread(mountpoint.stat)
        assert (stat.st_uid, stat.st_mode & 0o777) == (IMAGE_UID, 0o700), (
            f"expected the volume at {RECORD_DIR} owned by uid {IMAGE_UID}, mode 0700 (the "
            f"image's directory), got uid {stat.st_uid} mode {stat.st_mode & 0o777:o}")
        works, record, killed = await _load_then_kill(box, fake, read_record)
    async with container(podman, image, config, volumes=volumes) as again:
        listening = time.monotonic()
        quiet = await fake.watch.until(lambda: not any(w.running for w in works),
                                       QUIET_AFTER_RESTART_S)
        running = [w.engine_ids for w in works if w.running]
        assert quiet, (
            f"expected nothing running at the engine {QUIET_AFTER_RESTART_S} s after the "
            f"restarted container listened, got {running}; stderr:\n{again.stderr}")
        not_aborted = [w.engine_ids for w in works if set(w.aborted) != set(w.engine_ids)]
        assert not not_aborted, (
            f"expected every engine id the killed container left to be stopped by an abort, "
            f"got these ended otherwise: {not_aborted}")
        recovered = await _recovered(again.admin_port)
        assert recovered == len(record) == len(LOAD), (
            f'expected cancel_sidecar_recovered_requests_total{{reason="found_at_start"}} '
            f"{len(LOAD)} (the requests the record named: {len(record)}), got {recovered}")
        assert "left running by a dead sidecar process" in again.stderr, (
            f"expected the restart to log what it aborts, got:\n{again.stderr}")
        code, out = await again.podman_async("kill", "--signal", "TERM", again.name)
        assert code == 0, f"expected podman kill -s TERM to work, got {code}: {out}"
        code = await again.wait_exit()
        assert code == 0, f"expected exit 0 after SIGTERM, got {code}; stderr:\n{again.stderr}"
    left = await asyncio.to_thread(lambda: sorted(p.name for p in mountpoint.iterdir()))
    stops = [w.stopped_at - listening for w in works if w.stopped_at is not None]
    print(f"killed container -> restarted container listening {listening - killed:.2f} s; "
          f"its {len(works)} requests stopped by aborts {min(stops) * 1000:+.0f} to "
          f"{max(stops) * 1000:+.0f} ms from then; left in the volume after its clean exit: "
          f"{left}", file=sys.stderr)
    assert not left, f"expected the volume empty after the clean exit, got {left}"


async def test_a_killed_container_s_work_runs_on_after_a_restart_without_the_volume(
        podman: Podman, image: str, blind_engine: VLLMEngine, tmp_path: Path) -> None:
    """The same without a volume: the record was written, inside the killed container, and is
    gone with it; the new container aborts nothing and the engine runs the work on (the fake
    engine runs a request nobody aborts for ``LINGER_S`` after its connection closed)."""
    fake = blind_engine
    config = _config(tmp_path, fake.url, _free_port())
    async with container(podman, image, config) as box:

        async def read_record() -> str:
            code, out = await box.podman_async("exec", box.name, "sh", "-c",
                                               f"cat {RECORD_DIR}/*.log")
            assert code == 0, f"expected the record in {RECORD_DIR} to be readable, got {out}"
            return out

        works, record, killed = await _load_then_kill(box, fake, read_record)
    assert len(record) == len(LOAD), f"expected {len(LOAD)} requests in the record, got {record}"
    async with container(podman, image, config) as again:
        listening = time.monotonic()
        quiet = await fake.watch.until(lambda: not any(w.running for w in works),
                                       QUIET_AFTER_RESTART_S)
        elapsed = time.monotonic() - killed
        assert elapsed < LINGER_S, (
            f"expected the restart within {LINGER_S} s of the kill (the fake engine's limit on "
            f"a request nobody aborts), took {elapsed:.1f} s: this check cannot tell")
        assert not quiet and all(w.running for w in works), (
            f"expected all {len(works)} requests still running at the engine "
            f"{QUIET_AFTER_RESTART_S} s after a restart without the record, got "
            f"{[(w.engine_ids, w.running) for w in works]}")
        recovered = await _recovered(again.admin_port)
        assert recovered == 0, f"expected nothing recovered, got {recovered}"
    print(f"without the volume: killed container -> restarted container listening "
          f"{listening - killed:.2f} s; {len(works)} requests still running "
          f"{QUIET_AFTER_RESTART_S} s later", file=sys.stderr)


def test_image_size(podman: Podman, image: str) -> None:
    total, base = podman.size(image), podman.size(BASE_TAG)
    print(f"image {total / 1e6:.0f} MB, of which the sidecar's layers {(total - base) / 1e6:.0f} "
          f"MB over the base", file=sys.stderr)
    assert total - base <= MAX_ADDED_BYTES, (
        f"expected the sidecar's layers to add at most {MAX_ADDED_BYTES} bytes, got "
        f"{total - base} ({total} - base {base})")
