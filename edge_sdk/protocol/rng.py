"""The one seeding scheme: every random draw of a request comes from
``generator(seed, stream, index)``.

The request's ``seed`` is mixed with a named *stream* (which part of the protocol
draws) and an *index* (which round, block or position) by SplitMix64 (Steele, Lea and
Flood 2014, "Fast Splittable Pseudorandom Number Generators"), so

* the same ``(seed, stream, index)`` always gives the same draws: a run replays, and a
  retried verification of the same block re-draws the same uniforms;
* draws never depend on how many values an earlier (possibly discarded) use consumed:
  a proactive branch drafted for round i draws exactly what stop-and-wait would;
* different streams or indices give independent-looking generators.

Streams (constants below) and their index:

``DRAFT``
    edge, draft tokens of verification round i (index = round number, 0-based).
``DRAFT_OFFLINE``
    edge, the draft-only token while the cloud is unreachable (index = confirmed
    length, prompt included).
``CORRECTION``
    edge, the correction-token draws of round i (index = round number).
``VERIFY``
    cloud, acceptance uniforms, bonus, residual and proposal draws of a block (index =
    the block's position: the length of the context its first draft token extends,
    prompt included). Positions grow strictly from round to round, and a session
    re-created from the confirmed prefix (after a server restart) sees the same ones,
    so a resumed request draws exactly what the lost session would have.
``STREAM_DECODE``
    cloud, target-only streaming generation: one generator per stream request (index =
    confirmed length when the stream starts).
``LOCAL_DRAFT``
    edge, CATS on-device draft draws (index = the block's position + the draft's
    offset in the block: confirmed length + j).
``LOCAL_VERIFY``
    edge, CATS on-device verification: acceptance uniforms, residual and bonus of a
    block, and target-alone sampling (index = the block's position, confirmed length).
"""

from __future__ import annotations

import torch

__all__ = ["DRAFT", "DRAFT_OFFLINE", "CORRECTION", "VERIFY", "STREAM_DECODE",
           "LOCAL_DRAFT", "LOCAL_VERIFY", "mix", "generator"]

DRAFT = 1
DRAFT_OFFLINE = 2
CORRECTION = 3
VERIFY = 4
STREAM_DECODE = 5
LOCAL_DRAFT = 6
LOCAL_VERIFY = 7

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def fresh_seed() -> int:
    """A random seed (below 2**31) for a request that names none."""
    import secrets

    return secrets.randbelow(2 ** 31)


def _splitmix(z: int) -> int:
    """One SplitMix64 step on a 64-bit state: returns the mixed 64-bit output."""
    z = (z + _GOLDEN) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def mix(seed: int, stream: int, index: int) -> int:
    """The 63-bit generator seed of ``(seed, stream, index)`` (any Python ints; each is
    taken modulo 2**64). Deterministic across platforms and processes."""
    z = _splitmix(int(seed) & _MASK)
    z = _splitmix(z ^ (int(stream) & _MASK))
    z = _splitmix(z ^ (int(index) & _MASK))
    return z & ((1 << 63) - 1)


def generator(seed: int, stream: int, index: int) -> torch.Generator:
    """A fresh CPU ``torch.Generator`` for draw stream ``stream`` at ``index`` of the
    request seeded ``seed`` (module doc for the streams)."""
    return torch.Generator().manual_seed(mix(seed, stream, index))
