"""Exit heads: early logits from an intermediate layer of a causal LM, shared by the
edge (CATS self-speculative drafting from the resident layers,
``edge_sdk.local_target``) and the cloud (FSD's provisional verdicts,
``cloud_api.early_exit``). One implementation; ``cloud_api`` re-exports these names.

An :class:`ExitHead` turns the residual stream after decoder layer ``layer`` into
early logits: an optional affine *translator* (the tuned lens, Belrose et al. 2023,
§3: an affine map per layer fitted to the final layer's hidden state) followed by the
model's own final norm and LM head, restricted to a vocabulary subset so that the
exit costs a small fraction of the pass (FR-Spec's frequency-ranked vocabulary;
byte-level BPE ids are close to frequency rank, so the subset is the first ids plus
the special tokens). An untrained exit (no translator) is a weak predictor on models
not trained for it (LayerSkip, Elhoushi et al. 2024, §1; CASES.md 12):
:func:`fit_translator` fits the translator in closed form.

Mechanism only: :meth:`ExitHead.logits` has no policy; callers decide with the
acceptance rule of ``edge_sdk.protocol.sampling``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["ExitHead", "untrained_head", "restricted_vocab", "decoder_layers",
           "fit_translator"]


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
    _rows: tuple | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        n = int(self.model.config.num_hidden_layers)
        if not 1 <= self.layer < n:
            raise ValueError(f"exit layer {self.layer} outside 1..{n - 1}")
        decoder_layers(self.model)
        head = self.model.get_output_embeddings().weight            # [V, H]
        self._rows = _head_rows(head, self.vocab_ids)

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
        small = torch.cat([h @ r.T for r in self._rows], -1).float()   # [T, K]
        return full_vocab(small, self.vocab_ids, self.vocab_size)


def full_vocab(small: torch.Tensor, ids: torch.Tensor | None, V: int) -> torch.Tensor:
    """Logits [T, K] over the restricted vocabulary ``ids`` -> [T, V] with ``-inf``
    outside it (``small`` itself when ``ids`` is None)."""
    if ids is None:
        return small
    out = torch.full((small.shape[0], V), float("-inf"), device=small.device)
    out[:, ids] = small
    return out


def leading_run(ids: torch.Tensor) -> int:
    """Length n0 of the leading run ``ids[:n0] == 0..n0-1`` of sorted ids [K]."""
    off = torch.nonzero(ids != torch.arange(ids.numel(), device=ids.device))
    return int(off[0, 0]) if off.numel() else ids.numel()


def _head_rows(head: torch.Tensor, ids: torch.Tensor | None) -> tuple:
    """The LM-head rows [K, H] of ``ids`` as ``(view of the leading run 0..n0-1, copy of
    the rest)``: a frequency-ranked subset is mostly a prefix, so only the few special
    rows are copied (the edge's memory budget counts every byte; CATS)."""
    if ids is None:
        return (head,)
    n0 = leading_run(ids)
    rows = (head[:n0],) if n0 else ()
    return rows + ((head[ids[n0:]].contiguous(),) if n0 < ids.numel() else ())


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


def fit_translator(X: torch.Tensor, Y: torch.Tensor, ridge: float = 1e-2
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form ridge regression ``Y ≈ X @ weight + bias`` up to the scale of each
    row: the tuned lens's affine translator (Belrose et al. 2023, §3), fitted by
    weighted least squares instead of SGD.

    ``X``: residual streams after the exit layer, ``Y``: the final layer's pre-norm
    residual streams, both [N, H] (any float dtype). The final RMSNorm is scale-free, so
    each target row is divided by its RMS, and each row is weighted by 1/RMS(x)²: the
    few positions with massive activations (the attention sink, RMS ~100x the median)
    would otherwise dominate the fit (top-1 agreement on Qwen2.5-Coder-1.5B layer 20:
    0.43 weighted vs 0.33 plain). The penalty is ``ridge`` times the mean diagonal of
    the weighted Gram matrix; the bias is not penalised. Solved in float64.
    Returns float32 ``weight`` [H, H] and ``bias`` [H].
    Raises ValueError for mismatched shapes or N < 2.
    """
    if X.ndim != 2 or X.shape != Y.shape or X.shape[0] < 2:
        raise ValueError(f"fit_translator needs X, Y of one shape [N>=2, H]: "
                         f"{tuple(X.shape)} vs {tuple(Y.shape)}")
    X, Y = X.double(), Y.double()
    rms = lambda t: t.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6)  # noqa: E731
    s = rms(X)
    Xa = torch.cat([X, torch.ones_like(s)], 1) / s                   # [N, H+1]
    T = Y / rms(Y) / s
    gram = Xa.T @ Xa
    lam = ridge * float(gram.diagonal()[:-1].mean())
    gram.diagonal()[:-1].add_(max(lam, 1e-12))
    wb = torch.linalg.solve(gram, Xa.T @ T)                          # [H+1, H]
    return wb[:-1].float().contiguous(), wb[-1].float().contiguous()
