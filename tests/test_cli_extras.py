"""A command whose optional dependency is missing fails with one line naming the extra."""

import click
from click.testing import CliRunner

import specrelay_cli


def _group_with(exc: BaseException) -> click.Group:
    @click.group(cls=specrelay_cli._Group)
    def g():
        pass

    @g.command()
    def run():
        raise exc
    return g


def test_missing_extra_is_named_in_one_line():
    r = CliRunner().invoke(_group_with(ModuleNotFoundError("no", name="limits")), ["run"])
    assert r.exit_code == 1
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and "[cloud]" in lines[0] and "limits" in lines[0]
    assert "Traceback" not in r.output


def test_every_optional_module_maps_to_a_declared_extra():
    import tomllib
    from pathlib import Path

    extras = tomllib.loads((Path(specrelay_cli.__file__).parents[1] / "pyproject.toml")
                           .read_text())["project"]["optional-dependencies"]
    assert set(specrelay_cli.EXTRA_OF_MODULE.values()) <= set(extras)


def test_other_import_errors_are_not_hidden():
    r = CliRunner().invoke(_group_with(ModuleNotFoundError("no", name="nonexistent_x")),
                           ["run"])
    assert isinstance(r.exception, ModuleNotFoundError)


def test_every_command_is_registered():
    """Commands are registered unconditionally: a broken import raises, it never makes a
    command disappear."""
    import click

    assert set(specrelay_cli.main.commands) == {
        "serve", "generate", "demo", "edge-serve", "keys", "export", "draft", "bench",
        "fsd", "wisv"}
    draft = specrelay_cli.main.commands["draft"]
    assert draft.list_commands(click.Context(draft)) == ["distill"]


def test_no_command_module_swallows_import_errors():
    import ast
    from pathlib import Path

    names = {"ImportError", "ModuleNotFoundError"}
    for path in Path(specrelay_cli.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                caught = {getattr(n, "id", None) for n in ast.walk(node.type)}
                assert not caught & names, f"{path.name}:{node.lineno} catches {caught}"


def test_a_lazy_command_missing_its_extra_names_it(monkeypatch):
    draft = specrelay_cli.main.commands["draft"]
    draft.commands.pop("distill", None)              # not yet imported in this process

    def broken():
        raise ModuleNotFoundError("No module named 'onnx'", name="onnx")

    monkeypatch.setitem(draft.lazy, "distill", broken)
    r = CliRunner().invoke(specrelay_cli.main, ["draft", "distill", "--help"])
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert r.exit_code == 1 and len(lines) == 1, r.output
    assert "[export]" in lines[0] and "onnx" in lines[0]


def test_help_imports_no_torch_and_no_server():
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys\nfrom specrelay_cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print([m for m in ('torch', 'aiohttp.web', 'edge_sdk.client') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(specrelay_cli.__file__).parents[1]).stdout
    assert out.strip().splitlines()[-1] == "[]"
