"""Data folders of installed pip packages, found *without importing them* (the data-only
packages that carry model weights and benchmark files pull in unrelated dependencies,
or nothing importable at all, when imported)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def package_dir(module: str) -> Path:
    """Folder of the installed package ``module`` (located with
    :func:`importlib.util.find_spec`, never imported).

    Raises:
        ModuleNotFoundError: the package is not installed (or is not a package folder).
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {module!r} is not installed (pip install it)")
    return Path(list(spec.submodule_search_locations)[0])
