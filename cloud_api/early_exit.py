"""Early exits of the target for FSD's provisional verdicts (the FSD review, §III:
a verdict predicted at an intermediate layer of the server model is streamed before
the final one).

An :class:`ExitHead` turns the residual stream after decoder layer ``layer`` into
early logits: an optional affine *translator* (the tuned lens, Belrose et al. 2023,
§3: an affine map per layer fitted to the final layer's hidden state) followed by the
model's own final norm and LM head, restricted to a vocabulary subset so that the
exit costs a small fraction of the pass (FR-Spec's frequency-ranked vocabulary;
byte-level BPE ids are close to frequency rank, so the subset is the first ids plus
the special tokens). An untrained exit (no translator) is a weak predictor on models
not trained for it (LayerSkip §1); :mod:`cloud_api.exit_fit` fits translators and
reports per-layer agreement; :mod:`cloud_api.exit_select` maps a ``--early-exit``
setting to a head.

The mechanism lives in :mod:`edge_sdk.exit_head` (shared with the edge's CATS
drafting) and is re-exported here. Mechanism only: :meth:`ExitHead.logits` has no
policy; the verifier decides with the same acceptance rule as the final verdict
(``edge_sdk.protocol.sampling``).
"""

from __future__ import annotations

from edge_sdk.exit_head import ExitHead, decoder_layers, restricted_vocab, untrained_head

__all__ = ["ExitHead", "untrained_head", "restricted_vocab", "decoder_layers"]
