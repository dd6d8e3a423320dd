"""Keys, JWTs and certificates for the tests of a secured NATS bus, made fresh per test:
``nkeys`` for keys and signatures, ``trustme`` for a throw-away CA. (A unique module name for
``--import-mode=importlib``; tests/conftest.py makes it importable.)"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import nkeys
import trustme


def new_nkey(prefix: int) -> tuple[str, Any]:
    """A fresh nkey: (seed, key pair), e.g. ``new_nkey(nkeys.PREFIX_BYTE_USER)``."""
    seed = nkeys.encode_seed(os.urandom(32), prefix)
    return seed.decode(), nkeys.from_seed(seed)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _jwt(issuer: Any, subject: str, name: str, claims: dict[str, Any]) -> str:
    """A NATS JWT (ed25519-nkey) for ``subject`` signed by the ``issuer`` key pair."""
    body: dict[str, Any] = {"iat": int(time.time()), "iss": issuer.public_key.decode(),
                            "name": name, "sub": subject, "nats": {**claims, "version": 2}}
    body["jti"] = base64.b32encode(
        hashlib.sha256(json.dumps(body, sort_keys=True).encode()).digest()).decode().rstrip("=")
    head = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    signed = f"{head}.{_b64(json.dumps(body).encode())}"
    return f"{signed}.{_b64(issuer.sign(signed.encode()))}"


def operator_mode(tmp: Path) -> tuple[Path, Path]:
    """A server configuration trusting a new operator with one account, and a user's
    credentials file in that account: (config, creds)."""
    _, op = new_nkey(nkeys.PREFIX_BYTE_OPERATOR)
    _, acct = new_nkey(nkeys.PREFIX_BYTE_ACCOUNT)
    user_seed, user = new_nkey(nkeys.PREFIX_BYTE_USER)
    no_limit = {k: -1 for k in ("subs", "data", "payload", "imports", "exports", "conn", "leaf")}
    op_jwt = _jwt(op, op.public_key.decode(), "vtm-operator", {"type": "operator"})
    acct_jwt = _jwt(op, acct.public_key.decode(), "vtm", {
        "type": "account", "limits": {**no_limit, "wildcards": True},
        "default_permissions": {"pub": {}, "sub": {}}})
    user_jwt = _jwt(acct, user.public_key.decode(), "vtm-service", {
        "type": "user", "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1})
    conf = tmp / "operator.conf"
    conf.write_text(f'operator: "{op_jwt}"\nresolver: MEMORY\n'
                    f'resolver_preload: {{ {acct.public_key.decode()}: "{acct_jwt}" }}\n')
    creds = tmp / "service.creds"
    creds.write_text(f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------"
                     f"\n\n-----BEGIN USER NKEY SEED-----\n{user_seed}\n"
                     "------END USER NKEY SEED------\n")
    return conf, creds


def make_pki(tmp: Path) -> dict[str, Path]:
    """PEM files in ``tmp``: a CA (``ca``), a server certificate for 127.0.0.1 / localhost
    (``server_cert``, ``server_key``) and a client's (``client_cert``, ``client_key``)."""
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("vtm-service@example.org")
    files: dict[str, Path] = {}
    for name, blob in (("ca", ca.cert_pem), ("server_cert", server.cert_chain_pems[0]),
                       ("server_key", server.private_key_pem),
                       ("client_cert", client.cert_chain_pems[0]),
                       ("client_key", client.private_key_pem)):
        files[name] = tmp / f"{name}.pem"
        blob.write_to_path(files[name])
    return files


def tls_block(pki: dict[str, Path]) -> str:
    """A nats-server ``tls`` block: its certificate from ``pki``, clients verified."""
    return (f'tls {{ cert_file: "{pki["server_cert"]}", key_file: "{pki["server_key"]}", '
            f'ca_file: "{pki["ca"]}", verify: true }}\n')


def secured_server(tmp: Path) -> tuple[Path, dict[str, str]]:
    """A nats-server configuration with mutual TLS whose only user is an nkey, and the
    ``VTM_NATS_*`` environment a vertumnus process needs to reach it (URL aside)."""
    pki = make_pki(tmp)
    seed, user = new_nkey(nkeys.PREFIX_BYTE_USER)
    (tmp / "svc.nk").write_text(seed + "\n")
    conf = tmp / "secured.conf"
    conf.write_text(tls_block(pki) + "authorization { users = [ { nkey: "
                    f'"{user.public_key.decode()}" }} ] }}\n')
    env = {"VTM_NATS_NKEY_SEED": str(tmp / "svc.nk"), "VTM_NATS_TLS_CA": str(pki["ca"]),
           "VTM_NATS_TLS_CERT": str(pki["client_cert"]),
           "VTM_NATS_TLS_KEY": str(pki["client_key"])}
    return conf, env
