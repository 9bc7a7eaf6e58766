"""Fitting, persisting and loading the exit heads of FSD's provisional verdicts.

An exit head (:class:`cloud_api.early_exit.ExitHead`) is the tuned lens of Belrose et
al. 2023, §3: one affine *translator* per layer, fitted so that the residual stream
after layer ``l`` maps onto the final layer's residual stream, then the model's own
final norm and LM head. We fit it in closed form (ridge regression) on teacher-forced
text that the benchmark never evaluates, instead of the paper's SGD on the KL to the
final logits: the fit takes one forward pass over ~5k positions and one [H+1, H+1]
solve per layer. The LM head is restricted to a frequency-ranked vocabulary (FR-Spec,
Zhao et al. 2025, §3) so the exit costs a few per cent of the pass.

Heads are cached under ``$SPECRELAY_CACHE/exit-heads/<key>/L{layer}-v{K}.safetensors``
with a ``manifest.json`` beside them; ``<key>`` hashes the model's name, shape and a
slice of its weights, so two models never share a head.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from edge_sdk.exit_head import ExitHead, decoder_layers, fit_translator, restricted_vocab
from edge_sdk.exit_store import head_path, load_exit_head, model_key, save_exit_head

__all__ = ["collect_hidden", "fit_translator", "calibration_text", "heldout_prompts",
           "model_key", "head_path", "save_exit_head", "load_exit_head", "fit_exit_heads",
           "fit_exit_head", "load_or_fit_exit_head", "head_agreement",
           "EARLY_EXIT_DEFAULTS", "HELDOUT_START"]

log = logging.getLogger("cloud_api")

EARLY_EXIT_DEFAULTS: dict[str, dict] = {
    "qwen2.5-coder-1.5b": {"layer": 24, "vocab": 32768, "accept_topk": 4},
    "smollm2-135m": {"layer": 24, "vocab": 16384, "accept_topk": 1},
}
"""Preset -> the exit ``layer``, restricted ``vocab`` K and provisional ``accept_topk``
chosen by ``specrelay fsd calibrate --prompts 4`` (docs/figures/fsd_calibration/; the
tuned head in each case; hit rates 0.32 and 0.42 over 50 and 116 rounds). SmolLM2's
exit costs 7-8 % of its small pass at K=32768, so it uses K=16384 (4.4 %)."""

HELDOUT_START = {"humaneval": 100, "mtbench": 48}
"""First seed-0 index of each workload that the benchmark never evaluates (it runs the
first n <= 64 prompts): fit data come from these indexes on."""


def collect_hidden(model, seqs: Sequence[Sequence[int]], layers: Sequence[int]
                   ) -> tuple[dict[int, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Teacher-forced residual streams of ``seqs`` (each a token list, batch 1).

    Returns ``(hidden, target, argmax)``: ``hidden[l]`` float32 [N, H] is the output of
    decoder layer ``l`` (1-based, ``hidden_states[l]``), ``target`` float32 [N, H] is the
    final layer's residual stream *before* the final norm (the input of
    ``model.model.norm``, what an :class:`ExitHead` translator must reproduce) and
    ``argmax`` long [N] the final greedy token at each position; N = total tokens.
    Raises ValueError for a layer outside 1..num_hidden_layers-1 or no tokens.
    """
    blocks, n = decoder_layers(model), int(model.config.num_hidden_layers)
    if any(not 1 <= l < n for l in layers):
        raise ValueError(f"layers {list(layers)} outside 1..{n - 1}")
    got: dict[object, list[torch.Tensor]] = {l: [] for l in layers} | {"y": []}
    hooks = [blocks[l - 1].register_forward_hook(
        lambda m, a, o, l=l: got[l].append((o[0] if isinstance(o, tuple) else o)[0].float()))
        for l in layers]
    hooks.append(model.model.norm.register_forward_pre_hook(
        lambda m, a: got["y"].append(a[0][0].float())))
    arg = []
    try:
        with torch.inference_mode():
            for s in seqs:
                if len(s):
                    x = torch.tensor([list(s)], dtype=torch.long, device=model.device)
                    arg.append(model(input_ids=x, use_cache=False).logits[0].argmax(-1))
    finally:
        for h in hooks:
            h.remove()
    if not arg:
        raise ValueError("collect_hidden: no tokens")
    return ({l: torch.cat(got[l]).cpu() for l in layers}, torch.cat(got["y"]).cpu(),
            torch.cat(arg).cpu())


def heldout_prompts(n_code: int, n_chat: int, split: str = "heldout") -> tuple[list, list]:
    """The HumanEval and MT-Bench prompts (``specrelay_data.workloads.Prompt``) at seed-0 indexes
    from :data:`HELDOUT_START` on: never among the benchmark's evaluated prompts.
    ``split="eval"`` takes the prompts before that boundary instead (the evaluated ones:
    only for cross-fitting, a fit judged on the held-out prompts). Raises ValueError for
    another split."""
    from specrelay_data.workloads import load_workload   # data packages: only when fitting

    if split not in ("heldout", "eval"):
        raise ValueError(f"split must be 'heldout' or 'eval', not {split!r}")
    cut = {w: slice(k, None) if split == "heldout" else slice(0, k)
           for w, k in HELDOUT_START.items()}
    he = load_workload("humaneval")[cut["humaneval"]][:n_code]
    mt = load_workload("mtbench")[cut["mtbench"]][:n_chat]
    return he, mt


def calibration_text(tokenizer, n_code: int = 16, n_chat: int = 16, max_len: int = 256
                     ) -> list[list[int]]:
    """Fit sequences (token lists of at most ``max_len``): ``n_code`` held-out HumanEval
    prompts + their canonical solutions, and both user turns of ``n_chat`` held-out
    MT-Bench questions, each wrapped in the chat template. Raises RuntimeError when the
    workload data packages are missing."""
    from specrelay_data.workloads import humaneval_problems, mtbench_questions
    from edge_sdk.models import encode_prompt

    he, mt = heldout_prompts(n_code, n_chat)
    sol = {p["task_id"]: p["canonical_solution"] for p in humaneval_problems()}
    turns = {f"mtbench/{q['question_id']}": q["turns"] for q in mtbench_questions()}
    seqs = [encode_prompt(tokenizer, p.text + sol[p.id], False) for p in he]
    seqs += [encode_prompt(tokenizer, t, True) for p in mt for t in turns[p.id]]
    return [s[:max_len] for s in seqs if s]


def head_agreement(head: ExitHead, X: torch.Tensor, argmax: torch.Tensor,
                   chunk: int = 512) -> float:
    """Top-1 agreement of ``head``'s early argmax on hidden states ``X`` float32 [N, H]
    with the final greedy tokens ``argmax`` long [N] (fraction in [0, 1])."""
    dtype, dev = head.model.dtype, head.model.device
    hits = 0
    for i in range(0, X.shape[0], chunk):
        lg = head.logits(X[i:i + chunk].to(dev, dtype))
        hits += int((lg.argmax(-1).cpu() == argmax[i:i + chunk]).sum())
    return hits / max(1, X.shape[0])


def _split(seqs: list, every: int = 5) -> tuple[list, list]:
    """(fit, held-out) sequences: every ``every``-th one is held out (none for < 2)."""
    if len(seqs) < 2:
        return list(seqs), []
    return ([s for i, s in enumerate(seqs) if i % every != every - 1],
            [s for i, s in enumerate(seqs) if i % every == every - 1])


def fit_exit_heads(model, tokenizer, layers: Sequence[int], vocab: int | None,
                   accept_topk: int = 1, ridge: float = 1e-2, seqs=None, n_code: int = 16,
                   n_chat: int = 16, max_len: int = 256, save: bool = True
                   ) -> tuple[dict[int, ExitHead], dict[int, dict]]:
    """Fit one tuned exit head per layer from one teacher-forced pass over ``seqs``
    (default :func:`calibration_text`), every fifth sequence held out.

    Returns ``(heads, info)``: ``heads[l]`` an :class:`ExitHead`; ``info[l]`` holds
    ``positions`` (fitted), ``heldout_positions``, ``agreement`` (held-out top-1
    agreement with the final greedy token; on the fit data when nothing is held out)
    and ``untrained_agreement`` (the same for the head without translator). ``save``
    caches each head (:func:`save_exit_head`). Raises ValueError as
    :func:`collect_hidden` does; RuntimeError when the workload data are missing.
    """
    seqs = calibration_text(tokenizer, n_code, n_chat, max_len) if seqs is None else seqs
    fit, held = _split(list(seqs))
    X, Y, _ = collect_hidden(model, fit, layers)
    Xh, _, arg_h = collect_hidden(model, held or fit, layers)
    heads, info, dev = {}, {}, model.device
    ids = restricted_vocab(model, vocab)
    for l in layers:
        w, b = fit_translator(X[l], Y, ridge)
        head = ExitHead(model, l, weight=w.to(dev), bias=b.to(dev),
                        vocab_ids=None if ids is None else ids.to(dev),
                        accept_topk=accept_topk, name=f"tuned-L{l}-v{vocab or 'full'}")
        raw = ExitHead(model, l, vocab_ids=head.vocab_ids)
        info[l] = {"positions": int(Y.shape[0]), "heldout_positions": int(arg_h.shape[0]),
                   "ridge": ridge, "agreement": round(head_agreement(head, Xh[l], arg_h), 4),
                   "untrained_agreement": round(head_agreement(raw, Xh[l], arg_h), 4)}
        if save:
            save_exit_head(head, vocab, info[l])
        heads[l] = head
    return heads, info


def fit_exit_head(model, tokenizer, layer: int, vocab: int | None, accept_topk: int = 1,
                  **kw) -> ExitHead:
    """Fit, cache and return the tuned exit head at ``layer`` (keywords as
    :func:`fit_exit_heads`)."""
    heads, _ = fit_exit_heads(model, tokenizer, [layer], vocab, accept_topk, **kw)
    return heads[layer]


def load_or_fit_exit_head(model, tokenizer, layer: int, vocab: int | None,
                          accept_topk: int = 1, **kw) -> ExitHead:
    """The cached head (:func:`load_exit_head`), else a fresh fit (:func:`fit_exit_head`,
    about a minute for a 1.5B target on CPU; logged on the ``cloud_api`` logger)."""
    head = load_exit_head(model, layer, vocab, accept_topk)
    if head is not None:
        return head
    log.info("fitting the early-exit head at layer %d (vocab %s): about a minute, once",
             layer, vocab or "full")
    head = fit_exit_head(model, tokenizer, layer, vocab, accept_topk, **kw)
    log.info("early-exit head cached at %s", head_path(model, layer, vocab))
    return head
