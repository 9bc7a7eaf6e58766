"""Pre-flight checks of ``generate``: the ``--url`` is an http(s) URL and a
verification API answers there, before any model loads."""

from __future__ import annotations

import asyncio

import click


def check_url(url: str) -> None:
    """Raises click.BadParameter unless ``url`` is an http(s) URL with a host
    (:func:`edge_sdk.preflight.check_url`)."""
    from edge_sdk.preflight import check_url as sdk_check

    try:
        sdk_check(url)
    except ValueError:
        raise click.BadParameter(f"{url!r} is not an http:// or https:// URL",
                                 param_hint="--url") from None


def probe_api(url: str, ca_cert: str | None, wait_s: float) -> dict:
    """``GET /healthz`` through the SDK's :class:`Transport` until it answers or ``wait_s``
    seconds pass (at least one try); returns its JSON (``max_context`` among it; {} if
    not JSON). Raises click.ClickException with what to do: nothing listening, an
    untrusted certificate (never retried), or not the API."""
    from edge_sdk.preflight import json_object
    import ssl
    import time

    from edge_sdk.transport import UNREACHABLE
    from edge_sdk.transport import RemoteError, TLSVerifyError, Transport

    ctx = ssl.create_default_context(cafile=ca_cert) if ca_cert else None

    async def once():
        t = Transport(url, retries=0, timeout_s=5.0, ssl_context=ctx)
        try:
            body, _ = await t.request("GET", "/healthz")
        finally:
            await t.close()
        return json_object(body)

    t0 = time.monotonic()
    while True:
        try:
            return asyncio.run(once())
        except TLSVerifyError as e:
            raise click.ClickException(str(e)) from None
        except RemoteError as e:
            raise click.ClickException(f"{url}/healthz answered HTTP {e.status}: is this a "
                                       "specrelay verification API?") from None
        except (*UNREACHABLE, OSError) as e:
            if time.monotonic() - t0 >= wait_s:
                reason = (str(e).splitlines()[0] if str(e) else type(e).__name__).replace(
                    " ssl:default", "")
                raise click.ClickException(
                    f"cannot reach {url}: is `specrelay serve` running there? ({reason}; "
                    f"gave up after {time.monotonic() - t0:.0f} s, --offline-timeout "
                    "waits longer)") from None
            time.sleep(0.5)


def check_key(url: str, signer, ca_cert: str | None) -> str | None:
    """Ask the API whether it accepts ``signer``'s key, before any model loads
    (:func:`edge_sdk.transport.key_refusal`: a signed ``GET /v1/key``). Returns None
    when accepted, else the refusal as one line (``HTTP 401 unknown_key: ...``).
    Without a signer the request goes unsigned: a server that requires keys answers 401
    ``missing_credentials`` (no key given), one run with ``--insecure-no-auth`` 200."""
    import ssl

    from edge_sdk.transport import RemoteError, Transport, key_refusal

    ctx = ssl.create_default_context(cafile=ca_cert) if ca_cert else None

    async def once():
        t = Transport(url, signer=signer, retries=0, timeout_s=5.0, ssl_context=ctx)
        try:
            return await key_refusal(t)
        finally:
            await t.close()

    try:
        refused = asyncio.run(once())
    except RemoteError:     # not about the key (429, 5xx): the run itself will say
        return None
    return None if refused is None else str(refused)
