"""Early exits of the target for FSD's provisional verdicts (the FSD review, §III: a
verdict predicted at an intermediate layer of the server model is streamed before the
final one).

The exit head (tuned-lens translator + the model's final norm and LM head over a
frequency-ranked vocabulary subset) is :mod:`edge_sdk.exit_head`, shared with the edge's
CATS drafting and re-exported here; :mod:`cloud_api.exit_fit` fits the translators,
:mod:`cloud_api.exit_calibrate` measures per-layer agreement and
:mod:`cloud_api.exit_select` maps a ``--early-exit`` setting to a head. Mechanism only:
the verifier decides with the same acceptance rule as the final verdict.
"""

from __future__ import annotations

from edge_sdk.exit_head import ExitHead, decoder_layers, restricted_vocab, untrained_head

__all__ = ["ExitHead", "untrained_head", "restricted_vocab", "decoder_layers"]
