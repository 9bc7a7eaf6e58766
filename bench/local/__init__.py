"""The local-target (CATS) benchmark: :mod:`.run` (the grid), :mod:`.cell` (one cell in
a fresh process, for its peak RSS), :mod:`.summary`."""
