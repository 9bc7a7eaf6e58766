"""``python -m exporters.distill``: the ``distill`` command on its own."""

from exporters.distill.cli import distill_command

if __name__ == "__main__":
    distill_command()
