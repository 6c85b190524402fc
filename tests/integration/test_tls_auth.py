"""TLS, mTLS and bearer tokens against real servers, with certificates made for the test.

The PKI: a CA, a server certificate for localhost and 127.0.0.1 (SANs), a client certificate
from the same CA, and a client certificate from another CA.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support import ServerProcess, job_spec, write_config
from tokenfeed.client import AsyncClient, Client, TokenfeedClientError
from tokenfeed.client.fleet import rendezvous

TOKEN, OTHER_JOB_TOKEN, ENV_TOKEN = "tok-alpha-7f3e", "tok-scoped-91ab", "tok-env-5c2d"
# Failures to connect are retried until the call's timeout: keep it short.
FAIL_FAST = {"timeout": 2.0, "attempt_timeout": 0.5}


# ---------------------------------------------------------------- certificates


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _builder(subject: str, issuer: x509.Name, key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _ca(cn: str):
    key = _key()
    cert = (
        _builder(cn, _name(cn), key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf(ca, cn: str, server: bool):
    ca_key, ca_cert = ca
    key = _key()
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        _builder(cn, ca_cert.subject, key)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if server:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


@dataclass(frozen=True)
class Pki:
    ca: Path
    other_ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path  # a client certificate signed by the other CA
    stranger_key: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    root = tmp_path_factory.mktemp("pki")

    def write(name: str, obj) -> Path:
        if isinstance(obj, x509.Certificate):
            data = obj.public_bytes(serialization.Encoding.PEM)
        else:
            data = obj.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        (root / name).write_bytes(data)
        return root / name

    ca, other = _ca("tokenfeed test CA"), _ca("another CA")
    server, client, stranger = (
        _leaf(ca, "tokenfeed", True),
        _leaf(ca, "trainer", False),
        _leaf(other, "trainer", False),
    )
    return Pki(
        ca=write("ca.pem", ca[1]),
        other_ca=write("other-ca.pem", other[1]),
        server_cert=write("server.pem", server[1]),
        server_key=write("server.key", server[0]),
        client_cert=write("client.pem", client[1]),
        client_key=write("client.key", client[0]),
        stranger_cert=write("stranger.pem", stranger[1]),
        stranger_key=write("stranger.key", stranger[0]),
    )


# ---------------------------------------------------------------- servers


def _start(tmp: Path, corpus: Path, jobs=("main",), **server) -> ServerProcess:
    specs = {name: job_spec([corpus / "*"], seed=11 + i) for i, name in enumerate(jobs)}
    cfg = write_config(tmp / "tf.yaml", specs, tmp / "cache", **server)
    return ServerProcess(cfg, tmp / "server.log")


def _wait_ready(proc: ServerProcess, jobs=("main",), **credentials) -> None:
    with Client(proc.address, **credentials) as c:
        for job in jobs:
            deadline = time.monotonic() + 60
            while (state := c.describe(job)["state"]) == "JOB_STATE_INDEXING":
                assert time.monotonic() < deadline, proc.log()
                time.sleep(0.05)
            assert state == "JOB_STATE_READY", proc.log()


def _ready_file(proc: ServerProcess) -> dict:
    return json.loads(proc.ready.read_text())


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, corpus, pki):
    tmp = tmp_path_factory.mktemp("tls")
    tls = {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key)}
    proc = _start(tmp, corpus, metrics_listen="127.0.0.1:0", tls=tls)
    _wait_ready(proc, tls_root_certs=pki.ca)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory, corpus, pki):
    tmp = tmp_path_factory.mktemp("mtls")
    proc = _start(
        tmp,
        corpus,
        tls={
            "cert_file": str(pki.server_cert),
            "key_file": str(pki.server_key),
            "client_ca_file": str(pki.ca),
        },
    )
    _wait_ready(
        proc, tls_root_certs=pki.ca, tls_client_cert=pki.client_cert, tls_client_key=pki.client_key
    )
    yield proc
    assert proc.stop() == 0, proc.log()


def _write_tokens(path: Path, text: str) -> None:
    """Replaces the file the way a Secret volume or an editor's save does: a new file renamed."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


@pytest.fixture(scope="module")
def token_servers(tmp_path_factory, corpus, pki):
    """Two servers with TLS and the same tokens file (plus a token from the environment),
    jobs `main` and `other`, and a plaintext health port each."""
    tmp = tmp_path_factory.mktemp("tokens")
    tokens = tmp / "tokens"
    _write_tokens(tokens, f"# trainers\n{TOKEN}\n\n{OTHER_JOB_TOKEN}:other  # one job only\n")
    procs = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TF_TEST_TOKENS", ENV_TOKEN)
        for i in range(2):
            (tmp / str(i)).mkdir()
            procs.append(
                _start(
                    tmp / str(i),
                    corpus,
                    jobs=("main", "other"),
                    health_listen="127.0.0.1:0",
                    tls={"cert_file": str(pki.server_cert), "key_file": str(pki.server_key)},
                    auth={"tokens_file": str(tokens), "tokens_env": "TF_TEST_TOKENS"},
                )
            )
    for proc in procs:
        _wait_ready(proc, ("main", "other"), tls_root_certs=pki.ca, token=TOKEN)
    yield procs, tokens
    for proc in procs:
        assert proc.stop() == 0, proc.log()


def _code(excinfo) -> grpc.StatusCode:
    return excinfo.value.code


# ---------------------------------------------------------------- TLS


def test_tls_client_gets_batches(tls_server, pki):
    with Client(tls_server.address, job="main", tls_root_certs=pki.ca) as c:
        batch = c.get_batch(3, rank=1, world_size=2)
        streamed = [b.fingerprint for b in c.iter_batches(0, 4)]
    # The root certificate may also be given as PEM bytes.
    with Client(tls_server.address, job="main", tls_root_certs=pki.ca.read_bytes()) as c:
        assert c.get_batch(3, rank=1, world_size=2).fingerprint == batch.fingerprint
        assert [c.get_batch(s).fingerprint for s in range(4)] == streamed
    assert batch["input_ids"].shape == (4, 64)


def test_plaintext_client_cannot_talk_to_a_tls_server(tls_server):
    with Client(tls_server.address, job="main", **FAIL_FAST) as c:
        with pytest.raises(TokenfeedClientError) as e:
            c.get_batch(0)
    assert _code(e) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("roots", ["other_ca", "system"])
def test_client_refuses_a_server_its_roots_do_not_vouch_for(tls_server, pki, roots):
    creds = {"tls": True} if roots == "system" else {"tls_root_certs": getattr(pki, roots)}
    with Client(tls_server.address, job="main", **creds, **FAIL_FAST) as c:
        with pytest.raises(TokenfeedClientError) as e:
            c.get_batch(0)
    assert _code(e) == grpc.StatusCode.UNAVAILABLE


def test_metrics_port_stays_plain_http_and_binds_to_localhost(tls_server):
    host, _, port = _ready_file(tls_server)["metrics"].rpartition(":")
    assert host == "127.0.0.1"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert b"tokenfeed_" in r.read()


# ---------------------------------------------------------------- mTLS


def test_mtls_client_with_a_certificate_from_the_ca_gets_batches(mtls_server, tls_server, pki):
    with Client(
        mtls_server.address,
        job="main",
        tls_root_certs=pki.ca,
        tls_client_cert=pki.client_cert,
        tls_client_key=pki.client_key,
    ) as c:
        batch = c.get_batch(5)
    with Client(tls_server.address, job="main", tls_root_certs=pki.ca) as c:
        assert c.get_batch(5).fingerprint == batch.fingerprint  # same job, same bytes


@pytest.mark.parametrize("client", ["no certificate", "another CA's certificate"])
def test_mtls_refuses_clients_without_a_certificate_from_the_ca(mtls_server, pki, client):
    creds = {"tls_root_certs": pki.ca}
    if client != "no certificate":
        creds |= {"tls_client_cert": pki.stranger_cert, "tls_client_key": pki.stranger_key}
    with Client(mtls_server.address, job="main", **creds, **FAIL_FAST) as c:
        with pytest.raises(TokenfeedClientError) as e:
            c.get_batch(0)
    assert _code(e) == grpc.StatusCode.UNAVAILABLE


# ---------------------------------------------------------------- tokens


def test_no_or_wrong_token_is_unauthenticated_and_says_what_to_send(token_servers, pki):
    (server, _), _ = token_servers
    for creds in ({}, {"token": "not-a-token"}):
        with Client(server.address, job="main", tls_root_certs=pki.ca, **creds) as c:
            with pytest.raises(TokenfeedClientError) as e:
                c.get_batch(0)
            assert _code(e) == grpc.StatusCode.UNAUTHENTICATED, creds
            assert "authorization: Bearer <token>" in str(e.value)
            with pytest.raises(TokenfeedClientError) as e:  # streams too
                next(iter(c.iter_batches(0, 2)))
            assert _code(e) == grpc.StatusCode.UNAUTHENTICATED
    assert "refused" in server.log() and "unauthenticated" in server.log()
    assert TOKEN not in server.log() and "not-a-token" not in server.log()


def test_right_token_gets_batches_from_file_or_environment(token_servers, pki, tls_server):
    (server, _), _ = token_servers
    with Client(tls_server.address, job="main", tls_root_certs=pki.ca) as c:
        expected = c.get_batch(2).fingerprint  # the same job definition on a TLS-only server
    for token in (TOKEN, ENV_TOKEN):
        with Client(server.address, job="main", tls_root_certs=pki.ca, token=token) as c:
            assert c.get_batch(2).fingerprint == expected
            assert len(list(c.iter_batches(0, 3))) == 3
            assert {j["name"] for j in c.list_jobs()} == {"main", "other"}


def test_a_token_limited_to_a_job_is_denied_the_others(token_servers, pki):
    (server, _), _ = token_servers
    with Client(server.address, tls_root_certs=pki.ca, token=OTHER_JOB_TOKEN) as c:
        assert c.get_batch(0, job="other").step == 0
        assert len(list(c.iter_batches(0, 2, job="other"))) == 2
        assert c.describe("other")["name"] == "other"
        for call in (
            lambda: c.get_batch(0, job="main"),
            lambda: c.describe("main"),
            lambda: next(iter(c.iter_batches(0, 2, job="main"))),
        ):
            with pytest.raises(TokenfeedClientError) as e:
                call()
            assert _code(e) == grpc.StatusCode.PERMISSION_DENIED
            assert "'main'" in str(e.value)


def _health(channel: grpc.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def test_health_needs_no_token_and_has_a_plaintext_port(token_servers, pki):
    (server, _), _ = token_servers
    serving = health_pb2.HealthCheckResponse.SERVING
    creds = grpc.ssl_channel_credentials(pki.ca.read_bytes())
    with grpc.secure_channel(server.address, creds) as channel:
        assert _health(channel) == serving
        assert _health(channel, "tokenfeed.v1.TokenFeed") == serving
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(), timeout=10
        )
        assert next(watch).status == serving
        watch.cancel()
    # The probe port: plaintext, health only.
    with grpc.insecure_channel(_ready_file(server)["health"]) as channel:
        assert _health(channel, "tokenfeed.v1.TokenFeed") == serving
        with pytest.raises(grpc.RpcError) as e:
            channel.unary_unary("/tokenfeed.v1.TokenFeed/ListJobs")(b"", timeout=10)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_reflection_needs_the_token(token_servers, pki):
    (server, _), _ = token_servers
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    ssl = grpc.ssl_channel_credentials(pki.ca.read_bytes())
    with grpc.secure_channel(server.address, ssl) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.ServerReflectionInfo(iter([request]), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        bearer = [("authorization", f"Bearer {TOKEN}")]
        (reply,) = stub.ServerReflectionInfo(iter([request]), timeout=10, metadata=bearer)
    names = {s.name for s in reply.list_services_response.service}
    assert "tokenfeed.v1.TokenFeed" in names


def test_rotated_tokens_file_takes_effect_without_restart(token_servers, pki, tmp_path):
    (server, _), tokens = token_servers
    original = tokens.read_text()
    client_file = tmp_path / "token"
    client_file.write_text(TOKEN + "\n")  # a Secret's file may end with a newline
    creds = {"tls_root_certs": pki.ca}
    old = Client(server.address, job="main", token=TOKEN, **creds)
    from_file = Client(server.address, job="main", token_file=client_file, **creds)
    try:
        assert old.get_batch(0).step == from_file.get_batch(0).step == 0
        started = server.proc.pid
        _write_tokens(tokens, "tok-rotated-0b1d\n")
        deadline = time.monotonic() + 10
        while True:  # the server looks at the file at most once a second
            try:
                old.get_batch(1)
            except TokenfeedClientError as e:
                assert e.code == grpc.StatusCode.UNAUTHENTICATED
                break
            assert time.monotonic() < deadline, "the old token is still accepted"
            time.sleep(0.2)
        with pytest.raises(TokenfeedClientError) as e:
            from_file.get_batch(1)
        assert _code(e) == grpc.StatusCode.UNAUTHENTICATED
        client_file.write_text("tok-rotated-0b1d\n")  # the trainer's Secret is rotated too
        time.sleep(1.1)  # the client looks at its file at most once a second
        assert from_file.get_batch(1).step == 1  # same Client, new token
        with Client(server.address, job="main", token=ENV_TOKEN, **creds) as c:
            assert c.get_batch(1).step == 1  # the environment's token is not in the file
        assert server.proc.poll() is None and server.proc.pid == started
    finally:
        old.close()
        from_file.close()
        _write_tokens(tokens, original)
        time.sleep(1.1)


def test_async_client_with_tls_and_token(token_servers, pki):
    (server, _), _ = token_servers

    async def main():
        async with AsyncClient(server.address, job="main", tls_root_certs=pki.ca, token=TOKEN) as c:
            one = await c.get_batch(1)
            streamed = [b.step async for b in c.iter_batches(0, 3)]
        async with AsyncClient(server.address, job="main", tls_root_certs=pki.ca, **FAIL_FAST) as c:
            try:
                await c.get_batch(1)
            except TokenfeedClientError as e:
                return one, streamed, e.code
        return one, streamed, None

    one, streamed, refused = asyncio.run(main())
    assert one.step == 1 and streamed == [0, 1, 2]
    assert refused == grpc.StatusCode.UNAUTHENTICATED


def test_fleet_target_uses_the_same_credentials_for_every_server(token_servers, pki):
    servers, _ = token_servers
    addresses = [s.address for s in servers]
    slices = [(job, rank) for job in ("main", "other") for rank in range(8)]
    with Client(servers[0].address, tls_root_certs=pki.ca, token=TOKEN) as c:
        expected = [c.get_batch(0, rank, 8, job=job).fingerprint for job, rank in slices]
    with Client(",".join(addresses), tls_root_certs=pki.ca, token=TOKEN) as c:
        batches = [c.get_batch(0, rank, 8, job=job) for job, rank in slices]
        streams = [
            [b.server for b in c.iter_batches(0, 2, rank, 8, job=job)] for job, rank in slices
        ]
    assert [b.fingerprint for b in batches] == expected
    homes = [rendezvous(addresses, job, rank)[0] for job, rank in slices]
    assert [b.server for b in batches] == homes
    assert streams == [[home, home] for home in homes]
    assert set(homes) == set(addresses), "both servers answered"  # 16 slices: all but certain


# ---------------------------------------------------------------- start-up errors


def test_a_missing_certificate_fails_the_start_naming_key_and_path(tmp_path, corpus, pki):
    missing = tmp_path / "nope.pem"
    tls = {"cert_file": str(missing), "key_file": str(pki.server_key)}
    cfg = write_config(
        tmp_path / "tf.yaml", {"main": job_spec([corpus / "*"])}, tmp_path / "cache", tls=tls
    )
    out = subprocess.run(
        [sys.executable, "-m", "tokenfeed.server.commands.cli", "serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert out.returncode == 2, out.stderr
    assert f"server.tls.cert_file: cannot read '{missing}'" in out.stderr


# ---------------------------------------------------------------- the command line


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tokenfeed.server.commands.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_remote_commands_take_tls_and_token_from_flags_and_environment(
    token_servers, mtls_server, pki, tmp_path
):
    (server, _), _ = token_servers
    roots = ("--tls-root-certs", str(pki.ca))
    denied = _cli("describe", "--target", server.address, "--job", "main", *roots)
    assert denied.returncode == 2 and "UNAUTHENTICATED" in denied.stderr, denied.stderr
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    by_file = _cli(
        "describe",
        "--target",
        server.address,
        "--job",
        "main",
        *roots,
        "--token-file",
        str(token_file),
    )
    assert by_file.returncode == 0, by_file.stderr
    assert json.loads(by_file.stdout)[0]["name"] == "main"
    by_env = _cli(
        "explain",
        "--target",
        server.address,
        "--job",
        "main",
        "--step",
        "1",
        "--json",
        *roots,
        env={"TOKENFEED_TOKEN": TOKEN},
    )
    assert by_env.returncode == 0, by_env.stderr
    assert json.loads(by_env.stdout)["step"] == 1
    unset = _cli("describe", "--target", server.address, *roots, "--token-env", "TF_NO_SUCH_VAR")
    assert unset.returncode == 2 and "TF_NO_SUCH_VAR is unset" in unset.stderr
    # mTLS: the client certificate from the same CA
    mtls = ("--tls-client-cert", str(pki.client_cert), "--tls-client-key", str(pki.client_key))
    ok = _cli("describe", "--target", mtls_server.address, *roots, *mtls)
    assert ok.returncode == 0 and json.loads(ok.stdout)[0]["name"] == "main", ok.stderr
    missing = _cli("describe", "--target", mtls_server.address, "--tls-root-certs", "/nonexistent")
    assert missing.returncode == 2 and "/nonexistent" in missing.stderr, missing.stderr
