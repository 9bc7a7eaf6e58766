"""Network profiles of the link emulator and the parsers of their CLI spellings.

A :class:`Profile` is the link model of :mod:`bench.linkem.emulator` (bandwidth per
direction, round-trip delay, jitter, loss); :data:`PROFILES` are the benchmark's named
links. :func:`parse_profile` builds one from a name and/or ``--uplink``-style overrides.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

__all__ = ["SEGMENT_BYTES", "Profile", "PROFILES", "parse_profile", "parse_rate",
           "parse_duration", "parse_loss"]

SEGMENT_BYTES = 1500
"""Size of one emulated segment in bytes (loss and jitter are applied per segment)."""


@dataclass(frozen=True)
class Profile:
    """A network profile.

    Attributes:
        name: label used in results.
        uplink_bps: client→server bandwidth in bits/s (``None`` = unlimited).
        downlink_bps: server→client bandwidth in bits/s (``None`` = unlimited).
        rtt_s: round-trip propagation delay in seconds (each direction gets half).
        jitter_s: jitter amplitude in seconds (half-width for ``uniform``, standard
            deviation for ``normal``), applied per segment and direction.
        loss: probability in [0, 1] that a segment is lost and retransmitted.
        jitter_dist: ``"uniform"`` or ``"normal"``.
        rto_min_s: lower bound of the retransmission timeout in seconds.
        burst_bytes: token-bucket depth in bytes (what an idle link sends at once).
    """

    name: str
    uplink_bps: float | None
    downlink_bps: float | None
    rtt_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0
    jitter_dist: str = "uniform"
    rto_min_s: float = 0.2
    burst_bytes: int = 2 * SEGMENT_BYTES

    def __post_init__(self) -> None:
        for f in ("uplink_bps", "downlink_bps"):
            v = getattr(self, f)
            if v is not None and not v > 0:
                raise ValueError(f"Profile.{f} must be > 0 bits/s or None, got {v!r}")
        if self.rtt_s < 0 or self.jitter_s < 0 or self.rto_min_s < 0:
            raise ValueError("Profile rtt_s, jitter_s and rto_min_s must be >= 0 seconds")
        if not 0.0 <= self.loss <= 1.0:
            raise ValueError(f"Profile.loss must be in [0, 1], got {self.loss!r}")
        if self.jitter_dist not in ("uniform", "normal"):
            raise ValueError(f"Profile.jitter_dist must be 'uniform' or 'normal', got {self.jitter_dist!r}")
        if self.burst_bytes < 0:
            raise ValueError("Profile.burst_bytes must be >= 0")

    @property
    def rto_s(self) -> float:
        """Retransmission timeout in seconds: ``max(rto_min_s, 2 * rtt_s)``."""
        return max(self.rto_min_s, 2.0 * self.rtt_s)

    def to_dict(self) -> dict:
        """Plain dict (for ``results.json`` config)."""
        return dataclasses.asdict(self)


_M = 1e6
PROFILES: dict[str, Profile] = {
    "strong": Profile("strong", 250 * _M, 2500 * _M, 0.020),
    "medium": Profile("medium", 150 * _M, 1000 * _M, 0.040),
    "weak": Profile("weak", 50 * _M, 150 * _M, 0.080),
    "cellular-edge": Profile("cellular-edge", 5 * _M, 20 * _M, 0.120, jitter_s=0.010, loss=0.005),
}
"""The benchmark's network profiles (bandwidths in bits/s, delays in seconds)."""


# --------------------------------------------------------------------------- parsing

_NUM = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_RATE_RE = re.compile(_NUM + r"\s*([kmgt]?)\s*(bits?/s|bits?|bps|b/s|bytes?/s)?", re.I)
_DUR_RE = re.compile(_NUM + r"\s*(us|µs|ms|s|sec|secs|seconds?)", re.I)
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(value: str | float | int | None) -> float | None:
    """Parse a bandwidth into bits/s; ``None``/``"unlimited"``/``"inf"`` → ``None``.

    Numbers are bits/s. Strings: ``"10mbit"``, ``"10Mbit/s"``, ``"10mbps"``, ``"500kbit"``,
    ``"1.5gbit"``, ``"20000000"`` (bits/s). Note that unlike ``tc``, ``bps`` means *bits*
    per second here; ``"1MByte/s"``-style ``byte/s`` suffixes are bytes (×8).
    """
    if value is None:
        return None
    if isinstance(value, (int, float)):
        if not value > 0:
            raise ValueError(f"bandwidth must be > 0 bits/s, got {value!r}")
        return float(value)
    s = str(value).strip()
    if s.lower() in ("unlimited", "inf", "none", ""):
        return None
    m = _RATE_RE.fullmatch(s)
    if not m:
        raise ValueError(f"cannot parse bandwidth {value!r}; use e.g. '10mbit', '500kbit', '1gbit'")
    bits = float(m.group(1)) * _PREFIX[m.group(2).lower()]
    if m.group(3) and m.group(3).lower().startswith("byte"):
        bits *= 8
    if not bits > 0:
        raise ValueError(f"bandwidth must be > 0, got {value!r}")
    return bits


def parse_duration(value: str | float | int | None) -> float | None:
    """Parse a duration into seconds: numbers are seconds; strings need a unit
    (``"60ms"``, ``"0.06s"``, ``"500us"``) so that ``"60"`` is never misread."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        secs = float(value)
    else:
        m = _DUR_RE.fullmatch(str(value).strip())
        if not m:
            raise ValueError(f"cannot parse duration {value!r}; give a unit, e.g. '60ms' or '0.06s'")
        unit = m.group(2).lower()
        scale = 1e-6 if unit in ("us", "µs") else 1e-3 if unit == "ms" else 1.0
        secs = float(m.group(1)) * scale
    if secs < 0:
        raise ValueError(f"duration must be >= 0 s, got {value!r}")
    return secs


def parse_loss(value: str | float | None) -> float | None:
    """Parse a loss probability: ``0.005``, ``"0.005"`` or ``"0.5%"`` → 0.005."""
    if value is None:
        return None
    if isinstance(value, str):
        s = value.strip()
        p = float(s[:-1]) / 100.0 if s.endswith("%") else float(s)
    else:
        p = float(value)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"loss must be in [0, 1] (or 0-100%), got {value!r}")
    return p


def parse_profile(
    name_or_none: str | None,
    uplink: str | float | None = None,
    downlink: str | float | None = None,
    rtt: str | float | None = None,
    jitter: str | float | None = None,
    loss: str | float | None = None,
) -> Profile:
    """Build a :class:`Profile` from a name in :data:`PROFILES` and/or CLI-style overrides.

    ``parse_profile("weak")`` → the named profile; ``parse_profile(None, "10mbit",
    "50mbit", "60ms")`` → a custom profile named ``"custom"``; overrides on a named
    profile give ``"<name>+custom"``. ``parse_profile(None)`` with no overrides is an
    unshaped pass-through named ``"none"``. See :func:`parse_rate`,
    :func:`parse_duration`, :func:`parse_loss` for the accepted formats.
    """
    overrides = {
        "uplink_bps": parse_rate(uplink),
        "downlink_bps": parse_rate(downlink),
        "rtt_s": parse_duration(rtt),
        "jitter_s": parse_duration(jitter),
        "loss": parse_loss(loss),
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if name_or_none:
        try:
            base = PROFILES[name_or_none]
        except KeyError:
            raise ValueError(
                f"unknown network profile {name_or_none!r}; choose one of {sorted(PROFILES)} "
                "or give --uplink/--downlink/--rtt"
            ) from None
        name = f"{base.name}+custom" if overrides else base.name
    else:
        base = Profile("none", None, None)
        name = "custom" if overrides else "none"
    return dataclasses.replace(base, name=name, **overrides)
