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

MAX_NEW_TOKENS = 32768
"""The most tokens a client asks for in one request (the CLI's ``--max-new-tokens``,
``edge-serve --default-max-tokens``, the examples): the default target's context
(Qwen2.5-Coder, 32,768 positions). A server caps prompt plus new tokens further at its
own context (``max_context`` in ``/healthz``; 400 ``max_new_tokens`` beyond it)."""

CREATE_TIMEOUT_S_PER_TOKEN = 0.02
"""Seconds a session create may take per prompt token on top of the transport's
per-request timeout: the cloud prefills the prompt before it answers, 8.3 ms a token on
one core of this project's reference box (20,029 tokens in 167 s), so 0.02 s leaves
2.4x for a busier or slower cloud before a long prompt's create is retried."""
