"""The edge's default drafting policy: one definition, read by :class:`EdgeClient`, the
CLI (``generate``, ``demo``, ``edge-serve``, ``bench``), the OpenAI-compatible edge app
and the examples, so an app that embeds the SDK drafts as the benchmark's fastest
single-request mode does.

That mode is ``sr-ahead@6`` on the default pair (Qwen2.5-Coder-0.5B drafting for
Qwen2.5-Coder-1.5B, 1 edge core + 1 cloud core, ``medium`` link): draft depth 6,
interruptible proactive drafting (RAPID's IPDG: the next block is drafted while the
current one is verified) and pipelined verification (a proactive block is sent before
the previous verdict, PipeSpec-style). IPDG alone has a 1.15x better TPOT than
stop-and-wait on ``medium``; fixed depths 3-8 are within ~5-15 % of one another on this
pair, and depth 6 measured best across chat and code (depth 8 level with it within
run-to-run noise). The output is the target's whatever the policy: these are speed
settings only; ``proactive="off"`` spends no edge compute on blocks a miss discards.
"""

DEFAULT_DEPTH = 6
"""Draft tokens per block when no depth controller is given."""

DEFAULT_PROACTIVE = "ipdg"
"""Proactive drafting mode (``off`` is stop-and-wait)."""
