"""The user-space link emulator: named network profiles and the shaping TCP proxy.

* :mod:`bench.linkem.profiles` — :class:`Profile` (bandwidth, RTT, jitter, loss),
  :data:`PROFILES` and the parsers of ``--uplink 10mbit --rtt 60ms``-style values;
* :mod:`bench.linkem.emulator` — :class:`LinkEmulator` (asyncio proxy, token bucket
  per direction) and :class:`LinkEmulatorThread` (the same on its own thread).
"""
from bench.linkem.emulator import LinkEmulator, LinkEmulatorThread, LinkStats
from bench.linkem.profiles import (PROFILES, Profile, parse_duration, parse_loss,
                                   parse_profile, parse_rate)

__all__ = ["Profile", "PROFILES", "LinkStats", "LinkEmulator", "LinkEmulatorThread",
           "parse_profile", "parse_rate", "parse_duration", "parse_loss"]
