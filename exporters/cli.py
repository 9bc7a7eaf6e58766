"""``specrelay export``: compile draft models to ONNX and TensorRT.

The click group :data:`export` is mounted by the top-level ``specrelay`` CLI; it also
runs on its own with ``python -m exporters.cli``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click


@click.group("export")
def export():
    """Compile a draft model for the edge: ONNX (onnxruntime CPU / CUDA / TensorRT EP)
    and TensorRT engines (Jetson, NVIDIA GPUs).

    \b
    Examples:
      specrelay export onnx smollm2-135m@4 --out drafts/s4-onnx --int4
      specrelay export onnx edge_sdk/assets/drafts/smollm2-135m-draft --out d-onnx --fp16
      specrelay export tensorrt drafts/s4-onnx --out drafts/s4-trt --fp16

    The ONNX folder loads with edge_sdk.drafters.onnx.OnnxDrafter(folder).
    """


def _load(model: str, threads: int | None, dtype: str = "float32"):
    """``(model, tokenizer or None)``; a draft folder without tokenizer files loads too."""
    import torch

    from edge_sdk.models import load_model, resolve, truncate_layers

    spec = resolve(model)
    folder = Path(spec.path)
    # load_model handles presets, GGUF, distilled drafts (specrelay_draft.json, rebuilt
    # from their target) and folders with a tokenizer; a bare save_pretrained folder
    # (no tokenizer) loads here without one.
    tok_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                 "specrelay_draft.json")
    if spec.gguf_file or not folder.is_dir() or any((folder / f).exists() for f in tok_files):
        return load_model(model, dtype=dtype, threads=threads)
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    if spec.truncate_layers:
        m = truncate_layers(m, spec.truncate_layers)
    return m.eval().requires_grad_(False), None


def _out_for(model: str) -> Path:
    name = Path(model.rstrip("/")).name if "/" in model else model
    return Path(name.replace("@", "-").replace("::", "-") + "-onnx")


def _check_prompts(tok, vocab: int) -> list[list[int]]:
    """Token ids of :data:`~exporters.onnx.parity.PARITY_TEXTS` for the parity checks
    (ids >= ``vocab`` dropped); fixed ids without a usable tokenizer."""
    from exporters.onnx.parity import PARITY_TEXTS, default_prompt

    try:
        if tok is None:
            raise ValueError("no tokenizer")
        prompts = [tok(t)["input_ids"] for t in PARITY_TEXTS]
        prompts = [[t for t in p if t < vocab] for p in prompts]
        return [p for p in prompts if p] or [default_prompt(vocab)]
    except Exception:  # noqa: BLE001 - any tokenizer trouble: fall back to fixed ids
        return [default_prompt(vocab)]


def _summary(man: dict, out: Path) -> dict:
    """What ``export onnx`` prints: the folder, time, float32 parity, variants' agreement."""
    summary = {"out": str(out), "export_seconds": man["export_seconds"]}
    if "parity" in man:
        summary["parity"] = {k: man["parity"][k] for k in
                             ("passed", "max_abs_logit_diff", "greedy_matches", "steps")}
    for name, v in (man.get("variants") or {}).items():
        summary[name] = v["agreement_vs_fp32"] or {"path": str(out / name)}
    return summary


@export.command("onnx", short_help="Export a model to ONNX with KV cache (+fp16/int4).")
@click.argument("model")
@click.option("--out", "-o", "out", type=click.Path(file_okay=False), default=None,
              help="output folder (default: ./<model>-onnx)")
@click.option("--fp16", is_flag=True, help="also write a float16 graph in OUT/fp16")
@click.option("--int4", is_flag=True,
              help="also write a weight-only int4 graph (MatMulNBits) in OUT/int4")
@click.option("--int8", is_flag=True,
              help="also write a weight-only int8 graph (MatMulNBits, 8 bits) in OUT/int8")
@click.option("--no-parity", is_flag=True, help="skip the parity / agreement checks")
@click.option("--opset", type=int, default=18, show_default=True, help="ONNX opset")
@click.option("--steps", type=int, default=64, show_default=True,
              help="greedy decode steps compared by the parity check")
@click.option("--threads", type=int, default=None,
              help="torch / onnxruntime intra-op threads (default: all cores)")
@click.option("--int4-block-size", type=int, default=None,
              help="weights per int4 / int8 scale of the decoder layers (default: each "
              "variant's first-use setting, edge_sdk.drafters.runtime.ONNX_VARIANTS)")
@click.option("--int4-head-block-size", type=int, default=None,
              help="weights per scale of the int4 graph's LM head (default: the "
              "first-use export's)")
@click.option("--int4-head-vocab", type=click.IntRange(1), default=None,
              help="rows of the int4 graph's LM head: the most frequent tokens of the "
              "tokenizer's shipped ranking (FR-Spec; default: the first-use export's; "
              "without a ranking for the tokenizer the whole head)")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32",
              show_default=True, help="dtype the model is loaded in; the graph is always "
              "traced in float32 (bfloat16: the bf16 draft's exact weights, widened, and "
              "no float32 GGUF dequantisation/cache)")
@click.option("--attention", type=click.Choice(["gqa", "model"]), default="gqa",
              show_default=True, help="how the attention is traced: gqa = each KV head "
              "read once by its query group (no repeated KV cache); model = the model's "
              "own attention (K and V repeated per query head, slower on long contexts)")
@click.option("--fuse/--no-fuse", "fuse", default=True, show_default=True,
              help="fuse the int4 / int8 graphs' RMSNorms and rotary embeddings into "
              "onnxruntime's (Skip)SimplifiedLayerNormalization and RotaryEmbedding, as "
              "the first-use export does")
@click.option("--verbose", is_flag=True, help="show the torch.onnx exporter's output")
def onnx_cmd(model, out, fp16, int4, int8, no_parity, opset, steps, threads, int4_block_size,
             int4_head_block_size, int4_head_vocab, dtype, attention, fuse, verbose):
    """Export MODEL to ONNX with KV-cache inputs/outputs (optimum naming).

    MODEL is a model spec (qwen2.5-coder-0.5b, smollm2-135m, smollm2-135m@4 = first 4
    layers, a HF id, a .gguf) or a draft folder (save_pretrained layout). Llama and
    Qwen2 decoders are supported (Qwen2's attention biases, tied or untied heads, GQA,
    sliding-window configs). Writes OUT/model.onnx and
    OUT/specrelay_onnx.json; the float32 graph must match torch (max |logit diff| <=
    1e-3 and identical greedy tokens over --steps decode steps) or the command fails.
    fp16/int4/int8 variants record their greedy agreement with the float32 graph.

    \b
    Examples:
      specrelay export onnx smollm2-135m@4 --out /tmp/s4-onnx
      specrelay export onnx smollm2-135m@4 --out /tmp/s4-onnx --fp16 --int4
      specrelay export onnx qwen2.5-coder-0.5b --dtype bfloat16 --int4 --int8 --threads 1
      specrelay export onnx path/to/draft --out draft-onnx --no-parity --opset 18
    """
    from exporters.onnx.export import export_onnx

    out = Path(out) if out else _out_for(model)
    click.echo(f"loading {model} ...", err=True)
    try:
        m, tok = _load(model, threads, dtype)
    except (OSError, ModuleNotFoundError, ValueError) as e:
        raise click.ClickException(f"cannot load {model}: {e}") from None
    prompts = _check_prompts(tok, int(m.config.vocab_size))
    click.echo(f"exporting to {out} ...", err=True)
    blocks = {k: v for k, v in (("int4_block_size", int4_block_size),
                                ("int4_head_block_size", int4_head_block_size),
                                ("int4_head_vocab", int4_head_vocab))
              if v is not None}                 # unset: export_onnx's (first-use) ones
    try:
        man = export_onnx(m, out, opset=opset, fp16=fp16, int4=int4, int8=int8,
                          parity=not no_parity,
                          parity_steps=steps, prompts=prompts, source=model, tokenizer=tok,
                          threads=threads, verbose=verbose, attention=attention,
                          fuse_norms=fuse, fuse_rotary=fuse, **blocks)
    except RuntimeError as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(_summary(man, out), indent=2))


@export.command("tensorrt", short_help="Build a TensorRT engine from an ONNX export.")
@click.argument("onnx_dir", type=click.Path(exists=True))
@click.option("--out", "-o", "out", type=click.Path(file_okay=False), default=None,
              help="output folder (default: ONNX_DIR/tensorrt)")
@click.option("--fp16", is_flag=True, help="allow fp16 kernels (TensorRT <= 10 flag; with "
              "TensorRT 11 build from an --fp16 ONNX export instead)")
@click.option("--int8", is_flag=True,
              help="allow int8 kernels where the ONNX has Q/DQ scales (TensorRT <= 10)")
@click.option("--workspace-gb", type=float, default=2.0, show_default=True,
              help="builder workspace memory limit, GiB")
@click.option("--max-batch", type=int, default=1, show_default=True)
@click.option("--max-seq", type=int, default=512, show_default=True,
              help="most new tokens per call (prefill length)")
@click.option("--max-past", type=int, default=2048, show_default=True,
              help="most cached tokens (past length)")
def tensorrt_cmd(onnx_dir, out, fp16, int8, workspace_gb, max_batch, max_seq, max_past):
    """Build a TensorRT engine from an ONNX export folder (needs an NVIDIA GPU and the
    tensorrt package; elsewhere it exits with status 3 and says why).

    One optimisation profile bounds every input: tokens [1..max-batch, 1..max-seq],
    past_key_values.* [batch, H_kv, 0..max-past, D]. Writes OUT/model.engine and
    OUT/specrelay_trt.json (shapes, precision, TensorRT version, device).

    \b
    Examples:
      specrelay export tensorrt /tmp/s4-onnx --fp16
      specrelay export tensorrt /tmp/s4-onnx/fp16 --out /tmp/s4-trt --workspace-gb 4
    """
    from exporters.tensorrt import EXIT_UNAVAILABLE, TensorRTUnavailable, build_engine

    try:
        man = build_engine(onnx_dir, out, fp16=fp16, int8=int8, workspace_gb=workspace_gb,
                           max_batch=max_batch, max_seq=max_seq, max_past=max_past)
    except TensorRTUnavailable as e:
        click.echo(f"specrelay export tensorrt: {e}", err=True)
        sys.exit(EXIT_UNAVAILABLE)
    except (RuntimeError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps({k: man[k] for k in ("engine_file", "precision", "tensorrt_version",
                                               "device", "build_seconds")}, indent=2))


if __name__ == "__main__":
    export()
