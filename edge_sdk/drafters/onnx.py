"""onnxruntime draft backend: a decoder exported with KV-cache inputs/outputs.

The graph follows optimum's naming (``exporters.onnx.graph`` writes it):

inputs
    ``input_ids`` int64 [B, S]; ``attention_mask`` int64 [B, P+S] (if present);
    ``position_ids`` int64 [B, S] (if present); ``past_key_values.N.key`` /
    ``past_key_values.N.value`` [B, H_kv, P, D] in the KV dtype (float32 or float16).
outputs
    ``logits`` [B, S, V] ([B, S, K] with a subset LM head: column j is token
    ``head_ids[j]``, :data:`HEAD_IDS_FILE`); ``present.N.key`` / ``present.N.value``
    [B, H_kv, P+S, D].

:class:`OnnxDrafter` keeps the present tensors as numpy arrays (batch 1) between calls;
rolling back to a confirmed prefix of ``n`` tokens is a slice ``[:, :, :n, :]``.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from edge_sdk.drafters.base import DraftBlock, Drafter, PrefillStopped, Proposal
from edge_sdk.kvmodel import common_prefix

MANIFEST_NAME = "specrelay_onnx.json"
MODEL_NAME = "model.onnx"
#: Optional graph input, int64 [n]: the positions among a call's new tokens whose logits
#: are computed (transformers' tensor ``logits_to_keep``); exports since 2026-12-05.
KEEP_INPUT = "logits_to_keep"
#: Token ids of a subset LM head's logit columns (int64 [K], ``numpy.save``), beside
#: the graph; the manifest's ``head_ids`` names it (exports since 2026-12-06).
HEAD_IDS_FILE = "head_ids.npy"
#: The most tokens one graph call appends (:meth:`OnnxRunner.forward_np` splits longer
#: runs): bounds a long prompt's attention scores to [heads, 512, context] per layer.
PREFILL_CHUNK = 512

#: Execution providers in order of preference when none is given explicitly.
PROVIDER_PREFERENCE = ("TensorrtExecutionProvider", "CUDAExecutionProvider",
                       "CPUExecutionProvider")
_PROVIDER_ALIASES = {
    "tensorrt": "TensorrtExecutionProvider", "trt": "TensorrtExecutionProvider",
    "cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider",
}
_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16,
              "tensor(double)": np.float64}


def past_name(layer: int, kind: str) -> str:
    """Graph input holding layer ``layer``'s cached keys/values (kind: key|value)."""
    return f"past_key_values.{layer}.{kind}"


def present_name(layer: int, kind: str) -> str:
    """Graph output holding layer ``layer``'s keys/values after the call."""
    return f"present.{layer}.{kind}"


def resolve_model_dir(path: str | os.PathLike) -> tuple[Path, Path]:
    """``(folder, model file)`` for an export folder or a ``.onnx`` file path."""
    p = Path(path)
    if p.is_dir():
        return p, p / MODEL_NAME
    return p.parent, p


def read_manifest(path: str | os.PathLike) -> dict:
    """The export manifest of a model folder (or of the folder holding a ``.onnx``).

    Falls back to the geometry in an optimum-style ``config.json`` when there is no
    ``specrelay_onnx.json``, and to ``{}`` (geometry read from the graph) when neither
    exists. Raises FileNotFoundError when the model file is missing.
    """
    folder, model = resolve_model_dir(path)
    if not model.exists():
        raise FileNotFoundError(f"no ONNX model at {model}")
    mf = folder / MANIFEST_NAME
    if mf.exists():
        return json.loads(mf.read_text())
    cfg = folder / "config.json"
    if cfg.exists():
        c = json.loads(cfg.read_text())
        heads = c.get("num_attention_heads")
        return {
            "num_layers": c["num_hidden_layers"],
            "num_kv_heads": c.get("num_key_value_heads") or heads,
            "head_dim": c.get("head_dim") or c["hidden_size"] // heads,
            "vocab_size": c["vocab_size"],
        }
    return {}


def profile_shapes(manifest: dict, *, max_batch: int = 1, max_seq: int = 512,
                   max_past: int = 2048, opt_seq: int = 1, opt_past: int = 256,
                   input_names: list[str] | None = None) -> dict[str, dict[str, list[int]]]:
    """min/opt/max shape per graph input for one optimisation profile.

    Args:
        manifest: ONNX manifest (num_layers, num_kv_heads, head_dim).
        max_batch: largest batch. max_seq: most new tokens per call (prefill length).
        max_past: most cached tokens. opt_seq / opt_past: the shape TensorRT tunes for
            (one-token decode over a ~256-token cache by default).
    Returns:
        ``{input name: {"min": [...], "opt": [...], "max": [...]}}``; past tensors are
        [batch, H_kv, past, D] with past from 0 (empty cache) to ``max_past``;
        ``logits_to_keep`` [n] from 1 (decode, prefill) to ``max_seq``, where the graph
        has it (``input_names``, else the manifest's ``inputs``).
    """
    n, h, d = manifest["num_layers"], manifest["num_kv_heads"], manifest["head_dim"]
    opt_past = min(opt_past, max_past)
    opt_seq = min(opt_seq, max_seq)
    tok = {"min": [1, 1], "opt": [1, opt_seq], "max": [max_batch, max_seq]}
    shapes = {
        "input_ids": tok,
        "position_ids": tok,
        "attention_mask": {"min": [1, 1], "opt": [1, opt_past + opt_seq],
                           "max": [max_batch, max_past + max_seq]},
    }
    for i in range(n):
        for kind in ("key", "value"):
            shapes[f"past_key_values.{i}.{kind}"] = {
                "min": [1, h, 0, d], "opt": [1, h, opt_past, d],
                "max": [max_batch, h, max_past, d]}
    names = input_names if input_names is not None else manifest.get("inputs")
    if names is None or KEEP_INPUT in names:        # exports before it lack the input
        shapes[KEEP_INPUT] = {"min": [1], "opt": [1], "max": [max_seq]}
    if input_names is not None:
        shapes = {k: v for k, v in shapes.items() if k in input_names}
    return shapes


def _trt_shape_option(shapes: dict, which: str) -> str:
    return ",".join(f"{k}:{'x'.join(str(int(x)) for x in v[which])}"
                    for k, v in shapes.items())


def select_providers(providers: Sequence[Any] | str | None = None, *,
                     fp16: bool = False, cache_dir: str | os.PathLike | None = None,
                     manifest: dict | None = None) -> list:
    """Execution providers for :class:`onnxruntime.InferenceSession`.

    Args:
        providers: None picks the best installed one (TensorRT EP > CUDA EP > CPU).
            Otherwise a name or list of names (``"cpu"``, ``"cuda"``, ``"tensorrt"`` or
            full EP names) or ``(name, options)`` pairs, used in that order.
        fp16: enable TensorRT's fp16 kernels when the TensorRT EP is chosen.
        cache_dir: where the TensorRT EP caches its engines (default: no cache).
        manifest: the export manifest; with it the TensorRT EP gets one explicit
            optimisation profile (:func:`profile_shapes`) so a growing past length does
            not trigger an engine rebuild per step.
    Returns:
        list of provider names / ``(name, options)`` pairs, CPU always last as fallback.
    Raises:
        ValueError: an explicitly requested provider is not installed.
    """
    import onnxruntime as ort

    available = ort.get_available_providers()
    if providers is None:
        chosen = [p for p in PROVIDER_PREFERENCE if p in available]
    else:
        if isinstance(providers, str):
            providers = [providers]
        chosen = []
        for p in providers:
            name = p[0] if isinstance(p, tuple) else p
            name = _PROVIDER_ALIASES.get(name.lower(), name)
            if name not in available:
                raise ValueError(f"execution provider {name} is not installed "
                                 f"(available: {', '.join(available)})")
            chosen.append((name, p[1]) if isinstance(p, tuple) else name)
    out = []
    for p in chosen:
        if p == "TensorrtExecutionProvider":
            opts = {"trt_fp16_enable": bool(fp16)}
            if cache_dir is not None:
                opts.update(trt_engine_cache_enable=True, trt_engine_cache_path=str(cache_dir))
            if manifest and "num_layers" in manifest:
                shapes = profile_shapes(manifest)
                for which in ("min", "opt", "max"):
                    opts[f"trt_profile_{which}_shapes"] = _trt_shape_option(shapes, which)
            p = (p, opts)
        out.append(p)
    if not any((p[0] if isinstance(p, tuple) else p) == "CPUExecutionProvider" for p in out):
        out.append("CPUExecutionProvider")
    return out


def make_session_options(threads: int | None = None, *, spinning: bool = True):
    """onnxruntime session options: ``threads`` fixed intra-op threads (None = ORT's
    default, one per core), sequential execution, all graph optimisations; ``spinning``
    False stops idle worker threads from busy-waiting (kinder to a shared CPU)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if threads:
        so.intra_op_num_threads = int(threads)
        so.inter_op_num_threads = 1
    if not spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    return so


class OnnxRunner:
    """One sequence (batch 1) through an exported decoder, KV cache held as numpy.

    Invariant: ``len(self.ids) == self.cache_len()``.

    Args:
        path: export folder (with ``model.onnx`` and ``specrelay_onnx.json``) or a
            ``.onnx`` file.
        providers: see :func:`select_providers` (None = best installed).
        threads: fixed intra-op thread count (None = onnxruntime default).
        session_options: a ready :class:`onnxruntime.SessionOptions` (overrides threads).
    """

    def __init__(self, path: str | os.PathLike, providers=None, threads: int | None = None,
                 session_options=None):
        import onnxruntime as ort

        self.folder, self.model_path = resolve_model_dir(path)
        self.manifest = read_manifest(path)
        so = session_options or make_session_options(threads)
        fp16 = self.manifest.get("dtype") == "float16"
        self.providers = select_providers(providers, fp16=fp16,
                                          cache_dir=self.folder / "trt_cache",
                                          manifest=self.manifest)
        self.session = ort.InferenceSession(str(self.model_path), so,
                                            providers=self.providers)
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.input_names = set(inputs)
        k0 = inputs.get(past_name(0, "key"))
        if k0 is None:
            raise ValueError(f"{self.model_path} has no {past_name(0, 'key')} input: "
                             "export it with KV cache (specrelay export onnx)")
        self.kv_dtype = _ORT_TYPES[k0.type]
        n_graph = sum(1 for n in inputs if n.startswith("past_key_values.")) // 2
        self.num_layers = int(self.manifest.get("num_layers") or n_graph)
        logits_v = self.session.get_outputs()[0].shape[-1]
        self.vocab_size = int(self.manifest.get("vocab_size") or logits_v)
        #: token ids of the graph's logit columns when its LM head keeps a subset of
        #: the vocabulary (int64 [K]; manifest ``head_ids``), else None
        self.head_ids = None
        if self.manifest.get("head_ids"):
            self.head_ids = np.load(self.folder / self.manifest["head_ids"]).astype(np.int64)
            self._head_ids_t = torch.from_numpy(self.head_ids)
        self.num_kv_heads = int(self.manifest.get("num_kv_heads") or k0.shape[1])
        self.head_dim = int(self.manifest.get("head_dim") or k0.shape[3])
        self.keeps_logits = KEEP_INPUT in self.input_names
        fused = (self.manifest.get("quantization") or {}).get("fused") or {}
        #: positions a graph with fused rotary embeddings has cos / sin rows for
        #: (``exporters.onnx.fuse.fuse_rotary``: the model's ``max_position_embeddings``
        #: plus a margin), else None (the traced rope computes any position)
        self.max_positions = int(fused["rotary_positions"]) if fused.get("rotary") else None
        self.output_names = ["logits"] + [present_name(i, k) for i in range(self.num_layers)
                                          for k in ("key", "value")]
        self.ids: list[int] = []
        self.past: list[np.ndarray] = []
        #: fills long catch-ups (a prompt) instead of the graph: a
        #: :class:`~edge_sdk.drafters.prefill.TorchPrefill`, or None
        self.prefill = None
        #: set from another thread: a chunked run stops at its next chunk border
        #: (:class:`~edge_sdk.drafters.base.PrefillStopped`); see ``Drafter.stop_prefill``
        self.stopping = False
        self.reset()

    def cache_len(self) -> int:
        """Tokens held in the KV cache."""
        return int(self.past[0].shape[2])

    def reset(self) -> None:
        """Empty the cache (the next call runs with past length 0)."""
        empty = np.zeros((1, self.num_kv_heads, 0, self.head_dim), dtype=self.kv_dtype)
        self.past = [empty] * (2 * self.num_layers)
        self.ids = []

    def crop(self, n: int) -> None:
        """Keep the first ``n`` cached tokens (0 <= n <= cached); slices every past
        tensor to ``[:, :, :n, :]``. Raises ValueError otherwise."""
        have = len(self.ids)
        if not 0 <= n <= have:
            raise ValueError(f"crop({n}) outside 0..{have}")
        if n < have:
            self.past = [p[:, :, :n, :] for p in self.past]
            del self.ids[n:]
        self.check()

    def check_positions(self, end: int) -> None:
        """Raises ValueError when positions up to ``end`` (exclusive) lie beyond
        :attr:`max_positions`: onnxruntime's RotaryEmbedding has no row for them."""
        if self.max_positions is not None and end > self.max_positions:
            raise ValueError(f"the draft graph covers {self.max_positions} positions "
                             f"(its model's max_position_embeddings and a margin); this "
                             f"context needs {end}")

    def feeds(self, new_ids: Sequence[int], last: int | None = None) -> dict[str, np.ndarray]:
        """Graph inputs appending ``new_ids`` [k] to the cached sequence; with a
        ``logits_to_keep`` input, logits for the last ``last`` of them (None: all k).
        Raises ValueError: positions beyond :attr:`max_positions`."""
        p, k = self.cache_len(), len(new_ids)
        self.check_positions(p + k)
        feeds = {"input_ids": np.asarray([list(new_ids)], dtype=np.int64)}
        if "attention_mask" in self.input_names:
            feeds["attention_mask"] = np.ones((1, p + k), dtype=np.int64)
        if "position_ids" in self.input_names:
            feeds["position_ids"] = np.arange(p, p + k, dtype=np.int64)[None]
        if self.keeps_logits:
            feeds[KEEP_INPUT] = np.arange(k - self._rows(k, last), k, dtype=np.int64)
        for i in range(self.num_layers):
            feeds[past_name(i, "key")] = np.ascontiguousarray(self.past[2 * i])
            feeds[past_name(i, "value")] = np.ascontiguousarray(self.past[2 * i + 1])
        return feeds

    def forward_np(self, new_ids: Sequence[int], last: int | None = None) -> np.ndarray:
        """Append ``new_ids`` [k]; return the logits of the last ``last`` of them (None:
        all), as the graph's dtype, [min(last, k), V] (a subset head's K columns mapped
        back to V as float32, :meth:`full_vocab`). A graph with a
        ``logits_to_keep`` input computes only those rows (a prefill then skips the LM
        head for every prompt position but the last); an older export computes all k
        and the rest are dropped here.

        A run longer than :data:`PREFILL_CHUNK` tokens goes through the graph in chunks
        of that many (chunked prefill, as vLLM and llama.cpp's ``n_ubatch`` do): the
        graph's attention holds a [heads, k, P + k] score matrix, so a 20,000-token
        prompt in one call would need tens of GB; in chunks it needs
        [heads, PREFILL_CHUNK, P + k]. Same cache, same positions; only the float
        rounding of the chunked matmuls differs (a draft's logits never touch
        exactness)."""
        if not new_ids:
            raise ValueError("forward() needs at least one token")
        k = len(new_ids)
        rows = self._rows(k, last)
        if k <= PREFILL_CHUNK:
            return self._run(list(new_ids), rows)
        out = []
        for s in self.chunk_starts(k):
            part = list(new_ids[s:s + PREFILL_CHUNK])
            need = rows - (k - s - len(part))      # of this chunk's rows, among the last
            got = self._run(part, max(1, min(need, len(part))))
            if need > 0:
                out.append(got[-min(need, len(part)):])
        return out[0] if len(out) == 1 else np.concatenate(out)

    def chunk_starts(self, k: int):
        """Offsets 0, PREFILL_CHUNK, ... of a k-token run's chunks; before each but the
        first, a pending stop (:attr:`stopping`) is consumed and raises
        :class:`~edge_sdk.drafters.base.PrefillStopped` (the chunks done stay cached).
        The one chunk loop of the graph and of :class:`TorchPrefill`."""
        for s in range(0, k, PREFILL_CHUNK):
            if s and self.stopping:
                self.stopping = False            # consumed: the next run is not stopped
                raise PrefillStopped(f"prefill stopped after {s} of {k} tokens")
            yield s

    def _run(self, new_ids: list[int], rows: int) -> np.ndarray:
        """One graph call appending ``new_ids`` [k]: the logits of its last ``rows``."""
        outs = self.session.run(self.output_names, self.feeds(new_ids, rows))
        self.past = outs[1:]
        self.ids.extend(int(t) for t in new_ids)
        self.check()
        return self.full_vocab(outs[0][0][-rows:])        # an older graph: all k rows

    def full_vocab(self, logits: np.ndarray) -> np.ndarray:
        """Graph logits [T, K] as float32 logits over the whole vocabulary [T, V]: with a
        subset head (:attr:`head_ids`) the other tokens get -inf (probability 0: the
        draft never proposes them, and q is still exactly the distribution a draft
        token is drawn from); otherwise ``logits`` itself."""
        if self.head_ids is None:
            return logits
        from edge_sdk.exit_head import full_vocab

        return full_vocab(torch.from_numpy(np.asarray(logits)), self._head_ids_t,
                          self.vocab_size).numpy()

    @staticmethod
    def _rows(k: int, last: int | None) -> int:
        """Logit rows a call on ``k`` new tokens returns: the last ``last`` (1..k)."""
        return k if last is None else min(max(int(last), 1), k)

    def forward(self, new_ids: Sequence[int], last: int | None = None) -> torch.Tensor:
        """Append ``new_ids`` [k]; return the logits of the last ``last`` of them (None:
        all), float32 [min(last, k), V] (an fp16 graph's logits are widened exactly)."""
        return torch.from_numpy(np.asarray(self.forward_np(new_ids, last), dtype=np.float32))

    def catch_up(self, new_ids: Sequence[int]) -> None:
        """Append ``new_ids`` [k] to the cache without reading their logits: through
        :attr:`prefill` when it takes a run this long, else the graph."""
        if self.prefill is not None and self.prefill.wants(len(new_ids)):
            self.prefill.extend(self, new_ids)
        elif new_ids:
            self.forward_np(new_ids, last=1)

    def sync(self, context: Sequence[int]) -> torch.Tensor:
        """Bring the cache to ``context[:-1]`` (rolling back whatever diverges, reusing
        the common prefix; a long missing run through :meth:`catch_up`) and return the
        logits after ``context[-1]``, float32 [V]."""
        if not context:
            raise ValueError("context must hold at least one token")
        self.stopping = False        # a stop asked before this sync began is stale
        common = common_prefix(self.ids, context)
        self.crop(min(common, len(context) - 1))
        new = context[len(self.ids):]
        if self.prefill is not None and self.prefill.wants(len(new) - 1):
            self.prefill.extend(self, new[:-1])
            new = new[-1:]
        return self.forward(new, last=1)[-1]

    def check(self) -> None:
        """Assert the cache-length invariant on every past tensor (CASES.md 7)."""
        n = len(self.ids)
        for p in self.past:
            if p.shape[2] != n:
                raise AssertionError(f"ONNX KV cache holds {p.shape[2]} tokens, expected {n}")


class OnnxDrafter(Drafter):
    """An exported draft model run by onnxruntime, implementing :class:`Drafter`.

    Args:
        path: export folder written by ``specrelay export onnx`` (``model.onnx`` +
            ``specrelay_onnx.json``; the vocabulary size comes from the manifest) or the
            ``.onnx`` file inside it.
        providers: None = best installed (TensorRT EP > CUDA EP > CPU), or explicit names
            (``"cpu"``, ``"cuda"``, ``"tensorrt"``, full EP names, ``(name, options)``).
        threads: fixed intra-op thread count (None = onnxruntime's default).
        session_options: a ready :class:`onnxruntime.SessionOptions` (overrides threads).

    ``sync``/``step`` return float32 logits [V]; ``propose`` (shared with every backend)
    samples from them, so the q it reports is the softmax of exactly those logits.
    """

    def __init__(self, path: str | os.PathLike, providers=None, threads: int | None = None,
                 session_options=None):
        self.runner = OnnxRunner(path, providers, threads, session_options)
        self.vocab_size = self.runner.vocab_size
        self.manifest = self.runner.manifest

    def stop_prefill(self, on: bool) -> None:
        self.runner.stopping = bool(on)

    @property
    def providers(self) -> list[str]:
        """Execution providers the session actually uses, in priority order."""
        return self.runner.session.get_providers()

    def sync(self, context: Sequence[int]) -> torch.Tensor:
        return self.runner.sync(context)

    def step(self, token: int) -> torch.Tensor:
        return self.runner.forward([token])[-1]

    def cache_len(self) -> int:
        return self.runner.cache_len()

    def reset(self) -> None:
        """Drop the whole KV cache."""
        self.runner.reset()

    def batch_group(self):
        """Forks share one onnxruntime session: they draft together."""
        return id(self.runner.session)

    @staticmethod
    def propose_many(drafters: Sequence["OnnxDrafter"], proposals: Sequence[Proposal]
                     ) -> list[DraftBlock]:
        """Draft several blocks with one onnxruntime call per step
        (:func:`draft_batched`: the draft's weights are read once for all of them)."""
        if len(drafters) == 1:
            return [drafters[0]._run(proposals[0])]
        return draft_batched([d.runner for d in drafters], proposals)

    def fork(self) -> "OnnxDrafter":
        """Another drafter on the same onnxruntime session (weights loaded once;
        ``InferenceSession.run`` is thread-safe) with its own, empty KV cache."""
        clone = copy.copy(self)
        clone.runner = copy.copy(self.runner)
        clone.runner.reset()
        return clone


#: A request whose cache lacks more than this many context tokens catches up alone
#: before drafting in a batch (a prompt's prefill would pad every other row).
BATCH_SYNC_MAX = 8


def draft_batched(runners: Sequence[OnnxRunner], proposals: Sequence[Proposal]
                  ) -> list[DraftBlock]:
    """Draft ``proposals[b]`` on ``runners[b]`` (distinct runners of one onnxruntime
    session) with ONE session call per draft step for all of them.

    Each runner first rolls back to its context's common prefix, as ``sync`` does; a
    runner missing more than :data:`BATCH_SYNC_MAX` context tokens fills all but the
    last alone. The rows are then laid out left-padded in one batch: row b's cached
    past and its missing context tokens each right-aligned, padding hidden by the
    ``attention_mask`` (0) and position ids continuing each row's own sequence; every
    call returns the logits of each row's last position. A row leaves the batch when
    its block is complete. Afterwards each runner holds exactly its context plus its
    block minus the last token (what a lone ``propose`` leaves), compacted out of the
    padded batch. Returns the blocks in order. Raises ValueError for runners of
    different sessions or a runner given twice, or a block reaching past
    :attr:`OnnxRunner.max_positions`."""
    if len({id(r.session) for r in runners}) != 1 or len(set(map(id, runners))) != len(runners):
        raise ValueError("batched drafting needs distinct runners of one session")
    r0 = runners[0]
    news = []
    for r, p in zip(runners, proposals):
        ctx = p.context
        r.crop(min(common_prefix(r.ids, ctx), len(ctx) - 1))
        new = list(ctx[len(r.ids):])
        if len(new) > BATCH_SYNC_MAX:
            r.catch_up(new[:-1])
            new = new[-1:]
        news.append(new)
    B, H, D = len(runners), r0.num_kv_heads, r0.head_dim
    P = [r.cache_len() for r in runners]
    Pm, Km = max(P), max(len(n) for n in news)
    for p, n, prop in zip(P, news, proposals):
        r0.check_positions(p + len(n) + prop.depth - 1)   # every token the block feeds
    L = Pm + Km
    mask = np.zeros((B, L), dtype=np.int64)
    ids = np.zeros((B, Km), dtype=np.int64)
    pos = np.zeros((B, Km), dtype=np.int64)
    past = [np.zeros((B, H, Pm, D), dtype=r0.kv_dtype) for _ in range(2 * r0.num_layers)]
    for b, (r, new) in enumerate(zip(runners, news)):
        mask[b, Pm - P[b]:Pm] = 1
        mask[b, L - len(new):] = 1
        ids[b, Km - len(new):] = new
        pos[b, Km - len(new):] = np.arange(P[b], P[b] + len(new))
        for j, arr in enumerate(past):
            if P[b]:
                arr[b, :, Pm - P[b]:] = r.past[j][0]
    rows = list(range(B))                    # batch row -> proposal index
    fed = [list(n) for n in news]            # tokens each runner has been fed
    nxt = [P[b] + len(news[b]) for b in range(B)]   # each row's next position
    out: list[DraftBlock | None] = [None] * B

    def run(ids_, pos_):
        feeds = {"input_ids": ids_}
        if "attention_mask" in r0.input_names:
            feeds["attention_mask"] = mask
        if "position_ids" in r0.input_names:
            feeds["position_ids"] = pos_
        if r0.keeps_logits:
            feeds[KEEP_INPUT] = np.array([ids_.shape[1] - 1], dtype=np.int64)
        for i in range(r0.num_layers):
            feeds[past_name(i, "key")] = past[2 * i]
            feeds[past_name(i, "value")] = past[2 * i + 1]
        res = r0.session.run(r0.output_names, feeds)
        return np.asarray(r0.full_vocab(res[0][:, -1]), dtype=np.float32), res[1:]

    def settle(k: int) -> None:
        """Batch row k's proposal is complete: its runner takes its compacted cache."""
        b = rows[k]
        keep = np.nonzero(mask[k])[0]
        r = runners[b]
        r.past = [np.ascontiguousarray(arr[k:k + 1, :, keep]) for arr in past]
        r.ids.extend(fed[b])
        r.check()
        out[b] = proposals[b].block()

    logits, past = run(ids, pos)
    while rows:
        step = []
        for k, b in enumerate(rows):
            d = proposals[b].take(torch.from_numpy(logits[k]))
            step.append(d)
        done = [k for k, b in enumerate(rows) if proposals[b].done]
        for k in done:
            settle(k)
        live = [k for k in range(len(rows)) if k not in done]
        if not live:
            break
        if done:                              # the finished rows leave the batch
            sel = np.asarray(live)
            mask, logits = mask[sel], logits[sel]
            past = [arr[sel] for arr in past]
            rows = [rows[k] for k in live]
            step = [step[k] for k in live]
        for b, d in zip(rows, step):
            fed[b].append(d)
        mask = np.concatenate([mask, np.ones((len(rows), 1), dtype=np.int64)], axis=1)
        ids1 = np.asarray(step, dtype=np.int64)[:, None]
        pos1 = np.asarray([nxt[b] for b in rows], dtype=np.int64)[:, None]
        for b in rows:
            nxt[b] += 1
        logits, past = run(ids1, pos1)
    return out
