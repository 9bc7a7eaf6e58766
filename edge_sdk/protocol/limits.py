"""Limits shared by edge and cloud (one definition each).

**Draft depth** (gamma, ``g``): the number of draft tokens in one block, i.e. proposed
for one target verification pass. Controllers choose it per round (RAPID's ``L``), the
wire carries ``g`` tokens, the verifier refuses more than its ``max_block``.
"""

MAX_DRAFT_TOKENS = 8
"""The largest draft depth: RAPID's ``L_max``, the verifier's default ``max_block`` and
the CLI's ``--depth`` range. A 9-token verify pass (block + the token before it) costs
about a 1-token one on the default pair (bf16 on AMX)."""

MAX_PROACTIVE_ROOTS = 8
"""The most guessed bonus tokens (tree roots) of proactive drafting."""
