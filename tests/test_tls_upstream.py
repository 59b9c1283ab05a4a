"""An engine served over TLS (``engines.*.url: https://...``), through the production wiring.

Both of the sidecar's connections to the engine speak TLS then:

- the relay's (:mod:`sidecar.pool`, ``UpstreamPool._connect``);
- the abort wire's (:mod:`sidecar.abort_wire`).

Both verify the engine's certificate with ``ssl.create_default_context()``: the system's trust
store, which OpenSSL also reads from ``SSL_CERT_FILE``. So a pod trusts a private CA by mounting
it and setting that variable. These tests:

- make their own CA and a certificate for 127.0.0.1 (the ``cryptography`` package, in the
  dev extra);
- point ``SSL_CERT_FILE`` at the CA;
- serve :class:`tests.fakes.engine.FakeEngine` over TLS.

What they check:

- a stream and a JSON answer arrive whole;
- keep-alive reuses one TLS connection;
- a client that resets mid-stream gets the engine's TLS connection closed and its engine id
  aborted over TLS;
- an engine whose certificate the sidecar cannot verify gets a 502 with an OpenAI-style JSON
  error, and nothing reaches it.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from sidecar.server import Servers
from tests.conftest import sidecar_settings
from tests.fakes.engine import FakeEngine
from tests.harness.support import CHAT, Stalls, one_abort, raw_client, request_body, upstream_closed

pytestmark = pytest.mark.timeout(60)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate it signed for ``127.0.0.1`` and ``localhost``, valid for a
    day. Returns the CA's PEM and the server's certificate and key PEM paths."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("cancel-sidecar test CA")
    ca = (x509.CertificateBuilder()
          .subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                         critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(_name("127.0.0.1")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    ca_path, cert_path, key_path = (directory / n for n in ("ca.pem", "engine.pem", "engine.key"))
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return ca_path, cert_path, key_path


@pytest.fixture
def certificates(tmp_path: Path) -> tuple[Path, Path, Path]:
    return make_certificates(tmp_path)


@pytest_asyncio.fixture
async def tls_engine(certificates: tuple[Path, Path, Path]) -> AsyncIterator[FakeEngine]:
    _, cert_path, key_path = certificates
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_path, key_path)
    fake = FakeEngine()
    await fake.start(tls=context)
    yield fake
    await fake.stop()


@pytest_asyncio.fixture
async def trusting_sidecar(tls_engine: FakeEngine, certificates: tuple[Path, Path, Path],
                           start_sidecar: Callable[..., Any],
                           monkeypatch: pytest.MonkeyPatch) -> Servers:
    """The sidecar in front of the TLS engine, with the test CA in ``SSL_CERT_FILE``."""
    monkeypatch.setenv("SSL_CERT_FILE", str(certificates[0]))
    assert tls_engine.url.startswith("https://"), tls_engine.url
    servers: Servers = await start_sidecar(sidecar_settings(tls_engine.url))
    return servers


def events(body: bytes) -> list[bytes]:
    return [line for line in body.split(b"\n") if line.startswith(b"data: ")]


async def test_stream_and_json_over_tls_arrive_whole(tls_engine: FakeEngine,
                                                     trusting_sidecar: Servers) -> None:
    url = f"http://127.0.0.1:{trusting_sidecar.proxy_port}{CHAT}"
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}?tokens=30&interval=0.001",
                          json={"messages": [], "stream": True}) as r:
            assert r.status == 200, f"expected 200 through the TLS engine, got {r.status}"
            stream = await r.read()
            rid = r.headers["X-Request-Id"]
        async with s.post(f"{url}?tokens=5&interval=0.001", json={"messages": []}) as r:
            assert r.status == 200, f"expected 200 for JSON, got {r.status}"
            answer = await r.json()
    got = events(stream)
    assert len(got) == 31 and got[-1] == b"data: [DONE]", (
        f"expected 30 events and [DONE] relayed from the TLS engine, got {len(got)}: {got[-2:]}")
    assert json.loads(got[0].removeprefix(b"data: "))["id"] == rid, (
        f"expected the engine's first event to name the sidecar id {rid}, got {got[0]!r}")
    assert answer["choices"][0]["text"] == "xxxxx", f"expected the engine's JSON, got {answer}"
    assert [g.finished for g in tls_engine.record.generations] == [True, True], (
        f"expected both generations finished at the engine, got {tls_engine.record.generations}")


async def test_tls_connection_is_kept_alive_and_reused(tls_engine: FakeEngine,
                                                       trusting_sidecar: Servers) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.get(f"http://127.0.0.1:{trusting_sidecar.proxy_port}/peer") as r:
                assert r.status == 200, f"expected 200 from /peer, got {r.status}"
                await r.read()
    assert len(tls_engine.peers) == 3 and len(set(tls_engine.peers)) == 1, (
        f"expected three requests on one kept-alive TLS connection, got client ports "
        f"{tls_engine.peers}")


async def test_reset_mid_stream_closes_the_tls_upstream_and_aborts_over_tls(
        tls_engine: FakeEngine, trusting_sidecar: Servers, stalls: Stalls) -> None:
    port = trusting_sidecar.proxy_port
    async with raw_client(port, stalls) as client:
        client.send("POST", f"{CHAT}?tokens=1000&interval=0.01",
                    request_body({"messages": []}, stream=True))
        status, head = await client.head()
        assert status == 200, f"expected 200, got {status}"
        await client.read_until(b"data:")
        left_at = client.disconnect("rst")
        closed_at = await upstream_closed(tls_engine, stalls)
        ids, aborted_at = await one_abort(tls_engine, stalls, port)
    rid = head["X-Request-Id"]
    assert ids == [f"chatcmpl-{rid}"], f"expected the abort to name chatcmpl-{rid}, got {ids}"
    stalls.check("client reset -> TLS upstream closed", left_at, closed_at)
    stalls.check("client reset -> abort call over TLS", left_at, aborted_at)
    generation = tls_engine.record.generations[-1]
    assert generation.events_sent < 1000, (
        f"expected the generation cut short, it sent {generation.events_sent} events")


async def test_engine_certificate_not_trusted_is_a_502_and_nothing_reaches_it(
        tls_engine: FakeEngine, start_sidecar: Callable[..., Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)  # the system store: not our test CA
    servers: Servers = await start_sidecar(sidecar_settings(tls_engine.url))
    async with aiohttp.ClientSession() as s, s.post(
            f"http://127.0.0.1:{servers.proxy_port}{CHAT}",
            json={"messages": [], "stream": True}) as r:
        status, body = r.status, await r.json(content_type=None)
    assert status == 502, f"expected 502 for an engine that cannot be verified, got {status}"
    error = body.get("error", {})
    assert error.get("type") and "certificate" in error.get("message", "").lower(), (
        f"expected an OpenAI-style error naming the certificate, got {body}")
    assert tls_engine.record.generations == [], (
        f"expected nothing to reach the engine, got {tls_engine.record.generations}")
