"""Tokens and TLS settings: the file format, the constant-time check, rotation, the config keys
and their errors, and the client's credential options."""

from __future__ import annotations

import datetime
import hmac
import os

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from tokenfeed.client._credentials import Credentials, TokenSource
from tokenfeed.server.errors import ConfigError
from tokenfeed.server.serve import auth, authtokens, tlscreds
from tokenfeed.server.settings.config import AuthSpec, TlsSpec, from_dict

JOB = {"sources": ["data/*.jsonl"], "tokenizer": "tok.json", "seq_len": 8, "global_batch_size": 2}


# ---------------------------------------------------------------- the tokens file


def test_parse_tokens_skips_comments_and_blank_lines():
    text = "# trainers\n\n  alpha  \nbeta # the eval job\n#gamma\ndelta:run1, run2\n"
    tokens = authtokens.parse_tokens(text, "f")
    assert [t.digest for t in tokens] == [authtokens.digest(s) for s in ("alpha", "beta", "delta")]
    assert [t.jobs for t in tokens] == [None, None, frozenset({"run1", "run2"})]
    assert tokens[2].allows("run2") and not tokens[2].allows("run3")
    assert tokens[0].allows("anything")
    assert authtokens.parse_tokens("# nothing\n\n", "f") == []


@pytest.mark.parametrize(
    "line", ["s3cr3t word", "s3cr3t:", "s3cr3t:bad job", "s3cr3t:a,,b", "s3cr3t,b", "s3cr3t\x7f"]
)
def test_bad_lines_name_the_line_never_the_token(line):
    with pytest.raises(ConfigError) as e:
        authtokens.parse_tokens(f"good\n{line}\n", "server.auth.tokens_file /x")
    assert str(e.value).startswith("server.auth.tokens_file /x line 2: expected")
    assert "s3cr3t" not in str(e.value)


def test_match_accepts_only_the_exact_token():
    tokens = authtokens.parse_tokens("alpha-token\nbeta-token:run1\n", "f")
    assert authtokens.match(tokens, "alpha-token") is tokens[0]
    assert authtokens.match(tokens, "beta-token") is tokens[1]
    for wrong in ("alpha-toke", "alpha-token2", "ALPHA-TOKEN", "", "beta-token:run1"):
        assert authtokens.match(tokens, wrong) is None, wrong


@pytest.mark.parametrize("presented", ["first", "last", "none-of-them", "x" * 1000])
def test_match_compares_digests_with_every_token(monkeypatch, presented):
    """No early exit and no length leak: compare_digest runs once per configured token, always
    on two 32-byte digests, whichever token (if any) matches."""
    calls, compare = [], hmac.compare_digest

    def spy(a, b):
        calls.append((len(a), len(b)))
        return compare(a, b)

    monkeypatch.setattr(authtokens.hmac, "compare_digest", spy)
    tokens = authtokens.parse_tokens("first\nmiddle-and-longer\nlast\n", "f")
    found = authtokens.match(tokens, presented)
    assert calls == [(32, 32)] * 3
    assert (found is not None) == (presented in ("first", "last"))


# ---------------------------------------------------------------- TokenSet: sources, rotation


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _replace(path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def test_tokens_from_file_and_environment(tmp_path):
    (tmp_path / "tokens").write_text("file-token\n")
    spec = AuthSpec(tokens_file=str(tmp_path / "tokens"), tokens_env="TF_TOKENS")
    tokens = authtokens.TokenSet(spec, {"TF_TOKENS": "env-1 env-2:run1\n"})
    assert len(tokens) == 3
    assert tokens.check("file-token") and tokens.check("env-1")
    assert tokens.check("env-2:run1") is None and tokens.check("env-2").jobs == {"run1"}
    only_env = authtokens.TokenSet(AuthSpec(tokens_env="TF_TOKENS"), {"TF_TOKENS": "env-1"})
    assert only_env.check("env-1") and not only_env.check("file-token")


def test_rotation_is_seen_within_a_second_and_not_before(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("old\n")
    clock = Clock()
    tokens = authtokens.TokenSet(AuthSpec(tokens_file=str(path)), {}, clock=clock)
    assert tokens.check("old")
    _replace(path, "new\n")
    clock.now += 0.5
    assert tokens.check("old") and not tokens.check("new"), "looked at once a second at most"
    clock.now += 0.5
    assert tokens.check("new") and not tokens.check("old")
    # Rewritten in place with the same size: the modification time tells.
    path.write_text("nex\n")
    os.utime(path, ns=(1, 1))
    clock.now += 1
    assert tokens.check("nex") and not tokens.check("new")


@pytest.mark.parametrize("state", ["missing", "empty", "malformed"])
def test_a_file_caught_mid_rotation_keeps_the_previous_tokens(tmp_path, state, caplog):
    path = tmp_path / "tokens"
    path.write_text("old\n")
    clock = Clock()
    tokens = authtokens.TokenSet(AuthSpec(tokens_file=str(path)), {}, clock=clock)
    if state == "missing":
        path.unlink()
    else:
        _replace(path, "" if state == "empty" else "old\nhalf writ")
    clock.now += 1
    assert tokens.check("old")
    assert "keeping the previous tokens" in caplog.text
    _replace(path, "new\n")
    clock.now += 1
    assert tokens.check("new") and not tokens.check("old")


def test_start_errors_name_the_key_and_value(tmp_path):
    missing = tmp_path / "absent"
    with pytest.raises(
        ConfigError,
        match=rf"^tf.yaml: server.auth.tokens_file: cannot read "
        rf"'{missing}': No such file",
    ):
        authtokens.TokenSet(AuthSpec(tokens_file=str(missing)), {}, "tf.yaml")
    (tmp_path / "empty").write_text("# no tokens yet\n")
    with pytest.raises(ConfigError, match=r"server.auth.tokens_file: '.*empty' holds no token"):
        authtokens.TokenSet(AuthSpec(tokens_file=str(tmp_path / "empty")), {}, "tf.yaml")
    with pytest.raises(ConfigError, match=r"server.auth.tokens_env: \$TF_T: not set"):
        authtokens.TokenSet(AuthSpec(tokens_env="TF_T"), {}, "tf.yaml")
    (tmp_path / "bad").write_text("ok\nno good\n")
    with pytest.raises(ConfigError, match=r"^tf.yaml: server.auth.tokens_file .*bad line 2"):
        authtokens.TokenSet(AuthSpec(tokens_file=str(tmp_path / "bad")), {}, "tf.yaml")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, (None, "missing credentials")),
        ((("authorization", "Bearer tok"),), ("tok", "")),
        ((("authorization", "bearer  tok "),), ("tok", "")),
        ((("authorization", "Basic dG9rOg=="),), (None, "malformed")),
        ((("authorization", "Bearer "),), (None, "malformed")),
        ((("authorization", "Bearer a"), ("authorization", "Bearer b")), (None, "malformed")),
        ((("x-other", "Bearer tok"),), (None, "missing credentials")),
    ],
)
def test_bearer_metadata(value, expected):
    token, why = auth._bearer(value)
    assert token == expected[0] and why.startswith(expected[1])
    if token is None:
        assert "authorization: Bearer <token>" in why


# ---------------------------------------------------------------- config keys


def test_tls_and_auth_keys_parse_with_paths_resolved(tmp_path):
    raw = {
        "server": {
            "health_listen": "0.0.0.0:50052",
            "tls": {
                "cert_file": "tls/tls.crt",
                "key_file": "/abs/tls.key",
                "client_ca_file": "tls/ca.crt",
            },
            "auth": {"tokens_file": "auth/tokens", "tokens_env": "TOKENFEED_TOKENS"},
        },
        "jobs": {"j": JOB},
    }
    server = from_dict(raw, base=tmp_path).server
    assert server.tls == TlsSpec(
        str(tmp_path / "tls/tls.crt"), "/abs/tls.key", str(tmp_path / "tls/ca.crt")
    )
    assert server.auth == AuthSpec(str(tmp_path / "auth/tokens"), "TOKENFEED_TOKENS")
    assert server.health_listen == "0.0.0.0:50052"
    assert server.tls.enabled and server.auth.enabled
    plain = from_dict({"jobs": {"j": JOB}}).server
    assert not plain.tls.enabled and not plain.auth.enabled and plain.health_listen == ""


@pytest.mark.parametrize(
    ("server", "message"),
    [
        ({"tls": {"key_file": "k"}}, "server.tls.cert_file: required"),
        ({"tls": {"cert_file": "c"}}, "server.tls.key_file: required"),
        (
            {"tls": {"cert_file": "c", "key_file": "k", "ca_file": "x"}},
            "server.tls.ca_file: unknown key",
        ),
        (
            {"tls": {"cert_file": "", "key_file": "k"}},
            "server.tls.cert_file: expected a non-empty string, got ''",
        ),
        ({"tls": "cert.pem"}, "server.tls: expected a mapping, got str 'cert.pem'"),
        ({"auth": {}}, "server.auth: expected tokens_file, tokens_env or both, got {}"),
        (
            {"auth": {"tokens_env": "my-tokens"}},
            "server.auth.tokens_env: expected the name of an environment variable, got 'my-tokens'",
        ),
        ({"auth": {"tokens": ["a"]}}, "server.auth.tokens: unknown key"),
    ],
)
def test_bad_keys_name_key_path_and_value(server, message):
    with pytest.raises(ConfigError) as e:
        from_dict({"server": server, "jobs": {"j": JOB}}, origin="tf.yaml")
    assert str(e.value).startswith(f"tf.yaml: {message}")


# ---------------------------------------------------------------- server certificates


def _self_signed(tmp_path, name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_path), str(key_path)


def test_server_credentials_check_the_files_and_name_the_key(tmp_path):
    cert, key = _self_signed(tmp_path, "a")
    other_cert, other_key = _self_signed(tmp_path, "b")
    assert isinstance(tlscreds.server_credentials(TlsSpec(cert, key)), grpc.ServerCredentials)
    assert isinstance(
        tlscreds.server_credentials(TlsSpec(cert, key, other_cert)), grpc.ServerCredentials
    )
    missing = str(tmp_path / "missing.pem")
    cases = [
        (TlsSpec(missing, key), f"server.tls.cert_file: cannot read '{missing}': No such file"),
        (TlsSpec(cert, missing), f"server.tls.key_file: cannot read '{missing}'"),
        (TlsSpec(key, key), f"server.tls.cert_file: '{key}' holds no PEM BEGIN CERTIFICATE"),
        (TlsSpec(cert, cert), f"server.tls.key_file: '{cert}' holds no PEM PRIVATE KEY"),
        (
            TlsSpec(cert, other_key),
            f"server.tls.key_file: '{other_key}' is not an "
            "unencrypted private key of the certificate",
        ),
        (TlsSpec(cert, key, missing), f"server.tls.client_ca_file: cannot read '{missing}'"),
    ]
    for spec, message in cases:
        with pytest.raises(ConfigError) as e:
            tlscreds.server_credentials(spec, "tf.yaml")
        assert str(e.value).startswith(f"tf.yaml: {message}"), str(e.value)


# ---------------------------------------------------------------- the client's options


def test_client_credentials_plaintext_tls_and_metadata(tmp_path):
    plain = Credentials("localhost:50051")
    assert plain.channel_credentials is None and plain.metadata() is None
    sidecar = Credentials("localhost:50051", token="tok")
    assert sidecar.metadata() == (("authorization", "Bearer tok"),)
    tls = Credentials("h1:1,h2:2", tls=True, token="tok")
    assert tls.channel_credentials is not None
    assert tls.metadata() is None, "over TLS the call credentials carry the token"
    assert tls.options == [], "a static target's addresses name themselves"
    ca = tmp_path / "ca.pem"
    ca.write_bytes(b"-----BEGIN CERTIFICATE-----\n")
    assert Credentials("h:1", tls_root_certs=ca).tls, "a TLS option turns TLS on"


def test_dns_targets_check_the_certificate_against_the_name():
    creds = Credentials("dns:///tokenfeed.data.svc.cluster.local:50051", tls=True)
    assert creds.options == [("grpc.ssl_target_name_override", "tokenfeed.data.svc.cluster.local")]
    named = Credentials("dns:///svc:1", tls=True, tls_server_name="tokenfeed.example")
    assert named.options == [("grpc.ssl_target_name_override", "tokenfeed.example")]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tls": False, "tls_root_certs": b"x"}, "tls=False contradicts tls_root_certs"),
        ({"tls_client_cert": b"x"}, "tls_client_cert and tls_client_key go together"),
        ({"token": "a", "token_file": "f"}, "pass token or token_file, not both"),
        ({"token": "Bearer abc"}, "token: expected one token"),
        ({"token": ""}, "token: expected one token"),
        (
            {"tls_root_certs": "/nonexistent/ca.pem"},
            "tls_root_certs: cannot read '/nonexistent/ca.pem'",
        ),
        ({"token_file": "/nonexistent/token"}, "token_file: cannot read '/nonexistent/token'"),
    ],
)
def test_client_credential_options_are_checked(options, message):
    with pytest.raises(ValueError) as e:
        Credentials("h:1", **options)
    assert str(e.value).startswith(message)


def test_client_token_file_is_re_read_when_it_changes(tmp_path, monkeypatch):
    path = tmp_path / "token"
    path.write_text("first\n")
    source = TokenSource(path=path)
    assert source.value() == "first"
    monkeypatch.setattr("tokenfeed.client._credentials.RELOAD_SECONDS", 0.0)
    _replace(path, "second\n")
    assert source.value() == "second"
    path.unlink()  # mid-rotation: the last good token stays
    assert source.value() == "second"
