"""The weight file as *storage*: a memory-mapped safetensors checkpoint read at an
emulated storage bandwidth (CATS: the offloaded layers live on flash and are streamed
per pass; this machine has far more RAM than a robot, so the flash is emulated the way
``bench.linkem`` emulates a network link).

Reads go through our own ``mmap`` of the file (the offsets come from the safetensors
header: an 8-byte little-endian length, then a JSON table of ``dtype``, ``shape`` and
``data_offsets``) so that each read can be *released* afterwards with
``madvise(MADV_DONTNEED)``: a page that was read stays out of the process's resident
set once its bytes are copied into a reusable buffer, and peak RSS stays at resident
weights + one streamed layer + KV cache. (``safetensors.safe_open`` keeps its map for
the handle's life, so every page it touched would count in RSS; we use it for the
resident tensors, under a handle that is closed after loading.)

Bandwidth emulation: a read of ``n`` bytes must take at least ``n / rate`` seconds;
the missing time (after the real copy) is slept, and counted in :attr:`Storage.stats`.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["StorageProfile", "PROFILES", "parse_profile", "Storage", "StorageStats"]

_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)   # Linux >= 5.14

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
           "I64": torch.int64}


@dataclass(frozen=True)
class StorageProfile:
    """An emulated storage device: ``name`` and read ``bytes_per_s`` (0 = unthrottled:
    the real copy from the page cache)."""

    name: str
    bytes_per_s: float

    def seconds(self, nbytes: int) -> float:
        """Emulated time to read ``nbytes`` (s); 0 when unthrottled."""
        return nbytes / self.bytes_per_s if self.bytes_per_s > 0 else 0.0


PROFILES = {"nvme": StorageProfile("nvme", 2e9), "emmc": StorageProfile("emmc", 4e8),
            "ram": StorageProfile("ram", 0.0)}
"""Named profiles: NVMe SSD 2 GB/s, eMMC 400 MB/s, ``ram`` unthrottled."""


def parse_profile(text: str | StorageProfile) -> StorageProfile:
    """A profile from its name (``nvme``, ``emmc``, ``ram``) or ``<rate>MB/s`` /
    ``<rate>GB/s``. Raises ValueError for anything else."""
    if isinstance(text, StorageProfile):
        return text
    t = str(text).strip().lower()
    if t in PROFILES:
        return PROFILES[t]
    for unit, mult in (("gb/s", 1e9), ("mb/s", 1e6)):
        if t.endswith(unit):
            try:
                return StorageProfile(t, float(t[: -len(unit)]) * mult)
            except ValueError:
                break
    raise ValueError(f"storage profile {text!r}: expected {', '.join(PROFILES)} or "
                     "<rate>MB/s / <rate>GB/s")


@dataclass
class StorageStats:
    """Bytes read, real copy seconds and emulated (slept) seconds since creation."""

    bytes_read: int = 0
    copy_s: float = 0.0
    slept_s: float = 0.0
    reads: int = 0


class Storage:
    """A safetensors file, memory-mapped read-only, read at ``profile``'s bandwidth.

    Raises:
        OSError: the file cannot be opened. ValueError: not a safetensors file.
    """

    def __init__(self, path: str | Path, profile: StorageProfile | str = "ram"):
        self.path = Path(path)
        self.profile = parse_profile(profile)
        self.stats = StorageStats()
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                raise ValueError(f"{self.path}: not a safetensors file")
            header = json.loads(f.read(n))
            self._fd = os.dup(f.fileno())
        header.pop("__metadata__", None)
        self._base = 8 + n
        self.entries = {k: (v["dtype"], tuple(v["shape"]), *v["data_offsets"])
                        for k, v in header.items()}
        self._mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
        self._can_populate = True

    @contextlib.contextmanager
    def unthrottled(self):
        """Reads inside the block are not slowed to the profile's bandwidth (a one-off
        build: fitting a head, quantizing a draft; not a pass); the profile is restored
        after it, whatever happens."""
        prof, self.profile = self.profile, PROFILES["ram"]
        try:
            yield self
        finally:
            self.profile = prof

    def close(self) -> None:
        """Unmap the file (idempotent)."""
        if self._mm is not None:
            self._mm.close()
            os.close(self._fd)
            self._mm = None

    def nbytes(self, key: str) -> int:
        """Size of tensor ``key`` in the file (bytes). Raises KeyError."""
        _, _, a, b = self.entries[key]
        return b - a

    def _view(self, key: str) -> torch.Tensor:
        """A zero-copy tensor over the mapped bytes of ``key`` (read-only memory)."""
        dt, shape, a, b = self.entries[key]
        with warnings.catch_warnings():      # the map is read-only; we never write it
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self._mm, dtype=_DTYPES[dt], count=(b - a) //
                                    _DTYPES[dt].itemsize, offset=self._base + a)
        return flat.view(shape)

    def _populate(self, a: int, b: int) -> None:
        """Map the pages of file bytes ``[a, b)`` in one call (``MADV_POPULATE_READ``)
        instead of one page fault per 4 KiB during the copy (~2x faster copies of a
        93 MB layer); a kernel without it falls back to faulting."""
        if not self._can_populate:
            return
        lo, hi = self._pages(a, b)
        try:
            self._mm.madvise(_MADV_POPULATE_READ, lo, hi - lo)
        except OSError:
            self._can_populate = False

    def _pages(self, a: int, b: int) -> tuple[int, int]:
        """The page-aligned map range covering file bytes ``[a, b)``."""
        page = mmap.PAGESIZE
        lo = (self._base + a) // page * page
        return lo, min(-(-(self._base + b) // page) * page, len(self._mm))

    def _release(self, a: int, b: int) -> None:
        """Drop the mapped pages of file bytes ``[a, b)`` from our resident set."""
        lo, hi = self._pages(a, b)
        self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def read_into(self, key: str, out: torch.Tensor) -> int:
        """Copy tensor ``key`` into ``out`` (same shape; any dtype it casts to) and
        release its pages; the read is charged to the bandwidth. Returns the bytes read.
        Raises KeyError (unknown key) or ValueError (shape mismatch)."""
        dt, shape, a, b = self.entries[key]
        if tuple(out.shape) != shape:
            raise ValueError(f"{key}: file shape {shape}, buffer {tuple(out.shape)}")
        t0 = time.perf_counter()
        self._populate(a, b)
        out.copy_(self._view(key))
        self._release(a, b)
        self._charge(b - a, time.perf_counter() - t0)
        return b - a

    def read_rows(self, key: str, a: int, b: int) -> torch.Tensor:
        """Rows ``a..b-1`` of tensor ``key`` [N, ...] as a fresh tensor [b-a, ...] in the
        file's dtype (contiguous bytes: one read, charged to the bandwidth, its pages
        released). Raises KeyError, or ValueError for a range outside 0..N."""
        dt, shape, lo, hi = self.entries[key]
        if not 0 <= a <= b <= shape[0]:
            raise ValueError(f"{key}: rows {a}..{b} outside 0..{shape[0]}")
        row = (hi - lo) // shape[0]
        t0 = time.perf_counter()
        self._populate(lo + a * row, lo + b * row)
        out = self._view(key)[a:b].clone()
        self._release(lo + a * row, lo + b * row)
        self._charge((b - a) * row, time.perf_counter() - t0)
        return out

    def rows(self, key: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [n] of a 2-D tensor (an embedding lookup straight from storage,
        only the rows' bytes charged). Returns a fresh tensor [n, H]."""
        src = self._view(key)
        t0 = time.perf_counter()
        out = src[ids.long()].clone()
        dt, shape, a, b = self.entries[key]
        row = (b - a) // shape[0]
        for i in ids.tolist():
            self._release(a + i * row, a + (i + 1) * row)
        self._charge(row * ids.numel(), time.perf_counter() - t0)
        return out

    def _charge(self, nbytes: int, real_s: float) -> None:
        """Account ``nbytes`` read in ``real_s`` and sleep what the profile still owes."""
        owe = self.profile.seconds(nbytes) - real_s
        if owe > 0:
            time.sleep(owe)
            self.stats.slept_s += owe
        self.stats.bytes_read += nbytes
        self.stats.copy_s += real_s
        self.stats.reads += 1
