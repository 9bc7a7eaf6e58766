"""The layout's rules, checked on the source: no import cycles between modules, and what
importing the SDK or the cloud app pulls in."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("edge_sdk", "cloud_api", "exporters", "bench", "specrelay_cli", "specrelay_data")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = p
    return mods


def _owner(name: str, mods) -> str | None:
    """The module of ours that ``import name`` loads last (the longest known prefix)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports (at any depth in the file, function-level
    imports included: a lazy import is still a dependency)."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {_owner(a.name, mods) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for a in node.names:
                    full = f"{base}.{a.name}"
                    deps.add(_owner(full if full in mods else base, mods))
        graph[name] = {d for d in deps if d and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = import_graph()
    assert "edge_sdk.client" in graph and "cloud_api.app" in graph   # the walk saw them
    assert cycles(graph) == []


def test_no_hidden_imports():
    """Imports are statements the cycle check can see: no ``__import__("...")``."""
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "__import__":
                raise AssertionError(f"{path.relative_to(ROOT)}:{node.lineno}: __import__")


#: Imports from the SDK into exporters allowed anyway, each with its reason. The SDK is
#: what an app embeds; exporters (ONNX/TensorRT compile, distillation) depend on it,
#: never the other way (a missing ONNX export is built by a caller that passes
#: ``export=`` to ``edge_sdk.drafters.runtime.build_drafter``).
SDK_TO_EXPORTERS_ALLOWED: dict[tuple[str, str], str] = {}
"""``(module, import) -> why``: edge_sdk -> exporters imports that are allowed (none:
the CLI, bench and examples export on first use through ``exporters.onnx.first_use``)."""


def upward_imports(graph: dict[str, set[str]], low: str, high: str,
                   allowed=frozenset()) -> list[tuple[str, str]]:
    """``(module, dependency)`` pairs where a module of package ``low`` imports one of
    package ``high`` (lazy imports included), minus the ``allowed`` pairs."""
    def under(m, p):
        return m == p or m.startswith(p + ".")

    return sorted((m, d) for m, deps in graph.items() if under(m, low)
                  for d in deps if under(d, high) and (m, d) not in allowed)


def test_upward_import_check_finds_a_lazy_import():
    g = {"edge_sdk.a": {"exporters.onnx.x"}, "edge_sdk.b": {"edge_sdk.a"},
         "exporters.onnx.x": {"edge_sdk.b"}}
    assert upward_imports(g, "edge_sdk", "exporters") == [("edge_sdk.a", "exporters.onnx.x")]
    assert upward_imports(g, "edge_sdk", "exporters",
                          {("edge_sdk.a", "exporters.onnx.x")}) == []


def test_sdk_imports_no_exporters():
    """Not even lazily: the edge SDK loads drafts, the exporters build them."""
    graph = import_graph()
    assert "exporters.onnx.first_use" in graph and "edge_sdk.drafters.runtime" in graph
    assert upward_imports(graph, "edge_sdk", "exporters", set(SDK_TO_EXPORTERS_ALLOWED)) == []
    for (m, d) in SDK_TO_EXPORTERS_ALLOWED:   # an allowance that is no longer used goes
        assert d in graph.get(m, set()), f"unused allowance {m} -> {d}"


def test_server_exporters_and_sdk_import_no_bench():
    """Not even lazily: the benchmark stands above the server, the exporters and the SDK
    (the prompt sets they share live in ``specrelay_data``), and the prompt reader
    imports none of them."""
    graph = import_graph()
    for low in ("cloud_api", "exporters", "edge_sdk", "specrelay_data"):
        assert upward_imports(graph, low, "bench") == [], low
    for high in ("cloud_api", "exporters"):
        assert upward_imports(graph, "specrelay_data", high) == []


def _loaded_after(code: str) -> tuple[set[str], dict]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_VERBOSITY")}
    probe = (f"{code}\nimport json, os, sys\n"
             "print(json.dumps([sorted(sys.modules), os.environ.get('HF_HUB_OFFLINE')]))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, check=True,
                         capture_output=True, text=True).stdout
    import json

    mods, offline = json.loads(out.strip().splitlines()[-1])
    return set(mods), {"HF_HUB_OFFLINE": offline}


def _under(mods: set[str], prefixes) -> list[str]:
    return sorted(m for m in mods if any(m == p or m.startswith(p + ".") for p in prefixes))


def test_importing_the_sdk_loads_no_server_bench_or_training_code():
    mods, env = _loaded_after("import edge_sdk\nfrom edge_sdk import EdgeClient, "
                              "SamplingConfig, generate, check_api, RemoteError")
    assert "edge_sdk.client" in mods
    assert _under(mods, ("aiohttp.web", "cloud_api", "exporters", "bench",
                         "matplotlib", "specrelay_cli", "onnx", "prometheus_client",
                         "limits", "transformers")) == []    # transformers: on first use
    assert env["HF_HUB_OFFLINE"] is None, "importing the SDK changed the host's environment"


def test_importing_the_edge_server_loads_no_exporters():
    """The one allowed SDK -> exporters import stays inside the edge-serve command."""
    mods, _ = _loaded_after("import edge_sdk.openai_server\nimport edge_sdk.drafters.runtime")
    assert "edge_sdk.openai_server" in mods
    assert _under(mods, ("exporters", "bench", "onnx")) == []


def test_importing_the_cloud_app_loads_no_edge_client():
    mods, _ = _loaded_after("import cloud_api.app")
    assert "cloud_api.stream" in mods
    assert _under(mods, ("edge_sdk.client", "edge_sdk.control", "edge_sdk.proactive",
                         "edge_sdk.drafters", "bench", "exporters")) == []


def test_sources_cite_papers_not_internal_documents():
    """Docstrings and comments name the paper and section, not design files or ticket
    numbers that are not in the repository."""
    import re

    bad = re.compile(r"SPEC §|CASES \d|issue[ -]#\d")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in _modules().values()
            for i, line in enumerate(p.read_text().splitlines(), 1) if bad.search(line)]
    assert hits == []
