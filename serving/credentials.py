"""The files that hold secrets (a bearer token, TLS certificates and keys), read and checked before any socket
opens: a bad file is a usage error naming the flag, not a vague failure at the first connection."""

from __future__ import annotations

import ssl
from pathlib import Path

from sharp.models.messages import UsageError


def _read(path: Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read {what} {path}: {e.strerror}") from None


def auth_token(path: Path | None) -> str | None:
    """The bearer token in `path`: printable ASCII without spaces, surrounding whitespace ignored."""
    raw = _read(path, "--auth-token-file")
    if raw is None:
        return None
    try:
        token = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise UsageError(f"--auth-token-file {path}: the token must be ASCII") from None
    if not token:
        raise UsageError(f"--auth-token-file {path} is empty")
    if not token.isprintable() or " " in token:
        raise UsageError(f"--auth-token-file {path}: the token must be one word of printable ASCII")
    return token


def tls_pair(cert_path: Path | None, key_path: Path | None) -> tuple[bytes | None, bytes | None]:
    """The PEM certificate chain and key, parsed and checked to belong together before the server starts."""
    if cert_path is None:
        return None, None
    cert, key = _read(cert_path, "--tls-cert"), _read(key_path, "--tls-key")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert_path, key_path)
    except ssl.SSLError as e:
        raise UsageError(
            f"--tls-cert {cert_path} / --tls-key {key_path}: not a PEM certificate chain and its own private key"
            f" ({e.reason})"
        ) from None
    return cert, key


def tls_roots(path: Path | None) -> bytes | None:
    """The client's PEM root certificates, parsed here: gRPC would only fail the connection, later and vaguely."""
    pem = _read(path, "--tls-ca")
    if pem is None:
        return None
    try:
        ssl.create_default_context(cadata=pem.decode("ascii"))
    except (UnicodeDecodeError, ssl.SSLError):
        raise UsageError(
            f"--tls-ca {path}: holds no PEM root certificate that parses (-----BEGIN CERTIFICATE-----)"
        ) from None
    return pem
