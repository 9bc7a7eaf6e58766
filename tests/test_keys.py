"""Key format, hashed storage, lifecycle and the ``keys`` CLI."""

from __future__ import annotations

import hashlib
import json
import re
import threading

import pytest
import pytest_asyncio
from aiohttp import web
from click.testing import CliRunner
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cloud_api.auth import auth_middleware
from cloud_api.keys import (
    InvalidApiKey, KeyNotFound, QuotaExceeded, SQLiteKeyStore, load_ed25519_public_key,
)
from cloud_api.keys_cli import keys
from edge_sdk.protocol import signing as sg
from edge_sdk.protocol.signing import Signer

KEY_RE = re.compile(r"^sr_live_[0-9A-Za-z]{12}_[0-9A-Za-z]{32}_[0-9A-Za-z]{6}$")


class CountingStore(SQLiteKeyStore):
    lookups = 0

    def get_by_lookup(self, key_id):
        self.lookups += 1
        return super().get_by_lookup(key_id)


@pytest.fixture
def store(tmp_path):
    s = CountingStore(tmp_path / "keys.sqlite3")
    yield s
    s.close()


@pytest_asyncio.fixture
async def client(aiohttp_client, store):
    async def echo(request):
        return web.json_response({"key_id": request["api_key"].key_id})

    app = web.Application(middlewares=[auth_middleware(store)])
    app.router.add_post("/v1/echo", echo)
    return await aiohttp_client(app)


async def call(client, raw_key):
    h = Signer.from_api_key(raw_key).headers("POST", "/v1/echo", b"hi")
    resp = await client.post("/v1/echo", data=b"hi", headers=h)
    return resp.status, (await resp.json())


def test_format_and_checksum_typo_rejected_without_db_hit(store):
    rec, raw = store.create("edge", ["verify"])
    assert KEY_RE.match(raw) and raw.split("_")[2] == rec.key_id
    store.lookups = 0
    for i in range(len(raw)):  # every single-character substitution
        for c in "0aZ_":
            typo = raw[:i] + c + raw[i + 1:]
            if typo != raw:
                with pytest.raises(InvalidApiKey):
                    store.authenticate(typo)
    with pytest.raises(InvalidApiKey):
        store.authenticate(raw[:-1])
    assert store.lookups == 0
    assert store.authenticate(raw).key_id == rec.key_id and store.lookups == 1
    # well-formed key with a correct checksum but wrong secret: DB hit, still rejected
    forged = sg.format_api_key(rec.key_id, "x" * 32)
    with pytest.raises(InvalidApiKey):
        store.authenticate(forged)
    assert sg.parse_api_key(raw).secret not in repr(sg.parse_api_key(raw))


def test_db_file_never_contains_raw_key_or_secret(tmp_path):
    path = tmp_path / "k.sqlite3"
    store = SQLiteKeyStore(path)
    raws = [store.create(f"k{i}", ["verify", "admin"])[1] for i in range(5)]
    old = sg.parse_api_key(raws[0]).key_id
    raws.append(store.rotate(old)[1])
    store.revoke(old)
    store.close()
    blob = b"".join(p.read_bytes() for p in tmp_path.iterdir())
    for raw in raws:
        p = sg.parse_api_key(raw)
        assert p.key_id.encode() in blob  # sanity: we are reading the right file
        for needle in (raw, p.secret, hashlib.sha256(raw.encode()).hexdigest()):
            assert needle.encode() not in blob
    assert (path.stat().st_mode & 0o777) == 0o600


@pytest.mark.asyncio
async def test_lifecycle_create_use_rotate_revoke(client, store):
    rec, raw = store.create("edge", ["verify"], rpm=10, tpm=1000, quota=50)
    assert (await call(client, raw)) == (200, {"key_id": rec.key_id})
    new, raw2 = store.rotate(rec.key_id)
    assert new.key_id != rec.key_id and raw2 != raw
    assert (new.name, new.scopes, new.rpm, new.tpm, new.quota, new.rotated_from) == \
        (rec.name, rec.scopes, 10, 1000, 50, rec.key_id)
    assert (await call(client, raw))[0] == 200  # old key still works until revoked
    assert (await call(client, raw2)) == (200, {"key_id": new.key_id})
    assert store.revoke(rec.key_id).revoked
    status, data = await call(client, raw)
    assert status == 401 and data["error"]["code"] == "key_revoked"
    assert (await call(client, raw2))[0] == 200
    with pytest.raises(ValueError):
        store.rotate(rec.key_id)
    with pytest.raises(KeyNotFound):
        store.revoke("AAAAAAAAAAAA")


def test_quota_scopes_and_ed25519(store):
    rec, _ = store.create("q", ["verify"], quota=10)
    assert store.record_usage(rec.key_id, 6) == 4
    with pytest.raises(QuotaExceeded):
        store.record_usage(rec.key_id, 5)
    assert store.record_usage(rec.key_id, 4) == 0
    assert store.get_by_lookup(rec.key_id).used_tokens == 10
    unl, _ = store.create("u")
    assert store.record_usage(unl.key_id, 10**6) is None
    with pytest.raises(ValueError):
        store.create("bad", ["root"])
    with pytest.raises(ValueError):
        store.create("bad", ["verify"], rpm=0)
    pub = Ed25519PrivateKey.generate().public_key()
    pem = pub.public_bytes(serialization.Encoding.PEM,
                           serialization.PublicFormat.SubjectPublicKeyInfo)
    got = store.register_ed25519_public_key(unl.key_id, pem)
    assert got.ed25519_public_key == pub.public_bytes_raw() == load_ed25519_public_key(pem)
    assert [k.key_id for k in store.list()] == [rec.key_id, unl.key_id]


def test_concurrent_usage_is_atomic(store):
    rec, _ = store.create("c", quota=1000)

    def worker():
        for _ in range(50):
            store.record_usage(rec.key_id, 1)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.get_by_lookup(rec.key_id).used_tokens == 400


def test_cli_create_list_rotate_revoke(tmp_path, monkeypatch):
    db = str(tmp_path / "cli.sqlite3")
    runner = CliRunner()
    priv = Ed25519PrivateKey.generate()
    pem_path = tmp_path / "pub.pem"
    pem_path.write_bytes(priv.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))

    r = runner.invoke(keys, ["--db", db, "create", "--name", "edge-a", "--scopes",
                             "verify,admin", "--rpm", "5", "--tpm", "50", "--quota", "100"])
    assert r.exit_code == 0, r.output
    raw = re.search(r"sr_live_\S+", r.output).group(0)
    key_id = sg.parse_api_key(raw).key_id
    r = runner.invoke(keys, ["--db", db, "create", "--name", "dev",
                             "--ed25519-public-key", str(pem_path)])
    assert r.exit_code == 0, r.output
    raw_ed = re.search(r"sr_live_\S+", r.output).group(0)

    monkeypatch.setenv("SPECRELAY_KEYS_DB", db)  # env var instead of --db
    r = runner.invoke(keys, ["list", "--json"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.output.splitlines()]
    assert [(x["name"], x["scopes"], x["quota"], x["ed25519"]) for x in rows] == \
        [("edge-a", ["admin", "verify"], 100, False), ("dev", ["verify"], None, True)]
    for secret_bearing in (raw, raw_ed):
        assert sg.parse_api_key(secret_bearing).secret not in r.output
    assert sg.parse_api_key(raw).secret not in runner.invoke(keys, ["list"]).output

    r = runner.invoke(keys, ["rotate", key_id])
    assert r.exit_code == 0, r.output
    raw2 = re.search(r"sr_live_\S+", r.output).group(0)
    r = runner.invoke(keys, ["revoke", key_id])
    assert r.exit_code == 0 and "revoked" in r.output

    s = SQLiteKeyStore(db)
    with pytest.raises(InvalidApiKey):
        s.authenticate(raw)
    new = s.authenticate(raw2)
    assert (new.rpm, new.tpm, new.quota, new.scopes) == (5, 50, 100, {"verify", "admin"})

    assert runner.invoke(keys, ["revoke", "AAAAAAAAAAAA"]).exit_code != 0
    assert runner.invoke(keys, ["create", "--name", "x", "--scopes", "root"]).exit_code != 0
    r = runner.invoke(keys, ["set-ed25519", new.key_id, str(pem_path)])
    assert r.exit_code == 0, r.output
    assert s.get_by_lookup(new.key_id).ed25519_public_key is not None


def test_cli_db_on_subcommands_duplicates_and_nulls(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECRELAY_KEYS_DB", raising=False)
    db = str(tmp_path / "sub.sqlite3")
    runner = CliRunner()
    r = runner.invoke(keys, ["create", "--name", "app1", "--db", db])   # --db after create
    assert r.exit_code == 0, r.output
    assert f"key store: {db}" in r.output
    r = runner.invoke(keys, ["create", "--name", "app1", "--db", db])
    assert r.exit_code == 2 and "already named 'app1'" in r.output
    r = runner.invoke(keys, ["create", "--name", "app1", "--db", db, "--allow-duplicate-name"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(keys, ["list", "--json", "--db", db])
    rows = [json.loads(line) for line in r.output.splitlines()]
    assert len(rows) == 2 and rows[0]["revoked_at"] is None and rows[0]["created_at"]
    r = runner.invoke(keys, ["list", "--db", db])
    assert r.output.splitlines()[0].startswith("KEY_ID")
    r = runner.invoke(keys, ["revoke", rows[0]["key_id"], "--db", db])
    assert r.exit_code == 0
    r = runner.invoke(keys, ["list", "--json", "--db", db])
    assert json.loads(r.output.splitlines()[0])["revoked_at"].endswith("Z")


def test_rotation_shares_one_account(store):
    """A key and its rotation draw on one quota counter: the overlap until the old key
    is revoked cannot spend the quota twice, and rotating refunds nothing."""
    old, _ = store.create("acct", ["verify"], quota=10)
    store.record_usage(old.key_id, 6)
    new, _ = store.rotate(old.key_id)
    assert new.account_id == old.key_id == store.get_by_lookup(old.key_id).account_id
    assert new.used_tokens == 6
    assert store.record_usage(new.key_id, 3) == 1          # 9 of 10 on the account
    assert store.get_by_lookup(old.key_id).used_tokens == 9
    with pytest.raises(QuotaExceeded):
        store.record_usage(old.key_id, 2)                  # the old key sees the same 9
    newer, _ = store.rotate(new.key_id)
    assert newer.account_id == old.key_id and newer.used_tokens == 9
    assert store.record_usage(newer.key_id, 1) == 0
    with pytest.raises(QuotaExceeded):
        store.record_usage(new.key_id, 1)


def test_rotation_shares_the_rate_windows(store):
    from cloud_api.ratelimit import RateLimiter

    old, _ = store.create("rate", ["verify"], rpm=2)
    new, _ = store.rotate(old.key_id)
    lim = RateLimiter(window_s=60)
    assert lim.hit_request(old).allowed and lim.hit_request(new).allowed
    assert not lim.hit_request(old).allowed and not lim.hit_request(new).allowed
    other, _ = store.create("other", ["verify"], rpm=2)
    assert lim.hit_request(other).allowed
