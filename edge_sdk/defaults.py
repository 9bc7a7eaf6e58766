"""The edge's default drafting policy: one definition, read by :class:`EdgeClient`, the
CLI (``generate``, ``demo``, ``edge-serve``, ``bench``), the OpenAI-compatible edge app
and the examples, so an app that embeds the SDK drafts as the benchmark's fastest
single-request mode does: the bench mode ``sr-paced`` on the default pair
(Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B, 1 edge core + 1 cloud core).

Its pieces: blocks of at most depth 8, as deep as one verification round trip hides
(:data:`DEFAULT_CONTROLLER`); interruptible proactive drafting (RAPID's IPDG: the next
block is drafted while the current one is verified) with pipelined verification (a
proactive block is sent before the previous verdict, PipeSpec-style); greedy sibling
trees within the rows the server says a pass holds for free
(:data:`DEFAULT_SIBLINGS`). On an AMX Xeon, 8 + 8 prompts x 64 tokens, with the cloud's
bit-exact (row-invariant) verification and the int4 ONNX draft: 3.26x / 2.61x the target
alone (HumanEval / MT-Bench), 1.33x / 1.08x llama.cpp's best mode on both cores (README,
"Where it stands"). Depth 8 against depth 6 (geomean of chat and code, vs the target
alone in the same run): 1.77x / 1.73x on an AMX Xeon, and on an AVX-512-BF16 EPYC 1.91x
/ 1.79x and 2.00x / 1.92x on ``medium``, 1.74x / 1.67x on ``weak``, 1.69x / 1.58x on
``cellular-edge``; depth 12 is slower (1.60x on the Xeon). The output is the
target's whatever the policy: these are speed settings only; ``proactive="off"`` spends
no edge compute on blocks a miss discards.
"""

DEFAULT_DEPTH = 8
"""Draft tokens per block: the deepest block of the default controller, the depth of
``fixed``."""

DEFAULT_CONTROLLER = "paced"
"""Depth controller of a greedy request when none is given (a sampled one drafts the
fixed ``depth``, so that its seed replays its output whatever the timing):
:class:`edge_sdk.control.PacedDepth`, as many drafts as a verification round trip hides,
at most ``depth``, and 4 after a miss (nothing in flight to hide the drafting; the
next block is drafted behind it). On a quiet device it drafts depth 8 ahead of a block
in flight; with the edge's draft forwards 3x slower it drafts ~3 and is 1.13x / 1.16x
faster than depth 8 (HumanEval / MT-Bench, 6 + 6 prompts x 64 tokens, EPYC box,
README). The short block after a miss: 1.08x / 1.08x the rate of a full one on an AMX
Xeon, at 1.14x / 1.16x the target passes per token (README, "a short block after a
miss")."""

DEFAULT_PROACTIVE = "ipdg"
"""Proactive drafting mode (``off`` is stop-and-wait)."""

DEFAULT_PROACTIVE_MIN_HIT = 0.0
"""IPDG starts a proactive branch only when the block in flight is predicted to be
accepted whole with at least this probability (:func:`edge_sdk.proactive.hit_chance`);
0 drafts ahead after every block. 0.3 halves the draft tokens a device discards (0.49x /
0.45x NPDG's at depth 8 on a quiet / slowed edge) but skips blocks that were accepted
whole after all: 0.96x / 0.90x the speed of the default on HumanEval / MT-Bench (README,
"Sibling trees and skipped branches"), so it is off by default."""

DEFAULT_SIBLINGS = "auto"
"""Greedy sibling trees (SpecInfer / Sequoia): the draft's two next-best tokens beside
the positions it is least sure of, within the rows the server advertises as free
(``free_rows``: 16 for a bf16 target on an AMX CPU, where a pass of 16 rows costs what
one does; 0 elsewhere, where the client drafts chains). On the AMX Xeon, 8 + 8 prompts
x 64 tokens, against chains in the same run (HumanEval / MT-Bench): 1.055x / 1.063x
with this default (3.28x / 2.57x the target alone), and 1.05x / 1.04x, 1.04x / 1.08x,
1.03x / 0.98x with ``siblings=2`` in three earlier runs; 6-8 % fewer target passes per
token in each (README, "Sibling trees by default")."""
