"""Request signing shared by the edge SDK and the cloud API.

This module is the ONLY implementation of the canonical string; the client
(:class:`Signer`) and the server (``cloud_api.auth``) both call
:func:`canonical_string`, so they cannot drift apart.

API key format (see also ``cloud_api.keys``)::

    sr_live_<lookup id: 12 base62>_<secret: 32 base62>_<checksum: 6 base62>

The checksum is CRC-32 of ``sr_live_<lookup>_<secret>`` in 6 base62 digits, so
typos and truncated copies are rejected locally, before any DB lookup.  The
lookup id is public (it is the *key id* sent in ``x-sr-key``); the secret never
leaves the client.

Headers sent on every signed request:

========================  =====================================================
``x-sr-key``              key id (the 12-char lookup id)
``x-sr-timestamp``        integer Unix time, seconds
``x-sr-nonce``            16 random bytes, base64url without padding
``x-sr-content-sha256``   lowercase hex SHA-256 of the exact body bytes
``x-sr-signature``        ``hmac-sha256=<b64>`` or ``ed25519=<b64>``
========================  =====================================================

Canonical string (UTF-8, fields joined by ``\\n``; every field is validated to
contain no newline)::

    SR-SIG-V1 \\n alg \\n key_id \\n METHOD \\n raw_path \\n raw_query \\n
    timestamp \\n nonce \\n content_sha256

``raw_path``/``raw_query`` are the percent-encoded path and query as they go on
the wire (yarl normalisation, the same aiohttp applies on both ends).  Sign the
full path+query you request (do not pass ``params=`` to aiohttp separately) and
the path the server sees (no proxy prefix rewriting).

HMAC key choice: the HMAC-SHA256 key is ``SHA-256(secret)`` — exactly the value
the server stores.  The server thus never stores the raw secret, but the stored
hash IS a verification credential: anyone who reads the key DB can forge
HMAC-signed requests (not recover the raw key).  Protect the DB (0600, backups
encrypted).  Keys that register an Ed25519 public key must sign with Ed25519
(the server refuses HMAC for them), so for those a DB leak forges nothing.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass
from typing import Callable

from yarl import URL

__all__ = [
    "ALG_ED25519", "ALG_HMAC", "H_DIGEST", "H_KEY", "H_NONCE", "H_SIGNATURE",
    "H_TIMESTAMP", "KEY_PREFIX", "InvalidApiKey", "ParsedApiKey", "Signer",
    "body_digest", "canonical_string", "canonical_target", "format_api_key",
    "hmac_key_from_secret", "parse_api_key", "parse_signature_header",
    "verify_signature",
]

KEY_PREFIX = "sr_live_"
LOOKUP_LEN, SECRET_LEN, CHECKSUM_LEN = 12, 32, 6
BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_KEY_RE = re.compile(
    rf"^{KEY_PREFIX}([0-9A-Za-z]{{{LOOKUP_LEN}}})_([0-9A-Za-z]{{{SECRET_LEN}}})"
    rf"_([0-9A-Za-z]{{{CHECKSUM_LEN}}})$"
)
KEY_ID_RE = re.compile(rf"^[0-9A-Za-z]{{{LOOKUP_LEN}}}$")
NONCE_RE = re.compile(r"^[A-Za-z0-9_-]{16,64}$")
_METHOD_RE = re.compile(r"^[A-Z]{1,16}$")

H_KEY, H_TIMESTAMP, H_NONCE = "x-sr-key", "x-sr-timestamp", "x-sr-nonce"
H_DIGEST, H_SIGNATURE = "x-sr-content-sha256", "x-sr-signature"
ALG_HMAC, ALG_ED25519 = "hmac-sha256", "ed25519"
_VERSION = "SR-SIG-V1"


class InvalidApiKey(ValueError):
    """Raised when a raw API key is malformed or its checksum does not match."""


@dataclass(frozen=True)
class ParsedApiKey:
    """A syntactically valid raw key: public ``key_id`` and private ``secret``."""

    key_id: str
    secret: str = ""

    def __repr__(self) -> str:  # never leak the secret into logs
        return f"ParsedApiKey(key_id={self.key_id!r}, secret=<redacted>)"


def _b62(n: int, width: int) -> str:
    out = []
    for _ in range(width):
        n, r = divmod(n, 62)
        out.append(BASE62[r])
    return "".join(reversed(out))


def _checksum(body: str) -> str:
    return _b62(binascii.crc32(body.encode("ascii")), CHECKSUM_LEN)


def format_api_key(key_id: str, secret: str) -> str:
    """Assemble ``sr_live_<key_id>_<secret>_<checksum>``.

    Raises:
        InvalidApiKey: if ``key_id``/``secret`` have the wrong length/alphabet.
    """
    body = f"{KEY_PREFIX}{key_id}_{secret}"
    raw = f"{body}_{_checksum(body)}"
    if not _KEY_RE.match(raw):
        raise InvalidApiKey("bad key components")
    return raw


def parse_api_key(raw: str) -> ParsedApiKey:
    """Validate format and checksum of a raw key (no I/O, constant-time compare).

    Raises:
        InvalidApiKey: on wrong prefix/shape or checksum mismatch.
    """
    m = _KEY_RE.match(raw.strip()) if isinstance(raw, str) else None
    if not m:
        raise InvalidApiKey("malformed API key (a key looks like sr_live_..., as "
                            "`specrelay keys create` prints it)")
    lookup, secret, check = m.groups()
    if not hmac.compare_digest(check, _checksum(f"{KEY_PREFIX}{lookup}_{secret}")):
        raise InvalidApiKey("API key checksum mismatch (typo?)")
    return ParsedApiKey(lookup, secret)


def hmac_key_from_secret(secret: str) -> bytes:
    """HMAC key (32 bytes) = SHA-256(secret); also what the key store persists."""
    return hashlib.sha256(secret.encode("ascii")).digest()


def body_digest(body: bytes) -> str:
    """Lowercase hex SHA-256 of the exact body bytes (``b""`` for no body)."""
    return hashlib.sha256(body or b"").hexdigest()


def canonical_target(path: str) -> tuple[str, str]:
    """Return ``(raw_path, raw_query)`` of a path+query as sent on the wire."""
    url = URL(path or "/")
    if url.is_absolute():
        raise ValueError("pass the path (+query), not an absolute URL")
    return (url.raw_path or "/", url.raw_query_string)


def canonical_string(*, alg: str, key_id: str, method: str, raw_path: str,
                     raw_query: str, timestamp: int, nonce: str,
                     content_sha256: str) -> bytes:
    """Build the bytes that get signed/verified.

    Raises:
        ValueError: if any field is malformed or contains a newline.
    """
    fields = [_VERSION, alg, key_id, method, raw_path, raw_query, str(int(timestamp)),
              nonce, content_sha256]
    if any("\n" in f or "\r" in f for f in fields):
        raise ValueError("newline in signed field")
    if alg not in (ALG_HMAC, ALG_ED25519) or not _METHOD_RE.match(method):
        raise ValueError("bad alg or method")
    if not KEY_ID_RE.match(key_id) or not NONCE_RE.match(nonce):
        raise ValueError("bad key id or nonce")
    if not re.fullmatch(r"[0-9a-f]{64}", content_sha256):
        raise ValueError("bad content digest")
    return "\n".join(fields).encode("utf-8")


def parse_signature_header(value: str) -> tuple[str, bytes]:
    """Split ``alg=<base64>`` into ``(alg, signature bytes)``.

    Raises:
        ValueError: unknown algorithm or undecodable/oversized signature.
    """
    alg, sep, b64 = (value or "").partition("=")
    if not sep or alg not in (ALG_HMAC, ALG_ED25519) or len(b64) > 128:
        raise ValueError("malformed signature header")
    try:
        sig = base64.b64decode(b64, validate=True)
    except binascii.Error as exc:
        raise ValueError("malformed signature header") from exc
    if len(sig) not in (32, 64):
        raise ValueError("malformed signature header")
    return alg, sig


def verify_signature(alg: str, sig: bytes, message: bytes, *,
                     hmac_key: bytes | None = None,
                     ed25519_public_key: bytes | None = None) -> bool:
    """Check ``sig`` over ``message``; HMAC compared with ``hmac.compare_digest``.

    ``ed25519_public_key`` is the raw 32-byte key.  Returns False (never raises)
    on any mismatch or missing key material.
    """
    if alg == ALG_HMAC and hmac_key is not None:
        expected = hmac.new(hmac_key, message, hashlib.sha256).digest()
        return hmac.compare_digest(expected, sig)
    if alg == ALG_ED25519 and ed25519_public_key is not None:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
        try:
            Ed25519PublicKey.from_public_bytes(ed25519_public_key).verify(sig, message)
            return True
        except (InvalidSignature, ValueError):
            return False
    return False


class Signer:
    """Client-side request signer.

    Use ``Signer.from_api_key(raw_key)`` for HMAC, or pass
    ``ed25519_private_key`` (an ``Ed25519PrivateKey`` or PEM bytes) for Ed25519::

        headers = signer.headers("POST", "/v1/verify", body)
        await session.post(base_url + "/v1/verify", data=body,
                           headers={**headers, "content-type": "application/x-msgpack"})

    Args:
        key_id: the 12-char public key id.
        hmac_key: 32-byte HMAC key (``hmac_key_from_secret(secret)``).
        ed25519_private_key: private key; takes precedence over ``hmac_key``.
        clock: returns Unix time in seconds (tests inject a fake clock).

    Raises:
        ValueError: if no key material or a malformed key id is given.
    """

    def __init__(self, key_id: str, *, hmac_key: bytes | None = None,
                 ed25519_private_key=None, clock: Callable[[], float] = time.time):
        if not KEY_ID_RE.match(key_id):
            raise ValueError("malformed key id")
        if isinstance(ed25519_private_key, (bytes, str)):
            from cryptography.hazmat.primitives.serialization import load_pem_private_key
            data = ed25519_private_key.encode() if isinstance(ed25519_private_key, str) \
                else ed25519_private_key
            ed25519_private_key = load_pem_private_key(data, password=None)
        if hmac_key is None and ed25519_private_key is None:
            raise ValueError("need hmac_key or ed25519_private_key")
        self.key_id, self._hmac_key, self._ed = key_id, hmac_key, ed25519_private_key
        self.alg = ALG_ED25519 if ed25519_private_key is not None else ALG_HMAC
        self._clock = clock

    @classmethod
    def from_api_key(cls, raw_key: str, *, ed25519_private_key=None,
                     clock: Callable[[], float] = time.time) -> "Signer":
        """Build a signer from the raw ``sr_live_...`` key.

        Raises:
            InvalidApiKey: malformed key or checksum mismatch.
        """
        parsed = parse_api_key(raw_key)
        return cls(parsed.key_id, hmac_key=hmac_key_from_secret(parsed.secret),
                   ed25519_private_key=ed25519_private_key, clock=clock)

    def headers(self, method: str, path: str, body: bytes = b"") -> dict[str, str]:
        """Return the ``x-sr-*`` headers for one request (fresh nonce each call).

        ``path`` is the path plus optional ``?query``; ``body`` the exact bytes sent.
        """
        raw_path, raw_query = canonical_target(path)
        ts = int(self._clock())
        nonce = secrets.token_urlsafe(16)
        digest = body_digest(body)
        msg = canonical_string(alg=self.alg, key_id=self.key_id, method=method.upper(),
                               raw_path=raw_path, raw_query=raw_query, timestamp=ts,
                               nonce=nonce, content_sha256=digest)
        if self._ed is not None:
            sig = self._ed.sign(msg)
        else:
            sig = hmac.new(self._hmac_key, msg, hashlib.sha256).digest()
        return {H_KEY: self.key_id, H_TIMESTAMP: str(ts), H_NONCE: nonce,
                H_DIGEST: digest, H_SIGNATURE: f"{self.alg}={base64.b64encode(sig).decode()}"}
