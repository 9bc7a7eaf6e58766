"""A click group whose subcommands are imported only when one is looked up (run, or
listed in that group's ``--help``): a command module that imports torch at its top stays
out of ``specrelay --help``."""

from __future__ import annotations

from typing import Callable

import click

__all__ = ["LazyGroup"]


class LazyGroup(click.Group):
    """``lazy``: subcommand name -> a function returning the command (it does the
    import). An import error propagates (the top-level group names a missing extra)."""

    def __init__(self, *args, lazy: dict[str, Callable[[], click.Command]] | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy and cmd_name not in self.commands:
            self.add_command(self.lazy[cmd_name](), cmd_name)
        return super().get_command(ctx, cmd_name)
