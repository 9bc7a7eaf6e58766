"""Where specrelay keeps what it builds once: assembled GGUF files, dequantised
safetensors, exported ONNX drafts (``$SPECRELAY_CACHE``, default ``~/.cache/specrelay``)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache root (not created here)."""
    return Path(os.environ.get("SPECRELAY_CACHE", Path.home() / ".cache" / "specrelay"))
