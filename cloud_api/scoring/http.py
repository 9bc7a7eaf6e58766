"""One JSON POST to a scoring engine (the scorers run on the target thread, so a
blocking call is what they want)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from cloud_api.scoring.verifier import ScoringError

__all__ = ["post_json"]


def post_json(url: str, body: dict, timeout_s: float):
    """The decoded JSON answer of ``POST url``. Raises ScoringError: unreachable, an
    HTTP error status, a timeout (seconds) or a body that is not JSON."""
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ScoringError(f"{url}: {e}") from None
