"""The link state a semantic session reports with each block (WISV §III-C: the cloud's
acceptance threshold relaxes as the link worsens, because a saved round is worth more
on a bad link).

The report is ``(rtt_s, uplink_bps, round_s)``: the round-trip time in seconds, the
uplink rate in bits per second, and the mean wall time of the request's recent rounds in
seconds (:data:`edge_sdk.protocol.wire.CHANNEL_RANGES` bounds each).

With a ``link`` (anything with ``rtt_s`` and ``uplink_bps`` attributes or keys, e.g. a
benchmark network profile) the RTT and rate are the link's; without one the RTT is the
mean measured network time of recent rounds (send -> verdict minus the target's compute:
it holds the block's upload time too) and the rate is reported as unlimited
(:data:`UNKNOWN_UPLINK_BPS`, since that network time already counts the upload). Before
the first measurement the RTT is 0: the strictest threshold, so a request starts
conservatively.
"""

from __future__ import annotations

from collections import deque

from edge_sdk.protocol.wire import CHANNEL_RANGES

__all__ = ["ChannelEstimator", "UNKNOWN_UPLINK_BPS"]

UNKNOWN_UPLINK_BPS = CHANNEL_RANGES[1][2]
"""The uplink rate reported when it is not known (the range's top, bits per second)."""


def _get(link, name: str):
    if link is None:
        return None
    v = link.get(name) if isinstance(link, dict) else getattr(link, name, None)
    return None if v is None else float(v)


def _clamp(x: float, i: int) -> float:
    _, lo, hi = CHANNEL_RANGES[i]
    return float(min(hi, max(lo, x)))


class ChannelEstimator:
    """One request's channel report.

    Args:
        link: the link's ``rtt_s`` (seconds) and ``uplink_bps`` (bits per second), or
            None (measured, see the module docstring).
        window: rounds averaged for the measured figures.
    Raises:
        ValueError: a link whose ``rtt_s`` is negative or ``uplink_bps`` not positive.
    """

    def __init__(self, link=None, window: int = 8):
        self.rtt_s, self.uplink_bps = _get(link, "rtt_s"), _get(link, "uplink_bps")
        if self.rtt_s is not None and not self.rtt_s >= 0:
            raise ValueError("link rtt_s must be >= 0 seconds")
        if self.uplink_bps is not None and not self.uplink_bps > 0:
            raise ValueError("link uplink_bps must be > 0 bits/s")
        self._net = deque(maxlen=window)
        self._round = deque(maxlen=window)

    def observe(self, net_s: float | None, round_s: float) -> None:
        """One round: its network seconds (send -> verdict minus target compute; None
        when the round has no figure of its own, e.g. a block sent ahead) and its wall
        seconds (previous verdict -> this one)."""
        if net_s is not None:
            self._net.append(max(0.0, float(net_s)))
        self._round.append(max(0.0, float(round_s)))

    def state(self) -> tuple[float, float, float]:
        """``(rtt_s, uplink_bps, round_s)``, each clamped to its wire range."""
        rtt = self.rtt_s if self.rtt_s is not None else (
            sum(self._net) / len(self._net) if self._net else 0.0)
        up = self.uplink_bps if self.uplink_bps is not None else UNKNOWN_UPLINK_BPS
        rnd = sum(self._round) / len(self._round) if self._round else 0.0
        return _clamp(rtt, 0), _clamp(up, 1), _clamp(rnd, 2)
