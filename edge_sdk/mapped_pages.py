"""Give back the checkpoint pages a prepacked model no longer reads.

``from_pretrained`` maps a safetensors checkpoint into memory and its tensors are views of
that map. Prepacking (:mod:`edge_sdk.packed`) copies every linear weight into oneDNN's
layout, after which the dense weights are not read again, yet each page the packing read
stays in the process's resident set (``RssFile``) for as long as the map lives, which is
as long as any tensor of the file does (the input embedding, the norms). A float32
Qwen2.5-Coder-1.5B serving load showed VmRSS 12.9 GB: 6.6 GB of packed weights and 6.3 GB
of the checkpoint's file pages. The kernel can reclaim clean file pages, but they count in
RSS, in the OOM killer's score and in a container's memory charge.

:func:`release_checkpoint_pages` calls ``madvise(MADV_DONTNEED)`` on those maps. On a
file-backed map this only drops the process's page-table entries: a tensor still in use
(the embedding) faults its pages back in from the page cache on its next read, with the
same bytes. It would lose data only on a *written* private page (copy-on-write), so a map
with any anonymous page is left alone.

Linux only (``/proc/self/smaps`` and ``madvise``); elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import sys
from dataclasses import dataclass

import torch

__all__ = ["FileMap", "file_maps_of", "model_tensors", "release_checkpoint_pages"]

log = logging.getLogger("specrelay.mapped_pages")


@dataclass(frozen=True)
class FileMap:
    """One file-backed map of this process: ``[start, end)`` addresses, the file's path,
    resident bytes and anonymous (written copy-on-write) bytes, from ``/proc/self/smaps``."""

    start: int
    end: int
    path: str
    rss: int
    anonymous: int


def _smaps() -> list[FileMap]:
    """The file-backed maps of this process (empty where ``/proc/self/smaps`` is absent)."""
    out: list[FileMap] = []
    try:
        lines = open("/proc/self/smaps", encoding="utf-8", errors="replace").read().splitlines()
    except OSError:
        return out
    head = None
    fields: dict[str, int] = {}

    def close():
        if head is not None and head[2].startswith("/"):
            out.append(FileMap(head[0], head[1], head[2], fields.get("Rss", 0) * 1024,
                               fields.get("Anonymous", 0) * 1024))

    for line in lines:
        first = line.split(None, 1)[0] if line else ""
        if "-" in first and not first.endswith(":"):        # a map's header line
            close()
            parts = line.split(None, 5)
            lo, hi = (int(a, 16) for a in parts[0].split("-"))
            head, fields = (lo, hi, parts[5].strip() if len(parts) > 5 else ""), {}
        elif first.endswith(":") and head is not None:
            bits = line.split()
            if len(bits) >= 2 and bits[1].isdigit():
                fields[bits[0][:-1]] = int(bits[1])
    close()
    return out


def file_maps_of(tensors) -> list[FileMap]:
    """The file-backed maps holding the data of any of ``tensors`` (CPU tensors; others
    and tensors in anonymous memory are skipped)."""
    maps = _smaps()
    found: dict[int, FileMap] = {}
    for t in tensors:
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        ptr = t.data_ptr()
        for m in maps:
            if m.start <= ptr < m.end:
                found[m.start] = m
                break
    return sorted(found.values(), key=lambda m: m.start)


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def release_checkpoint_pages(maps: list[FileMap]) -> int:
    """``madvise(MADV_DONTNEED)`` each of ``maps`` (from :func:`file_maps_of`, taken
    *before* the tensors were replaced) that is still mapped and has no written page.

    Args:
        maps: file-backed maps of a checkpoint.
    Returns:
        bytes of resident pages given back (0 off Linux, or where nothing was released).
    Raises:
        nothing: a map that cannot be advised is logged and skipped.
    """
    fn = _madvise()
    if fn is None or not maps:
        return 0
    now = {(m.start, m.end, m.path): m for m in _smaps()}
    released = 0
    for m in maps:
        cur = now.get((m.start, m.end, m.path))
        if cur is None:                      # unmapped meanwhile (every tensor freed)
            continue
        if cur.anonymous:                    # a written copy-on-write page: keep the map
            log.debug("not releasing %s: %d bytes written", m.path, cur.anonymous)
            continue
        if fn(ctypes.c_void_p(m.start), m.end - m.start, mmap.MADV_DONTNEED) != 0:
            log.debug("madvise(%s) failed: errno %d", m.path, ctypes.get_errno())
            continue
        released += cur.rss
    return released


def model_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of ``model`` (each once)."""
    return list(model.parameters()) + list(model.buffers())
