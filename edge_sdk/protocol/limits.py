"""Limits shared by edge and cloud (one definition each).

**Draft depth** (gamma, ``g``): the number of draft tokens in one block, i.e. proposed
for one target verification pass. Controllers choose it per round (RAPID's ``L``), the
wire carries ``g`` tokens, the verifier refuses more than its ``max_block``.
"""

MAX_DRAFT_TOKENS = 16
"""The largest draft depth: the verifier's default ``max_block`` and the CLI's
``--depth`` range. A 9-token verify pass (block + the token before it) costs about a
1-token one on the default pair (bf16 on AMX); deeper blocks pay on code, where the
draft agrees with the target for long runs."""

CONTROLLER_MAX_DEPTH = 8
"""RAPID's ``L_max``: the deepest block an adaptive depth controller plans (its arms
1..L_max; more arms would need more rounds to learn)."""

MAX_PROACTIVE_ROOTS = 8
"""The most guessed bonus tokens (tree roots) of proactive drafting."""

MAX_SIBLINGS = 4
"""The most tree siblings at one draft position (greedy sibling trees,
:mod:`edge_sdk.protocol.tree`)."""
