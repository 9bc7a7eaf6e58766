"""What every route of the verification app shares: the app key of the service, the
msgpack content type and the caller's identity. Imported by ``app`` and by the route
modules (``stream``), so neither imports the other's internals."""

from __future__ import annotations

from aiohttp import web

MSGPACK = "application/x-msgpack"
SERVICE = web.AppKey("service", object)
"""``app[SERVICE]``: the :class:`cloud_api.app.CloudService` of the app."""


def owner(request: web.Request) -> str | None:
    """The key id that signed ``request`` (None on an unauthenticated server): sessions
    belong to the key that created them."""
    key = request.get("api_key")
    return None if key is None else str(getattr(key, "key_id", key))
