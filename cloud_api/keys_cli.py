"""``specrelay keys`` CLI: create / list / revoke / rotate / set-ed25519.

Mount with ``cli.add_command(keys)`` (``from cloud_api.keys_cli import keys``).
DB path: ``--db``, else ``$SPECRELAY_KEYS_DB``, else
``~/.config/specrelay/keys.sqlite3``.  Raw keys are printed only by ``create`` and
``rotate``, once; ``list`` never prints secrets.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import pathlib

import click

from cloud_api.keys import SCOPES, KeyNotFound, SQLiteKeyStore

DEFAULT_DB = os.path.join("~", ".config", "specrelay", "keys.sqlite3")


def _iso(ts: float | None) -> str | None:
    return None if ts is None else _dt.datetime.fromtimestamp(ts, _dt.timezone.utc) \
        .strftime("%Y-%m-%dT%H:%M:%SZ")


def _fmt_ts(ts: float | None) -> str:
    return _iso(ts) or "-"


def db_path(db: str | None = None) -> str:
    """The key store file: ``db``, else ``$SPECRELAY_KEYS_DB``, else the default."""
    return os.path.expanduser(db or os.environ.get("SPECRELAY_KEYS_DB") or DEFAULT_DB)


def _store(ctx: click.Context) -> SQLiteKeyStore:
    return ctx.obj["store_factory"]()


def _db_option(fn):
    """``--db`` on a subcommand too (``keys create --db X`` = ``keys --db X create``)."""
    def use(ctx, _param, value):
        if value is not None:
            path = os.path.expanduser(value)
            ctx.ensure_object(dict).update(path=path,
                                           store_factory=lambda: SQLiteKeyStore(path))
        return value
    return click.option("--db", "db_override", default=None, expose_value=False,
                        callback=use, help="Key store SQLite file (as `keys --db`).")(fn)


def _show_new(rec, raw: str) -> None:
    click.echo(f"key_id: {rec.key_id}")
    click.echo(f"api_key: {raw}")
    click.echo("Store this key now: it cannot be shown again.", err=True)


@click.group("keys")
@click.option("--db", "db", envvar="SPECRELAY_KEYS_DB", default=DEFAULT_DB,
              show_default=True, show_envvar=True,
              help="Key store SQLite file (the one `specrelay serve` reads).")
@click.pass_context
def keys(ctx: click.Context, db: str) -> None:
    """Manage API keys (stored hashed in a SQLite file; `serve --db` reads the same).

    \b
    Examples:
      specrelay keys create --name robot-7          (prints the key once)
      specrelay keys list
      specrelay keys revoke KEY_ID
    """
    path = os.path.expanduser(db)
    ctx.ensure_object(dict).update(path=path, store_factory=lambda: SQLiteKeyStore(path))


@keys.command("create")
@click.option("--name", required=True, help="Human-readable label.")
@click.option("--scopes", default="verify", show_default=True,
              help=f"Comma-separated subset of {sorted(SCOPES)}.")
@click.option("--rpm", type=click.IntRange(min=1), default=600, show_default=True,
              help="Requests per minute.")
@click.option("--tpm", type=click.IntRange(min=1), default=100_000, show_default=True,
              help="Verified tokens per minute.")
@click.option("--quota", type=click.IntRange(min=0), default=None,
              help="Total verified tokens (default unlimited).")
@click.option("--ed25519-public-key", "pub", type=click.Path(exists=True, dir_okay=False),
              default=None, help="PEM file; the key must then sign with Ed25519.")
@click.option("--allow-duplicate-name", is_flag=True,
              help="Create even if an active key already has this name.")
@_db_option
@click.pass_context
def create(ctx, name, scopes, rpm, tpm, quota, pub, allow_duplicate_name):
    """Create a key and print it once."""
    scope_set = [s.strip() for s in scopes.split(",") if s.strip()]
    pem = pathlib.Path(pub).read_bytes() if pub else None
    store = _store(ctx)
    same = [k.key_id for k in store.list(include_revoked=False) if k.name == name]
    if same and not allow_duplicate_name:
        raise click.BadParameter(f"an active key is already named {name!r} ({same[0]}): "
                                 "pick another name, `keys rotate` it, or pass "
                                 "--allow-duplicate-name", param_hint="--name")
    try:
        rec, raw = store.create(name, scope_set, rpm=rpm, tpm=tpm, quota=quota,
                                ed25519_public_key=pem)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    _show_new(rec, raw)
    click.echo(f"key store: {ctx.obj['path']}", err=True)


@keys.command("list")
@click.option("--json", "as_json", is_flag=True, help="JSON lines output.")
@click.option("--active", is_flag=True, help="Hide revoked keys.")
@_db_option
@click.pass_context
def list_(ctx, as_json, active):
    """List keys (no secrets)."""
    if not as_json:
        click.echo(f"{'KEY_ID':12}  {'STATUS':7}  {'SCOPES':12}  {'LIMITS':44}  "
                   f"{'CREATED':20}  NAME")
    for k in _store(ctx).list(include_revoked=not active):
        row = {"key_id": k.key_id, "name": k.name, "scopes": sorted(k.scopes),
               "rpm": k.rpm, "tpm": k.tpm, "quota": k.quota, "used_tokens": k.used_tokens,
               "created_at": _iso(k.created_at), "revoked_at": _iso(k.revoked_at),
               "ed25519": k.ed25519_public_key is not None, "rotated_from": k.rotated_from}
        if as_json:
            click.echo(json.dumps(row))
        else:
            status = "revoked" if k.revoked else "active"
            limits = (f"rpm={k.rpm} tpm={k.tpm} quota={k.quota or '-'} "
                      f"used={k.used_tokens}")
            click.echo(f"{k.key_id:12}  {status:7}  {','.join(row['scopes']):12}  "
                       f"{limits:44}  {_fmt_ts(k.created_at):20}  {k.name}")


def _with_key(fn):
    try:
        return fn()
    except KeyNotFound as exc:
        raise click.ClickException(f"no such key: {exc.args[0]}") from exc
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc


@keys.command("revoke")
@click.argument("key_id")
@_db_option
@click.pass_context
def revoke(ctx, key_id):
    """Revoke KEY_ID (takes effect on the next request)."""
    rec = _with_key(lambda: _store(ctx).revoke(key_id))
    click.echo(f"revoked {rec.key_id} at {_fmt_ts(rec.revoked_at)}")


@keys.command("rotate")
@click.argument("key_id")
@_db_option
@click.pass_context
def rotate(ctx, key_id):
    """Create a replacement for KEY_ID; the old key works until revoked."""
    rec, raw = _with_key(lambda: _store(ctx).rotate(key_id))
    _show_new(rec, raw)
    click.echo(f"old key {key_id} remains valid: revoke it once clients switched.", err=True)


@keys.command("set-ed25519")
@click.argument("key_id")
@click.argument("pem_path", type=click.Path(exists=True, dir_okay=False))
@_db_option
@click.pass_context
def set_ed25519(ctx, key_id, pem_path):
    """Register an Ed25519 public key (PEM) for KEY_ID; HMAC is then refused."""
    data = pathlib.Path(pem_path).read_bytes()
    rec = _with_key(lambda: _store(ctx).register_ed25519_public_key(key_id, data))
    click.echo(f"registered Ed25519 key for {rec.key_id}")
