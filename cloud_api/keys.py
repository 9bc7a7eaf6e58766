"""API keys: generation, hashed storage and lifecycle.

Format (defined in ``edge_sdk.protocol.signing``)::

    sr_live_<lookup id: 12 base62>_<secret: 32 base62 (~190 bits)>_<crc32: 6 base62>

* The lookup id is the public *key id* (primary key, indexed).
* Only ``SHA-256(secret)`` is stored.  It doubles as the HMAC signing key, so the
  DB is sensitive (see ``edge_sdk.protocol.signing``); the file is created 0600.
* The raw key is returned exactly once, by :meth:`KeyStore.create`/``rotate``.
* Rotation creates a new key with the same settings (and current usage); the old
  key keeps working until :meth:`KeyStore.revoke` is called on it.
"""

from __future__ import annotations

import abc
import hmac
import os
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from edge_sdk.protocol.signing import (
    BASE62, KEY_ID_RE, LOOKUP_LEN, SECRET_LEN, InvalidApiKey, format_api_key,
    hmac_key_from_secret, parse_api_key,
)

__all__ = ["SCOPES", "ApiKey", "InvalidApiKey", "KeyNotFound", "KeyStore",
           "QuotaExceeded", "SQLiteKeyStore", "load_ed25519_public_key"]

SCOPES = frozenset({"verify", "admin"})


class KeyNotFound(KeyError):
    """Raised when a key id does not exist in the store."""


class QuotaExceeded(Exception):
    """Raised by :meth:`KeyStore.record_usage` when the total quota would be exceeded."""


@dataclass(frozen=True)
class ApiKey:
    """Stored key record (never contains the raw key or secret).

    ``rpm``: requests/minute; ``tpm``: verified tokens/minute; ``quota``: total
    verified tokens (None = unlimited); timestamps are Unix seconds.
    """

    key_id: str
    name: str
    scopes: frozenset[str]
    rpm: int
    tpm: int
    quota: int | None
    used_tokens: int
    created_at: float
    revoked_at: float | None = None
    ed25519_public_key: bytes | None = None  # raw 32 bytes
    rotated_from: str | None = None
    secret_hash: bytes = field(default=b"", repr=False)  # = HMAC key
    #: the first key of its rotation chain: a key and its rotations share one account
    #: (``used_tokens`` against ``quota``, and the rpm/tpm windows), so overlapping old
    #: and new keys cannot spend a quota twice, and rotating never resets one
    account_id: str = ""

    def __post_init__(self):
        if not self.account_id:
            object.__setattr__(self, "account_id", self.key_id)

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


def _gen(n: int) -> str:
    return "".join(secrets.choice(BASE62) for _ in range(n))


def _check_scopes(scopes: Iterable[str]) -> frozenset[str]:
    s = frozenset(scopes)
    if not s or not s <= SCOPES:
        raise ValueError(f"scopes must be a non-empty subset of {sorted(SCOPES)}")
    return s


def load_ed25519_public_key(data: bytes | str) -> bytes:
    """Return the raw 32-byte key from PEM, DER or raw bytes.

    Raises:
        ValueError: not an Ed25519 public key.
    """
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from cryptography.hazmat.primitives import serialization as ser
    if isinstance(data, str):
        data = data.encode()
    if len(data) == 32:
        return Ed25519PublicKey.from_public_bytes(data).public_bytes_raw()
    loader = ser.load_pem_public_key if data.lstrip().startswith(b"-----") \
        else ser.load_der_public_key
    key = loader(data)
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError("not an Ed25519 public key")
    return key.public_bytes_raw()


class KeyStore(abc.ABC):
    """Abstract key store.  Implementations must be thread-safe."""

    @abc.abstractmethod
    def create(self, name: str, scopes: Iterable[str] = ("verify",), *, rpm: int = 600,
               tpm: int = 100_000, quota: int | None = None,
               ed25519_public_key: bytes | None = None,
               _rotated_from: ApiKey | None = None) -> tuple[ApiKey, str]:
        """Create a key; return ``(record, raw_key)``. Show ``raw_key`` once.

        Raises:
            ValueError: unknown scope, non-positive limits, bad Ed25519 key.
        """

    @abc.abstractmethod
    def get_by_lookup(self, key_id: str) -> ApiKey | None:
        """Return the record for a key id (revoked included), or None."""

    @abc.abstractmethod
    def list(self, include_revoked: bool = True) -> list[ApiKey]:
        """All records, oldest first."""

    @abc.abstractmethod
    def revoke(self, key_id: str) -> ApiKey:
        """Mark revoked (idempotent). Raises KeyNotFound."""

    @abc.abstractmethod
    def register_ed25519_public_key(self, key_id: str, public_key: bytes | str | None) -> ApiKey:
        """Set (PEM/DER/raw) or clear (None) the key's Ed25519 public key.

        Once set, the key must sign with Ed25519 (HMAC is refused).
        Raises KeyNotFound, ValueError.
        """

    @abc.abstractmethod
    def record_usage(self, key_id: str, verified_tokens: int) -> int | None:
        """Atomically add verified tokens; return remaining quota (None = unlimited).

        Raises:
            QuotaExceeded: the addition would exceed the quota (nothing recorded).
            KeyNotFound: unknown key id.
        """

    def rotate(self, key_id: str) -> tuple[ApiKey, str]:
        """New key with the same name/scopes/limits/Ed25519 key and the same account:
        the old and the new key draw on one ``used_tokens`` counter and one set of
        rate windows (``ApiKey.account_id``), so the overlap until the old key is
        revoked cannot double a quota or a rate, and a rotation never refunds usage.

        The old key stays valid until revoked.  Raises KeyNotFound, ValueError
        (rotating a revoked key).
        """
        old = self.get_by_lookup(key_id)
        if old is None:
            raise KeyNotFound(key_id)
        if old.revoked:
            raise ValueError("cannot rotate a revoked key")
        return self.create(old.name, old.scopes, rpm=old.rpm, tpm=old.tpm,
                           quota=old.quota, ed25519_public_key=old.ed25519_public_key,
                           _rotated_from=old)

    def authenticate(self, raw_key: str) -> ApiKey:
        """Resolve a raw key to its active record (bearer-style check).

        The checksum is verified before any DB access.
        Raises:
            InvalidApiKey: malformed/typo'd, unknown, wrong secret or revoked.
        """
        parsed = parse_api_key(raw_key)
        rec = self.get_by_lookup(parsed.key_id)
        ok = rec is not None and hmac.compare_digest(
            rec.secret_hash, hmac_key_from_secret(parsed.secret))
        if not ok or rec.revoked:
            raise InvalidApiKey("invalid or revoked API key")
        return rec


_COLS = ("key_id, name, scopes, rpm, tpm, quota, used_tokens, created_at, revoked_at, "
         "ed25519_public_key, rotated_from, secret_hash")


class SQLiteKeyStore(KeyStore):
    """Default store on stdlib sqlite3: one connection guarded by a lock.

    WAL + ``synchronous=NORMAL``: a power loss may drop the last usage updates.
    Calls block briefly (sub-millisecond typical); fine from an event loop.

    Args:
        path: DB file (parent dirs created 0700, file chmod 0600) or ``":memory:"``.
        clock: Unix-seconds clock used for timestamps.
    """

    def __init__(self, path: str | os.PathLike = ":memory:", *,
                 clock: Callable[[], float] = time.time):
        path = os.fspath(path)
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
            os.close(fd)
        self._clock = clock
        self._lock = threading.RLock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        with self._lock:
            if path != ":memory:":  # WAL: no fsync per usage update (hot path)
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS api_keys (key_id TEXT PRIMARY KEY, "
                "name TEXT NOT NULL, scopes TEXT NOT NULL, rpm INTEGER NOT NULL, "
                "tpm INTEGER NOT NULL, quota INTEGER, used_tokens INTEGER NOT NULL DEFAULT 0, "
                "created_at REAL NOT NULL, revoked_at REAL, ed25519_public_key BLOB, "
                "rotated_from TEXT, secret_hash BLOB NOT NULL)")

    def close(self) -> None:
        """Close the underlying connection."""
        with self._lock:
            self._db.close()

    def _account(self, key_id: str, rotated_from: str | None) -> tuple[str, int]:
        """``(account id, used tokens of the account)``: the root of the rotation chain
        (followed through ``rotated_from``) and its counter."""
        root, used = key_id, None
        seen = {key_id}
        while rotated_from is not None and rotated_from not in seen:
            r = self._db.execute("SELECT key_id, rotated_from, used_tokens FROM api_keys "
                                 "WHERE key_id=?", (rotated_from,)).fetchone()
            if r is None:
                break
            seen.add(r[0])
            root, rotated_from, used = r[0], r[1], r[2]
        return root, used

    def _row(self, r) -> ApiKey:
        account, used = self._account(r[0], r[10])
        return ApiKey(r[0], r[1], frozenset(r[2].split()), r[3], r[4], r[5],
                      r[6] if used is None else used, r[7], r[8], r[9], r[10], r[11],
                      account)

    def create(self, name, scopes=("verify",), *, rpm=600, tpm=100_000, quota=None,
               ed25519_public_key=None, _rotated_from=None):
        scopes = _check_scopes(scopes)
        if rpm <= 0 or tpm <= 0 or (quota is not None and quota < 0):
            raise ValueError("rpm/tpm must be > 0 and quota >= 0")
        pub = load_ed25519_public_key(ed25519_public_key) if ed25519_public_key else None
        secret = _gen(SECRET_LEN)
        used = 0                       # a rotation's usage is counted on its account
        with self._lock:
            while True:
                key_id = _gen(LOOKUP_LEN)
                try:
                    self._db.execute(
                        f"INSERT INTO api_keys ({_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                        (key_id, name, " ".join(sorted(scopes)), int(rpm), int(tpm), quota,
                         used, self._clock(), None, pub,
                         _rotated_from.key_id if _rotated_from else None,
                         hmac_key_from_secret(secret)))
                    break
                except sqlite3.IntegrityError:  # lookup id collision: retry
                    continue
        return self.get_by_lookup(key_id), format_api_key(key_id, secret)

    def get_by_lookup(self, key_id):
        if not isinstance(key_id, str) or not KEY_ID_RE.match(key_id):
            return None
        with self._lock:
            r = self._db.execute(f"SELECT {_COLS} FROM api_keys WHERE key_id=?",
                                 (key_id,)).fetchone()
            return self._row(r) if r else None

    def list(self, include_revoked=True):
        q = f"SELECT {_COLS} FROM api_keys"
        if not include_revoked:
            q += " WHERE revoked_at IS NULL"
        with self._lock:
            rows = self._db.execute(q + " ORDER BY created_at, key_id").fetchall()
            return [self._row(r) for r in rows]

    def _update(self, key_id: str, sql: str, args: tuple) -> ApiKey:
        with self._lock:
            if self._db.execute(sql, args).rowcount == 0 and not self.get_by_lookup(key_id):
                raise KeyNotFound(key_id)
            return self.get_by_lookup(key_id)

    def revoke(self, key_id):
        return self._update(key_id, "UPDATE api_keys SET revoked_at=? WHERE key_id=? "
                            "AND revoked_at IS NULL", (self._clock(), key_id))

    def register_ed25519_public_key(self, key_id, public_key):
        pub = load_ed25519_public_key(public_key) if public_key is not None else None
        return self._update(key_id, "UPDATE api_keys SET ed25519_public_key=? WHERE key_id=?",
                            (pub, key_id))

    def record_usage(self, key_id, verified_tokens):
        n = int(verified_tokens)
        if n < 0:
            raise ValueError("verified_tokens must be >= 0")
        with self._lock:
            rec = self.get_by_lookup(key_id)
            if rec is None:
                raise KeyNotFound(key_id)
            cur = self._db.execute(
                "UPDATE api_keys SET used_tokens=used_tokens+? WHERE key_id=? "
                "AND (? IS NULL OR used_tokens+? <= ?)",
                (n, rec.account_id, rec.quota, n, rec.quota))
            rec = self.get_by_lookup(key_id)
        if cur.rowcount == 0:
            raise QuotaExceeded(key_id)
        return None if rec.quota is None else rec.quota - rec.used_tokens
