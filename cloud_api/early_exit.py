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

Mechanism only: :meth:`ExitHead.logits` has no policy; the verifier decides with the
same acceptance rule as the final verdict (``edge_sdk.protocol.sampling``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["ExitHead", "untrained_head", "restricted_vocab", "decoder_layers"]


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of a HF causal LM (``model.model.layers``). Raises
    TypeError for an architecture without them."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no model.layers: no early exit")
    return layers


@dataclass
class ExitHead:
    """Early logits after decoder layer ``layer`` (1-based: the output of
    ``model.model.layers[layer - 1]``, i.e. ``hidden_states[layer]``).

    Attributes:
        layer: exit layer, 1 <= layer < num_hidden_layers.
        weight: translator [H, H] float32 applied as ``h @ weight + bias`` (None: none).
        bias: translator bias [H] float32 (None: none).
        vocab_ids: restricted vocabulary, long [K] sorted (None: the full vocabulary).
        accept_topk: the provisional acceptance rule: a draft token is provisionally
            accepted when it ranks among the top ``accept_topk`` early logits (1: the
            greedy rule itself; larger values trust the draft more).
        name: label for logs and metrics (e.g. ``tuned-L22-v32768``).
    """

    model: torch.nn.Module
    layer: int
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    vocab_ids: torch.Tensor | None = None
    accept_topk: int = 1
    name: str = "untrained"
    _rows: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        n = int(self.model.config.num_hidden_layers)
        if not 1 <= self.layer < n:
            raise ValueError(f"exit layer {self.layer} outside 1..{n - 1}")
        decoder_layers(self.model)
        head = self.model.get_output_embeddings().weight            # [V, H]
        self._rows = head if self.vocab_ids is None else head[self.vocab_ids].contiguous()

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @torch.inference_mode()
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Early logits of hidden states ``h`` [T, H] (model dtype) → float32 [T, V];
        ids outside :attr:`vocab_ids` get ``-inf``."""
        if self.weight is not None:
            x = h.float() @ self.weight
            if self.bias is not None:
                x = x + self.bias
            h = x.to(h.dtype)
        h = self.model.model.norm(h)
        small = (h @ self._rows.T).float()                             # [T, K]
        if self.vocab_ids is None:
            return small
        out = torch.full((h.shape[0], self.vocab_size), float("-inf"), device=small.device)
        out[:, self.vocab_ids] = small
        return out


def untrained_head(model, layer: int, vocab: int | None = None) -> ExitHead:
    """The model's final norm + LM head applied at ``layer`` (no translator), over the
    first ``vocab`` ids plus the special tokens (None: the full vocabulary)."""
    return ExitHead(model, layer, vocab_ids=restricted_vocab(model, vocab))


def restricted_vocab(model, k: int | None) -> torch.Tensor | None:
    """The first ``k`` token ids plus the eos/bos/pad ids the config names (the chat
    and end tokens sit at the top of BPE vocabularies), sorted, long [K']. None when
    ``k`` is None or covers the vocabulary."""
    V = int(model.config.vocab_size)
    if k is None or k >= V:
        return None
    special = set()
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        v = getattr(model.config, name, None)
        if v is None and getattr(model, "generation_config", None) is not None:
            v = getattr(model.generation_config, name, None)
        special.update([v] if isinstance(v, int) else list(v or []))
    ids = sorted(set(range(k)) | {int(s) for s in special if 0 <= int(s) < V})
    return torch.tensor(ids, dtype=torch.long)
