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

    extras = tomllib.loads((Path(specrelay_cli.__file__).parent / "pyproject.toml")
                           .read_text())["project"]["optional-dependencies"]
    assert set(specrelay_cli.EXTRA_OF_MODULE.values()) <= set(extras)


def test_other_import_errors_are_not_hidden():
    r = CliRunner().invoke(_group_with(ModuleNotFoundError("no", name="nonexistent_x")),
                           ["run"])
    assert isinstance(r.exception, ModuleNotFoundError)
