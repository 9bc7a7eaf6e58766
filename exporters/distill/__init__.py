"""Train a small draft model for a target LLM by KL distillation (``specrelay draft distill``).

The draft shares the target's tokenizer, token embedding and LM head (frozen, never
stored); its decoder layers start as copies of chosen target layers and its final norm as
a copy of the target's. Optionally the draft's output head keeps only the ``V'`` most
frequent token ids: the model then still returns logits over the **full** vocabulary with
``-inf`` outside the kept ids, so ``q`` is a proper distribution over the full vocabulary
(zero outside) and :class:`edge_sdk.drafters.torch.TorchDrafter` works unchanged.

Pipeline (every stage is cached in ``--work-dir``; a rerun resumes where it stopped):

1. prompts: MT-Bench (chat) + HumanEval (code completion) + ``--prompts-file`` files,
   split **by prompt** into train / held-out (``split.json``).
2. generated data: the target (``--data-dtype``, bfloat16 by default: AMX) continues every
   train prompt greedily (plus sampled continuations and MT-Bench second turns); the
   top-K target distribution at every position is recorded during generation.
3. teacher-forced data: one target prefill over text found on this machine (Python
   sources, .rst/.md/.txt docs of installed packages), ~10x cheaper per token than
   generation; top-K target distribution at every position.
4. training: soft cross-entropy to the target's top-K distribution (= forward KL up to a
   constant), AdamW, cosine schedule, bf16 autocast; checkpoints every ``--ckpt-every``
   steps.
5. evaluation on the held-out prompts against the **float32** target's greedy path:
   greedy agreement (overall / code / chat), mean accepted length at depth g (simulated
   greedy speculative blocks) and draft vs target ms/token on this CPU -> ``eval.json``.
6. output folder: ``config.json`` + ``model.safetensors`` holding ONLY the trained
   layers and final norm (``--save-dtype``, float16 by default), ``draft_vocab.safetensors``
   (kept ids) when the head is reduced, ``specrelay_draft.json`` (manifest naming the
   target and how to rebuild the shared parts) and ``eval.json``.

:func:`load_draft` rebuilds the full draft from the target and the stored parts.

Modules, in pipeline order: :mod:`~exporters.distill.prompts` (prompt sources and the
held-out split), :mod:`~exporters.distill.corpus` (local text for teacher forcing),
:mod:`~exporters.distill.teacher` (the target's batched generation and prefill with
top-K recording), :mod:`~exporters.distill.data` (stages 1-3, cached shards),
:mod:`~exporters.distill.train` (stage 4), :mod:`~exporters.distill.evaluate` (stage 5),
:mod:`~exporters.distill.pipeline` (:func:`~exporters.distill.pipeline.run_distill`:
every stage, then the output folder), :mod:`~exporters.distill.cli` (``distill``
command; ``python -m exporters.distill``). The folder format itself is
:mod:`edge_sdk.draft_format` (the SDK loads drafts without this package).

Forward KL on the target's own generations is one of the settings DistillSpec (Zhou et
al., 2023) compares for speculative-decoding drafts; a draft built from the target's
early layers follows LayerSkip's self-speculation (Elhoushi et al., 2024).
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from edge_sdk.draft_format import MANIFEST_NAME, is_draft_folder  # noqa: E402
from edge_sdk.draft_format import load_draft as _load_folder  # noqa: E402

__all__ = ["load_draft", "draft_folder"]


def load_draft(path_or_preset: str | Path, dtype: str = "float32", target=None,
               threads: int | None = None, check_target: bool = True):
    """:func:`edge_sdk.draft_format.load_draft` for a draft folder or preset name
    (``smollm2-135m-draft``), loading the target by name with
    :func:`edge_sdk.models.load_model`. Raises FileNotFoundError: no manifest there."""
    from edge_sdk.models import load_model

    return _load_folder(draft_folder(path_or_preset), dtype=dtype, target=target,
                        threads=threads, check_target=check_target, load_target=load_model)


def draft_folder(path_or_preset: str | Path) -> Path:
    """The folder of a draft given as a folder or a preset name. Raises
    FileNotFoundError: no manifest there."""
    from edge_sdk.models import resolve

    folder = Path(path_or_preset)
    if not is_draft_folder(folder):
        folder = Path(resolve(str(path_or_preset)).path)
    if not is_draft_folder(folder):
        raise FileNotFoundError(f"{path_or_preset!r}: no {MANIFEST_NAME} in {folder}")
    return folder
