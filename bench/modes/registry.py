"""The mode registry: mode name → :class:`~bench.modes.base.BenchMode` subclass.

Built-in modes register when :mod:`bench.modes` is imported; the peer engines
(:data:`PLUGIN_MODULES`) on the first lookup, never by ``import edge_sdk`` or
``import bench.modes``.
"""
from __future__ import annotations

from bench.modes.base import BenchMode

__all__ = ["MODES", "PLUGIN_MODULES", "load_plugins", "register_mode", "get_mode",
           "mode_names"]

MODES: dict[str, type[BenchMode]] = {}
"""Mode name → class. Fill with :func:`register_mode`."""

PLUGIN_MODULES = ("bench.modes.peers",)
"""Modules that register more modes, imported on first lookup (:func:`load_plugins`),
not when ``edge_sdk`` or this module is imported."""
_plugins_loaded = False


def load_plugins() -> None:
    """Import :data:`PLUGIN_MODULES` once (they call :func:`register_mode`)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    import importlib

    for mod in PLUGIN_MODULES:
        importlib.import_module(mod)


def register_mode(cls: type[BenchMode]) -> type[BenchMode]:
    """Class decorator adding a :class:`BenchMode` subclass to :data:`MODES` by its
    ``name``. Raises ValueError for an empty or already registered name."""
    if not cls.name:
        raise ValueError("a bench mode needs a name")
    if cls.name in MODES and MODES[cls.name] is not cls:
        raise ValueError(f"bench mode {cls.name!r} is already registered")
    MODES[cls.name] = cls
    return cls


def get_mode(name: str) -> type[BenchMode]:
    """The mode class for ``name``; ``MODE@N`` is an edge-drafting mode at fixed draft
    depth N (a depth sweep in one run, e.g. ``sr-ahead@6,sr-ahead@12``). Raises
    ValueError listing the known modes."""
    if name not in MODES:
        load_plugins()
    if name not in MODES and "@" in name:
        return _at_depth(name)
    try:
        return MODES[name]
    except KeyError:
        import difflib

        near = difflib.get_close_matches(name, mode_names(), n=3)
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        raise ValueError(f"unknown bench mode {name!r}{hint}; `specrelay bench "
                         f"--list-modes` lists the {len(MODES)} modes") from None


def _at_depth(name: str) -> type[BenchMode]:
    """Register and return ``MODE@N``: MODE with ``fixed_depth = N``. Raises ValueError
    for an unknown MODE, one without a draft depth, or N outside 1..MAX_DRAFT_TOKENS."""
    from edge_sdk.protocol.limits import MAX_DRAFT_TOKENS

    base, _, n = name.rpartition("@")
    cls = get_mode(base)
    if not hasattr(cls, "fixed_depth"):
        raise ValueError(f"bench mode {base!r} has no draft depth to fix ({name!r})")
    if not n.isdigit() or not 1 <= int(n) <= MAX_DRAFT_TOKENS:
        raise ValueError(f"{name!r}: the depth after @ must be in 1..{MAX_DRAFT_TOKENS}")
    sub = type(cls.__name__ + "AtDepth" + n, (cls,),
               {"name": name, "fixed_depth": int(n),
                "description": f"{cls.description} (depth {n})"})
    return register_mode(sub)


def mode_names() -> list[str]:
    """Registered mode names (plugins included), in registration order."""
    load_plugins()
    return list(MODES)
