"""Torch/transformers draft backend."""

from __future__ import annotations

import copy
from typing import Sequence

import torch

from edge_sdk.drafters.base import Drafter
from edge_sdk.kvmodel import KVModel


def quantize_dynamic_int8(model):
    """``model`` (float32; modified in place and returned) with every ``nn.Linear``
    (the LM head included) replaced by a dynamically quantised int8 Linear
    (``torch.ao.quantization.quantize_dynamic``: per-tensor int8 weights, activations
    quantised per call; fbgemm/x86 kernels on CPU)."""
    import warnings

    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization deprecation notice
        return quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)


class TorchDrafter(Drafter):
    """Any HF causal LM as a draft model (KV cache via :class:`KVModel`)."""

    def __init__(self, model):
        self.kv = KVModel(model)
        self.vocab_size = self.kv.vocab_size

    def sync(self, context: Sequence[int]) -> torch.Tensor:
        return self.kv.sync(context)[-1]

    def step(self, token: int) -> torch.Tensor:
        return self.kv.forward([token])[-1]

    def cache_len(self) -> int:
        return self.kv.cache_len()

    def fork(self) -> "TorchDrafter":
        clone = copy.copy(self)          # keeps subclass and settings
        clone.kv = KVModel(self.kv.model)
        return clone
