"""``python -m specrelay_cli``: the ``specrelay`` command."""

import sys

from specrelay_cli import main

if __name__ == "__main__":
    sys.exit(main(prog_name="specrelay"))
