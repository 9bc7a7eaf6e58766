"""One-off measurements behind figures quoted in issue notes (not part of `specrelay bench`):
``python -m bench.probes.pass_cost`` and ``python -m bench.probes.draft_confidence``."""
