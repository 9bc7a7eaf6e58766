"""Export a HF causal LM (Llama, Qwen2 — the default draft Qwen2.5-Coder-0.5B — and other
``DynamicCache`` decoders) to ONNX with KV-cache inputs/outputs, check it against torch,
and write optional fp16 / int4 / int8 variants.

Qwen2 specifics are covered: q/k/v biases, tied or untied LM heads (a tied head is
quantised through a transposed copy), GQA, any rope theta, and sliding-window configs
(every layer keeps its full KV cache in the graph; the window is applied by the mask,
so a rollback is still a slice).

optimum-onnx (0.1.0) pins transformers < 4.58, so the graph is produced with
``torch.onnx.export(..., dynamo=True)`` and laid out with optimum's names:

=============================  =======  ==========================================
name                           dtype    shape (symbolic axes)
=============================  =======  ==========================================
``input_ids``                  int64    [batch_size, sequence_length]
``attention_mask``             int64    [batch_size, past_sequence_length + sequence_length]
``position_ids``               int64    [batch_size, sequence_length]
``past_key_values.N.key``      kv       [batch_size, H_kv, past_sequence_length, D]
``past_key_values.N.value``    kv       same
``logits``                     kv       [batch_size, sequence_length, V]
``present.N.key`` / ``.value`` kv       [batch_size, H_kv, past_sequence_length + sequence_length, D]
=============================  =======  ==========================================

``kv`` is float32 (fp32, int4 and int8 exports) or float16 (fp16 export). A first call with
``past_sequence_length = 0`` (empty past tensors) is valid.

Layout written by :func:`export_onnx`::

    OUT/model.onnx  [model.onnx.data]  specrelay_onnx.json      # float32
    OUT/fp16/model.onnx  specrelay_onnx.json                     # --fp16
    OUT/int4/model.onnx  specrelay_onnx.json                     # --int4 (MatMulNBits)
    OUT/int8/model.onnx  specrelay_onnx.json                     # --int8 (MatMulNBits, 8 bits)

Every folder loads with ``OnnxDrafter(folder)``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import math
import os
import time
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from edge_sdk.drafters.onnx import (MANIFEST_NAME, MODEL_NAME, OnnxRunner, past_name,
                                    present_name)
from edge_sdk.kvmodel import KVModel
from edge_sdk.protocol.sampling import greedy_token

DEFAULT_OPSET = 18
PARITY_ATOL = 1e-3
#: Models whose weights exceed this many bytes are written with external data.
EXTERNAL_DATA_BYTES = 1 << 30
#: Prompt used for parity/agreement when a tokenizer is at hand.
PARITY_TEXTS = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding lets a small model",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
)

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- geometry

def kv_geometry(config) -> dict:
    """KV-cache geometry of a HF config: num_layers, num_kv_heads, head_dim, vocab_size,
    hidden_size."""
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return {"num_layers": int(config.num_hidden_layers), "num_kv_heads": kv,
            "head_dim": int(head_dim), "vocab_size": int(config.vocab_size),
            "hidden_size": int(config.hidden_size)}


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """Graph ``(input names, output names)`` in optimum's order."""
    ins = ["input_ids", "attention_mask", "position_ids"]
    outs = ["logits"]
    for i in range(num_layers):
        ins += [past_name(i, "key"), past_name(i, "value")]
        outs += [present_name(i, "key"), present_name(i, "value")]
    return ins, outs


class _KVWrapper(torch.nn.Module):
    """Flat-tensor façade over a HF causal LM: past tensors in, logits + present out."""

    def __init__(self, model, num_layers: int):
        super().__init__()
        self.model = model
        self.num_layers = num_layers

    def forward(self, input_ids, attention_mask, position_ids, past):
        from transformers import DynamicCache

        # Full-length layers for every layer, sliding-window ones included (no config):
        # present = past + new everywhere, so a rollback stays a slice, and the window
        # is applied by the sliding-window mask transformers builds from the config.
        cache = DynamicCache()
        for i in range(self.num_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, cache=cache, use_cache=True)
        present = []
        for i in range(self.num_layers):
            present += [cache.layers[i].keys, cache.layers[i].values]
        return (out.logits, *present)


def _param_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


@contextlib.contextmanager
def _quiet(verbose: bool):
    """Silence the exporter's progress prints and warnings unless verbose."""
    if verbose:
        yield
        return
    buf = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(buf):
        warnings.simplefilter("ignore")
        prev = [logging.getLogger(n).level for n in ("torch", "torch.onnx", "onnxscript")]
        for n in ("torch", "torch.onnx", "onnxscript"):
            logging.getLogger(n).setLevel(logging.ERROR)
        try:
            yield
        finally:
            for n, lv in zip(("torch", "torch.onnx", "onnxscript"), prev):
                logging.getLogger(n).setLevel(lv)


def _rename_dims(path: Path, num_layers: int) -> None:
    """Give every dynamic axis optimum's name (the mask's total length included)."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    total = "past_sequence_length + sequence_length"
    for vi in list(m.graph.input) + list(m.graph.output):
        dims = vi.type.tensor_type.shape.dim
        if vi.name == "attention_mask":
            dims[1].dim_param = total
        elif vi.name.startswith("present.") and dims[2].dim_param:
            dims[2].dim_param = total
    onnx.save(m, str(path))


def export_graph(model, path: str | os.PathLike, *, opset: int = DEFAULT_OPSET,
                 external_data: bool | None = None, verbose: bool = False) -> Path:
    """Trace ``model`` (a HF causal LM in eval mode, any float dtype) to an ONNX file with
    KV-cache inputs/outputs (see the module docstring for names and shapes).

    Args:
        path: the ``.onnx`` file to write (its folder is created).
        opset: ONNX opset (>= 18).
        external_data: store weights in ``<file>.data``; None decides by size (> 1 GiB).
    Returns:
        the written path.
    """
    geo = kv_geometry(model.config)
    n, h, d = geo["num_layers"], geo["num_kv_heads"], geo["head_dim"]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if external_data is None:
        external_data = _param_bytes(model) > EXTERNAL_DATA_BYTES
    dtype = next(model.parameters()).dtype
    # Example sizes: distinct and > 1 so that torch.export keeps every axis symbolic.
    b, s, p = 2, 5, 7
    ids = torch.randint(0, geo["vocab_size"], (b, s))
    mask = torch.ones(b, p + s, dtype=torch.long)
    pos = torch.arange(p, p + s).expand(b, s).contiguous()
    past = tuple(torch.randn(b, h, p, d, dtype=dtype) for _ in range(2 * n))
    Dim = torch.export.Dim
    batch, seq = Dim("batch_size"), Dim("sequence_length")
    past_len = Dim("past_sequence_length", min=0)
    shapes = ({0: batch, 1: seq}, {0: batch, 1: Dim.DYNAMIC}, {0: batch, 1: seq},
              tuple({0: batch, 2: past_len} for _ in range(2 * n)))
    ins, outs = io_names(n)
    wrapper = _KVWrapper(model, n).eval()
    with _quiet(verbose), torch.inference_mode(False), torch.no_grad():
        torch.onnx.export(wrapper, (ids, mask, pos, past), str(path), input_names=ins,
                          output_names=outs, dynamic_shapes=shapes, dynamo=True,
                          opset_version=opset, external_data=external_data,
                          verbose=verbose)
    _rename_dims(path, n)
    return path


# ----------------------------------------------------------------------------- parity

def default_prompt(vocab_size: int, length: int = 16, seed: int = 0) -> list[int]:
    """A fixed pseudo-random prompt [length] for parity checks without a tokenizer."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=g).tolist()


def _onnx_path(p: str | os.PathLike) -> Path:
    p = Path(p)
    return p / MODEL_NAME if p.is_dir() else p


def _logit_diff(a, b) -> tuple[float, float, int]:
    """``(max, sum, count)`` of |a - b| over finite entries. Entries that are ``-inf`` in
    one (a reduced draft head masks ids that way) must be ``-inf`` in the other too,
    else the max is ``inf``."""
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fa, fb) or not torch.equal(a[~fa], b[~fb]):
        return math.inf, math.inf, int(fa.sum())
    d = (a[fa] - b[fb]).abs()
    if d.numel() == 0:
        return 0.0, 0.0, 0
    return float(d.max()), float(d.sum()), int(d.numel())


def check_parity(onnx_path: str | os.PathLike, model, steps: int = 64,
                 prompt: Sequence[int] | None = None, atol: float = PARITY_ATOL,
                 threads: int | None = None) -> dict:
    """Compare an ONNX export with the torch model it came from.

    The prompt [n] goes through both in one call (the ONNX call with an empty past),
    then ``steps`` greedy decode steps follow, one token per call, both fed torch's
    greedy token. At each step the ONNX argmax must equal torch's.

    Args:
        onnx_path: export folder or ``.onnx`` file. model: the HF model (eval).
        prompt: token ids (default: :func:`default_prompt`).
        atol: largest allowed |logit difference| (logit units).
    Returns:
        dict: ``max_abs_logit_diff`` (over prompt and decode logits), ``mean_abs_logit_diff``,
        ``greedy_identical`` (all ``steps`` argmaxes equal), ``greedy_matches``,
        ``first_mismatch`` (step index or None), ``steps``, ``prompt_len``, ``atol``,
        ``passed`` and ``seconds``.
    """
    t0 = time.perf_counter()
    runner = OnnxRunner(_onnx_path(onnx_path), providers="cpu", threads=threads)
    vocab = int(model.config.vocab_size)
    prompt = list(prompt) if prompt is not None else default_prompt(vocab)
    kv = KVModel(model)
    lt = kv.forward(prompt)
    lo = runner.forward(prompt)
    mx, sm, count = _logit_diff(lt, lo)
    diffs, sums = [mx], [sm]
    lt, lo = lt[-1], lo[-1]
    matches, first = 0, None
    for i in range(steps):
        tok = int(greedy_token(lt))
        if int(greedy_token(lo)) == tok:
            matches += 1
        elif first is None:
            first = i
        lt = kv.forward([tok])[-1]
        lo = runner.forward([tok])[-1]
        mx, sm, n = _logit_diff(lt, lo)
        diffs.append(mx)
        sums.append(sm)
        count += n
    max_diff = max(diffs)
    res = {"steps": steps, "prompt_len": len(prompt), "max_abs_logit_diff": max_diff,
           "mean_abs_logit_diff": sum(sums) / max(count, 1), "greedy_matches": matches,
           "greedy_identical": matches == steps, "first_mismatch": first, "atol": atol}
    res["passed"] = bool(max_diff <= atol and res["greedy_identical"])
    res["seconds"] = round(time.perf_counter() - t0, 3)
    return res


def _greedy_run(runner: OnnxRunner, prompt: Sequence[int], steps: int,
                forced: Sequence[int] | None = None) -> tuple[list[int], list[np.ndarray]]:
    """Greedy-decode ``steps`` tokens (or teacher-force ``forced``); returns the argmax at
    each step and the float32 logits rows [V] it saw."""
    runner.reset()
    logits = runner.forward(prompt)[-1]
    toks, rows = [], []
    for i in range(steps):
        tok = int(greedy_token(logits))
        toks.append(tok)
        rows.append(logits.numpy())
        if i + 1 < steps:
            logits = runner.forward([forced[i] if forced is not None else tok])[-1]
    return toks, rows


def compare_exports(variant: str | os.PathLike, reference: str | os.PathLike,
                    prompts: Sequence[Sequence[int]], steps: int = 64,
                    threads: int | None = None) -> dict:
    """Greedy agreement of a reduced-precision export with the float32 export.

    For each prompt the reference decodes ``steps`` greedy tokens; the variant is
    teacher-forced along that sequence (``greedy_agreement`` = fraction of steps whose
    argmax matches, the per-token agreement a draft would see) and also decodes freely
    (``free_run_identical_prefix`` = tokens identical before the first divergence,
    averaged over prompts; ``free_run_identical`` = prompts fully identical).

    Returns:
        dict with those fields plus ``max_abs_logit_diff`` / ``mean_abs_logit_diff``
        (teacher-forced, logit units), ``prompts`` and ``steps``.
    """
    ref = OnnxRunner(_onnx_path(reference), providers="cpu", threads=threads)
    var = OnnxRunner(_onnx_path(variant), providers="cpu", threads=threads)
    agree = total = identical = 0
    prefix, max_d, sum_d, n_d = [], 0.0, 0.0, 0
    for prompt in prompts:
        rt, rrows = _greedy_run(ref, prompt, steps)
        vt, vrows = _greedy_run(var, prompt, steps, forced=rt)
        agree += sum(a == b for a, b in zip(rt, vt))
        total += steps
        for a, b in zip(rrows, vrows):
            mx, sm, n = _logit_diff(a, b)
            max_d, sum_d, n_d = max(max_d, mx), sum_d + sm, n_d + n
        ft, _ = _greedy_run(var, prompt, steps)
        k = next((i for i, (a, b) in enumerate(zip(rt, ft)) if a != b), steps)
        prefix.append(k)
        identical += k == steps
    return {"prompts": len(prompts), "steps": steps,
            "greedy_agreement": agree / max(total, 1),
            "free_run_identical_prefix": sum(prefix) / max(len(prefix), 1),
            "free_run_identical": identical,
            "max_abs_logit_diff": max_d, "mean_abs_logit_diff": sum_d / max(n_d, 1)}


# ----------------------------------------------------------------------------- variants

def _materialize_transposed_weights(m) -> int:
    """Replace ``MatMul(x, Transpose(W))`` with ``MatMul(x, W_T)`` for initializers ``W``
    (a tied LM head reads the embedding that way) so the quantizer sees a constant
    weight. Returns how many MatMuls were rewired."""
    from onnx import numpy_helper

    inits = {i.name: i for i in m.graph.initializer}
    producer = {o: n for n in m.graph.node for o in n.output}
    done = 0
    for node in m.graph.node:
        if node.op_type != "MatMul" or node.input[1] in inits:
            continue
        tr = producer.get(node.input[1])
        if tr is None or tr.op_type != "Transpose" or tr.input[0] not in inits:
            continue
        perm = [list(a.ints) for a in tr.attribute if a.name == "perm"]
        w = numpy_helper.to_array(inits[tr.input[0]])
        if w.ndim != 2 or (perm and perm[0] != [1, 0]):
            continue
        name = tr.input[0] + ".T"
        if name not in inits:
            t = numpy_helper.from_array(np.ascontiguousarray(w.T), name)
            m.graph.initializer.append(t)
            inits[name] = t
        node.input[1] = name
        done += 1
    return done


def _lm_head_matmul(m) -> str | None:
    """Name of the MatMul that produces the ``logits`` output from a constant weight
    (None when the head is not such a MatMul, e.g. a masked draft head)."""
    inits = {i.name for i in m.graph.initializer}
    for node in m.graph.node:
        if "logits" in node.output and node.op_type == "MatMul" and node.input[1] in inits:
            return node.name
    return None


def quantize_weights(src: str | os.PathLike, dst: str | os.PathLike, *, bits: int = 4,
                     block_size: int = 32, symmetric: bool = True, accuracy_level: int = 4,
                     lm_head: bool = True, lm_head_bits: int | None = None) -> dict:
    """Weight-only quantisation of every constant-weight MatMul to ``bits`` (4 or 8;
    onnxruntime ``MatMulNBits``, round-to-nearest per block). Activations, KV cache and
    logits stay float32; the embedding Gather keeps float32.

    Args:
        src / dst: ``.onnx`` files. bits: 4 or 8.
        block_size: weights per scale (power of 2, >= 16).
        symmetric: symmetric blocks (no zero points); False stores a zero point per
            block.
        accuracy_level: MatMulNBits compute type on CPU (4 = int8 activations, fastest;
            0/1 = float32).
        lm_head: also quantise the LM head (a tied head reads the embedding through a
            Transpose; a transposed copy is quantised).
        lm_head_bits: bits for the LM head (4 or 8; None = ``bits``). The head decides
            the argmax directly; 8 bits cost more memory traffic per token.
    Returns:
        the quantisation settings and how many MatMuls were converted
        (``quantized_matmuls``; ``int8_matmuls`` of them at 8 bits).
    """
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    lm_head_bits = bits if lm_head_bits is None else lm_head_bits
    if bits not in (4, 8) or lm_head_bits not in (4, 8):
        raise ValueError(f"bits / lm_head_bits must be 4 or 8, not {bits} / {lm_head_bits}")
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(
        logging.WARNING)
    m = onnx.load(str(src))
    if lm_head:
        _materialize_transposed_weights(m)
    head = _lm_head_matmul(m)
    exclude = [head] if head and (not lm_head or lm_head_bits != bits) else []
    q = MatMulNBitsQuantizer(m, bits=bits, block_size=block_size, is_symmetric=symmetric,
                             accuracy_level=accuracy_level, nodes_to_exclude=exclude)
    with _quiet(False):
        q.process()
    out = q.model.model
    if head and lm_head and lm_head_bits != bits:
        others = [n.name for n in out.graph.node if n.op_type == "MatMul" and n.name != head]
        qh = MatMulNBitsQuantizer(out, bits=lm_head_bits, block_size=block_size,
                                  is_symmetric=symmetric, accuracy_level=accuracy_level,
                                  nodes_to_exclude=others)
        with _quiet(False):
            qh.process()
        out = qh.model.model
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    big = out.ByteSize() > EXTERNAL_DATA_BYTES
    onnx.save_model(out, str(dst), save_as_external_data=big,
                    location=dst.name + ".data" if big else None)
    nodes = list(out.graph.node)
    nbits = [next((a.i for a in n.attribute if a.name == "bits"), 4) for n in nodes
             if n.op_type == "MatMulNBits"]
    return {"method": "MatMulNBits", "bits": bits, "block_size": block_size,
            "symmetric": symmetric, "accuracy_level": accuracy_level, "lm_head": lm_head,
            "lm_head_bits": lm_head_bits if lm_head and head else None,
            "quantized_matmuls": len(nbits), "int8_matmuls": nbits.count(8),
            "float_matmuls_left": sum(n.op_type == "MatMul" for n in nodes)}


def quantize_int4(src: str | os.PathLike, dst: str | os.PathLike, *, block_size: int = 32,
                  symmetric: bool = True, accuracy_level: int = 4, lm_head: bool = True,
                  lm_head_bits: int = 4) -> dict:
    """:func:`quantize_weights` at 4 bits (``lm_head_bits=8`` keeps the head at 8)."""
    return quantize_weights(src, dst, bits=4, block_size=block_size, symmetric=symmetric,
                            accuracy_level=accuracy_level, lm_head=lm_head,
                            lm_head_bits=lm_head_bits)


def quantize_int8(src: str | os.PathLike, dst: str | os.PathLike, *, block_size: int = 32,
                  symmetric: bool = True, accuracy_level: int = 4,
                  lm_head: bool = True) -> dict:
    """:func:`quantize_weights` at 8 bits (MatMulNBits, int8 weights per block)."""
    return quantize_weights(src, dst, bits=8, block_size=block_size, symmetric=symmetric,
                            accuracy_level=accuracy_level, lm_head=lm_head)


# ----------------------------------------------------------------------------- manifest

def _versions() -> dict:
    import onnx
    import onnxruntime
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}


def _manifest(model, *, dtype: str, kv_dtype: str, opset: int, source: str | None,
              external: bool) -> dict:
    ins, outs = io_names(kv_geometry(model.config)["num_layers"])
    return {
        "format": "specrelay-onnx", "version": 1, "model_file": MODEL_NAME,
        "external_data": (MODEL_NAME + ".data") if external else None,
        "source": source, "architecture": (model.config.architectures or [None])[0]
        or type(model).__name__, "model_type": model.config.model_type,
        **kv_geometry(model.config), "dtype": dtype, "kv_dtype": kv_dtype, "opset": opset,
        "inputs": ins, "outputs": outs,
        "dynamic_axes": {"batch_size": "dim 0 of every input/output",
                         "sequence_length": "new tokens per call",
                         "past_sequence_length": "cached tokens (0 allowed)"},
        "exporter": {"method": "torch.onnx.export(dynamo=True)", **_versions()},
    }


def write_manifest(folder: str | os.PathLike, manifest: dict) -> Path:
    """Write ``specrelay_onnx.json`` into ``folder``."""
    p = Path(folder) / MANIFEST_NAME
    p.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return p


def export_onnx(model, out_dir: str | os.PathLike, *, opset: int = DEFAULT_OPSET,
                fp16: bool = False, int4: bool = False, int8: bool = False,
                parity: bool = True,
                parity_steps: int = 64, prompts: Sequence[Sequence[int]] | None = None,
                source: str | None = None, int4_block_size: int = 32,
                threads: int | None = None, verbose: bool = False) -> dict:
    """Export ``model`` (HF causal LM, float32, eval) to ``out_dir`` with optional
    variants, checking each.

    Args:
        out_dir: folder for ``model.onnx`` + ``specrelay_onnx.json`` (``fp16/`` and
            ``int4/`` subfolders for the variants).
        fp16: also export a float16 graph (float16 weights, KV and logits).
        int4: also write a weight-only int4 graph (MatMulNBits, float32 KV/logits).
        int8: also write a weight-only int8 graph (MatMulNBits 8 bits, float32 KV/logits).
        parity: run :func:`check_parity` on the float32 export (steps=``parity_steps``)
            and :func:`compare_exports` on each variant; results go in the manifests.
        prompts: token-id prompts for the checks (default one :func:`default_prompt`);
            the first is used for the float32 parity check.
        source: free text recorded in the manifest (model spec).
    Returns:
        the float32 manifest as written (``parity``; ``variants`` -> path and
        ``agreement_vs_fp32`` per variant) plus ``variant_manifests`` -> each variant's
        full manifest.
    Raises:
        RuntimeError: the float32 export failed its parity check (the files stay on
        disk, the manifest records the failure).
    """
    out = Path(out_dir)
    t0 = time.perf_counter()
    model = model.eval()
    if next(model.parameters()).dtype != torch.float32:
        model = copy.deepcopy(model).float()
    vocab = int(model.config.vocab_size)
    prompts = [list(p) for p in (prompts or [default_prompt(vocab)])]
    path = export_graph(model, out / MODEL_NAME, opset=opset, verbose=verbose)
    external = (out / (MODEL_NAME + ".data")).exists()
    man = _manifest(model, dtype="float32", kv_dtype="float32", opset=opset,
                    source=source, external=external)
    man["export_seconds"] = round(time.perf_counter() - t0, 2)
    write_manifest(out, man)
    if parity:
        man["parity"] = check_parity(path, model, steps=parity_steps, prompt=prompts[0],
                                     threads=threads)
    write_manifest(out, man)
    variants = {}
    if fp16:
        t1 = time.perf_counter()
        half = copy.deepcopy(model).half().eval()
        vdir = out / "fp16"
        export_graph(half, vdir / MODEL_NAME, opset=opset, verbose=verbose)
        del half
        vm = _manifest(model, dtype="float16", kv_dtype="float16", opset=opset,
                       source=source, external=(vdir / (MODEL_NAME + ".data")).exists())
        vm["export_seconds"] = round(time.perf_counter() - t1, 2)
        variants["fp16"] = vm
    for name, on, quantize in (("int4", int4, quantize_int4), ("int8", int8, quantize_int8)):
        if not on:
            continue
        t1 = time.perf_counter()
        vdir = out / name
        qinfo = quantize(path, vdir / MODEL_NAME, block_size=int4_block_size)
        vm = _manifest(model, dtype=name, kv_dtype="float32", opset=opset, source=source,
                       external=(vdir / (MODEL_NAME + ".data")).exists())
        vm["quantization"] = qinfo
        vm["export_seconds"] = round(time.perf_counter() - t1, 2)
        variants[name] = vm
    for name, vm in variants.items():
        vdir = out / name
        write_manifest(vdir, vm)  # the runner reads it
        if parity:
            vm["agreement_vs_fp32"] = compare_exports(vdir, out, prompts, parity_steps,
                                                      threads=threads)
            write_manifest(vdir, vm)
    if variants:
        man["variants"] = {k: {"path": k, "agreement_vs_fp32": v.get("agreement_vs_fp32")}
                           for k, v in variants.items()}
        write_manifest(out, man)
    if parity and not man["parity"]["passed"]:
        raise RuntimeError(f"ONNX parity check failed: {man['parity']}")
    man["variant_manifests"] = variants
    return man
