"""The server's FSD exit head for a ``--early-exit`` setting (the FSD review, §III):
off, the preset's calibrated layer from the fit cache (:mod:`cloud_api.exit_fit`), a
layer fitted on first use, or an untrained exit (:mod:`cloud_api.early_exit`). Apart
from both so that neither imports the other."""

from __future__ import annotations

import logging

from cloud_api import exit_fit
from cloud_api.early_exit import ExitHead, untrained_head

__all__ = ["early_head_for"]

log = logging.getLogger("cloud_api")


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
    text = _text(setting)
    if text == "off":
        return None
    if text.startswith("untrained:"):
        return untrained_head(model, _layer(text.split(":", 1)[1]))
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


def check_setting(setting: str | int | None) -> None:
    """Raises ValueError (one line) unless ``setting`` parses as an ``--early-exit``
    value (see :func:`early_head_for`; whether the layer exists needs the model)."""
    text = _text(setting)
    if text not in ("off", "auto", "fit"):
        _layer(text.split(":", 1)[1] if text.startswith("untrained:") else text)


def _text(setting: str | int | None) -> str:
    return "off" if setting is None else str(setting).strip().lower()


def _layer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--early-exit takes off, auto, fit, a layer number or "
                         f"untrained:N, not {text!r}") from None
