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
reports per-layer agreement.

The mechanism lives in :mod:`edge_sdk.exit_head` (shared with the edge's CATS
drafting) and is re-exported here. Mechanism only: :meth:`ExitHead.logits` has no
policy; the verifier decides with the same acceptance rule as the final verdict
(``edge_sdk.protocol.sampling``).
"""

from __future__ import annotations

import logging

from edge_sdk.exit_head import ExitHead, decoder_layers, restricted_vocab, untrained_head

log = logging.getLogger("cloud_api")

__all__ = ["ExitHead", "untrained_head", "restricted_vocab", "decoder_layers",
           "early_head_for"]


def early_head_for(model, tokenizer, setting: str | int | None,
                   preset: str | None = None) -> ExitHead | None:
    """The server's exit head for an ``--early-exit`` setting.

    Args:
        setting: ``off``/None (no early verdicts); ``auto`` (the preset's calibrated
            layer, vocabulary and rule, from the fitted head in the cache; none cached
            or no calibrated default: off, with a log line); ``fit`` (the same, fitting
            the head on first use: about a minute for a 1.5B target); an integer layer
            (fitted on first use; the preset's vocabulary and rule, else 32768 and 1);
            ``untrained:N`` (norm + head at layer N, nothing fitted; for tests).
        preset: the target's preset name (``qwen2.5-coder-1.5b``), for the defaults.
    Raises:
        ValueError: an unparsable setting or a layer outside the model.
    """
    text = "off" if setting is None else str(setting).strip().lower()
    if text == "off":
        return None
    if text.startswith("untrained:"):
        return untrained_head(model, _layer(text.split(":", 1)[1]))
    from cloud_api import exit_fit

    dflt = exit_fit.EARLY_EXIT_DEFAULTS.get(preset or "", {})
    if text in ("auto", "fit"):
        if not dflt:
            log.info("early exits off: no calibrated default for %s (pass "
                     "--early-exit LAYER, or run specrelay fsd calibrate)", preset)
            return None
        layer = dflt["layer"]
    else:
        layer = _layer(text)
    vocab, topk = dflt.get("vocab", 32768), dflt.get("accept_topk", 1)
    head = exit_fit.load_exit_head(model, layer, vocab, topk)
    if head is None and text == "auto":
        log.info("early exits off: no fitted exit head for %s layer %d in the cache "
                 "(serve with --early-exit fit, or run specrelay fsd calibrate)",
                 preset, layer)
        return None
    return head or exit_fit.load_or_fit_exit_head(model, tokenizer, layer, vocab, topk)


def _layer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--early-exit takes off, auto, fit, a layer number or "
                         f"untrained:N, not {text!r}") from None
