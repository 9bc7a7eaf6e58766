"""Build a TensorRT engine from an ONNX export (``exporters.onnx``) for Jetson / GPUs.

Uses TensorRT's Python builder: parse ``model.onnx`` (external data included), add one
optimisation profile that bounds every dynamic input (``input_ids``, ``attention_mask``,
``position_ids`` and every ``past_key_values.N.key/value``; the ``present.N.*`` outputs
follow from them), set the precision, serialise. Writes::

    OUT/model.engine          the serialised engine (plan), device-specific
    OUT/specrelay_trt.json    shapes (min/opt/max per input), precision, TensorRT version,
                              device, build time, geometry copied from the ONNX manifest

Precision: TensorRT <= 10 takes ``fp16`` / ``int8`` builder flags (int8 kernels are only
picked where the ONNX carries Q/DQ scales; no calibrator is run). TensorRT 11 removed
those flags (networks are strongly typed): build from the fp16 export
(``specrelay export onnx --fp16`` -> ``OUT/fp16``) to get fp16 kernels.

Without an NVIDIA GPU or the ``tensorrt`` package, :func:`build_engine` raises
:class:`TensorRTUnavailable` whose message says why; the CLI prints it and exits with
status 3 (no traceback).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from edge_sdk.drafters.onnx import profile_shapes, read_manifest, resolve_model_dir

ENGINE_NAME = "model.engine"
MANIFEST_NAME = "specrelay_trt.json"
#: CLI exit status when TensorRT cannot run here.
EXIT_UNAVAILABLE = 3


__all__ = ["build_engine", "profile_shapes", "unavailable_reason", "TensorRTUnavailable",
           "EXIT_UNAVAILABLE"]


class TensorRTUnavailable(RuntimeError):
    """TensorRT cannot build here (no NVIDIA GPU / driver, or no ``tensorrt`` package)."""


def _gpu_name() -> str | None:
    """Name of the first NVIDIA GPU, or None when there is none (driver included)."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - a broken CUDA install counts as no GPU
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    if Path("/etc/nv_tegra_release").exists():  # Jetson: no nvidia-smi before JetPack 6
        return "NVIDIA Jetson (" + Path("/etc/nv_tegra_release").read_text()[:40].strip() + ")"
    return None


def unavailable_reason() -> str | None:
    """Why TensorRT cannot build on this machine, or None when it can."""
    import importlib.util

    gpu = _gpu_name()
    has_trt = importlib.util.find_spec("tensorrt") is not None
    if gpu is None and not has_trt:
        return ("TensorRT needs an NVIDIA GPU and the 'tensorrt' Python package; this "
                "machine has neither (build the engine on the Jetson/GPU host: "
                "pip install tensorrt, or use JetPack's python3-libnvinfer)")
    if gpu is None:
        return "TensorRT is installed but no NVIDIA GPU/driver was found on this machine"
    if not has_trt:
        return (f"found GPU '{gpu}' but the 'tensorrt' Python package is not installed "
                "(pip install tensorrt, or JetPack's python3-libnvinfer)")
    return None


def _check_precision(trt, manifest: dict, fp16: bool, int8: bool) -> tuple[bool, bool]:
    """-> (this TensorRT has fp16/int8 builder flags, the ONNX graph is float16).

    Raises:
        TensorRTUnavailable: fp16 or int8 asked of a TensorRT without those flags (11+)
            for a graph that does not carry them.
    """
    weak_flags = hasattr(trt.BuilderFlag, "FP16")
    graph_fp16 = manifest.get("dtype") == "float16"
    if not weak_flags and (int8 or (fp16 and not graph_fp16)):
        raise TensorRTUnavailable(
            f"TensorRT {trt.__version__} builds strongly typed networks only (no fp16/int8 "
            "builder flags): export with 'specrelay export onnx --fp16' and build from the "
            "fp16/ folder; int8 needs an ONNX with Q/DQ nodes")
    return weak_flags, graph_fp16


def _build(builder, network, config, engine_path: Path) -> Path:
    """Build the serialised engine into ``engine_path``. Raises RuntimeError: the build
    failed."""
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("TensorRT engine build failed (see the TensorRT log above)")
    with open(engine_path, "wb") as f:
        f.write(plan)
    return engine_path


def _network_flags(trt, graph_fp16: bool) -> tuple[int, bool]:
    """Network creation flags (explicit batch before TensorRT 10; strongly typed for an
    fp16 graph where supported) -> (flags, strongly typed)."""
    flags = 0
    if int(trt.__version__.split(".")[0]) < 10:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    # An fp16 graph carries its own types: build it strongly typed where supported.
    strongly = graph_fp16 and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED")
    if strongly:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    return flags, strongly


def _parse(trt, builder, logger, model_path: Path, flags: int):
    """The parsed network of ``model_path``. Raises RuntimeError: it did not parse."""
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(model_path)):
        errs = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {model_path}: {errs}")
    return network, parser


def _precision(trt, config, *, graph_fp16: bool, weak_flags: bool, strongly: bool,
               fp16: bool, int8: bool) -> list[str]:
    """Set the fp16 / int8 builder flags where this TensorRT has them; returns the
    precisions asked of the engine."""
    precision = ["fp16" if graph_fp16 else "fp32"]
    if weak_flags and not strongly:
        if fp16:
            config.set_flag(trt.BuilderFlag.FP16)
            precision.append("fp16")
        if int8:
            config.set_flag(trt.BuilderFlag.INT8)
            precision.append("int8")
    return precision


def _add_profile(builder, config, network, manifest: dict, bounds: dict) -> dict:
    """One optimisation profile over every network input (:func:`profile_shapes` with
    ``bounds``); returns the shapes. Raises RuntimeError: an input has no profile."""
    inputs = [network.get_input(i).name for i in range(network.num_inputs)]
    shapes = profile_shapes(manifest, input_names=inputs, **bounds)
    missing = [n for n in inputs if n not in shapes]
    if missing:
        raise RuntimeError(f"no profile for inputs {missing}: not a specrelay/optimum export")
    profile = builder.create_optimization_profile()
    for name, s in shapes.items():
        profile.set_shape(name, s["min"], s["opt"], s["max"])
    config.add_optimization_profile(profile)
    return shapes


def _engine_manifest(trt, engine_path: Path, model_path: Path, manifest: dict, network,
                     **info) -> dict:
    """``specrelay_trt.json``'s content; ``info``: precision, requested, workspace_gb,
    profiles, build_seconds."""
    outputs = [network.get_output(i).name for i in range(network.num_outputs)]
    return {
        "format": "specrelay-tensorrt", "version": 1, "engine_file": ENGINE_NAME,
        "onnx": str(model_path), "tensorrt_version": trt.__version__,
        "device": _gpu_name(), "precision": info["precision"],
        "requested": info["requested"], "workspace_gb": info["workspace_gb"],
        "profiles": info["profiles"], "outputs": outputs,
        "build_seconds": info["build_seconds"],
        "engine_bytes": engine_path.stat().st_size,
        **{k: manifest[k] for k in ("num_layers", "num_kv_heads", "head_dim", "vocab_size")
           if k in manifest},
        "onnx_dtype": manifest.get("dtype"),
    }


def build_engine(onnx_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None, *,
                 fp16: bool = False, int8: bool = False, workspace_gb: float = 2.0,
                 max_batch: int = 1, max_seq: int = 512, max_past: int = 2048,
                 opt_past: int = 256) -> dict:
    """Parse the ONNX export in ``onnx_dir`` and write ``model.engine`` + manifest.

    Args:
        onnx_dir: export folder (``model.onnx`` + ``specrelay_onnx.json``) or ``.onnx``.
        out_dir: where to write (default ``<onnx_dir>/tensorrt``).
        fp16 / int8: precision flags (TensorRT <= 10; see the module docstring for 11).
        workspace_gb: builder workspace memory pool limit, GiB.
        max_batch / max_seq / max_past / opt_past: profile bounds (see
            :func:`profile_shapes`).
    Returns:
        the TensorRT manifest (also written to ``specrelay_trt.json``).
    Raises:
        TensorRTUnavailable: no GPU / no tensorrt package, or a precision this TensorRT
            cannot give. RuntimeError: the ONNX did not parse or the build failed.
    """
    reason = unavailable_reason()
    if reason:
        raise TensorRTUnavailable(reason)
    import tensorrt as trt  # noqa: PLC0415 - optional, GPU hosts only

    folder, model_path = resolve_model_dir(onnx_dir)
    manifest = read_manifest(model_path)
    out = Path(out_dir) if out_dir else folder / "tensorrt"
    out.mkdir(parents=True, exist_ok=True)
    weak_flags, graph_fp16 = _check_precision(trt, manifest, fp16, int8)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags, strongly = _network_flags(trt, graph_fp16)
    network, _parser = _parse(trt, builder, logger, model_path, flags)
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gb * (1 << 30)))
    precision = _precision(trt, config, graph_fp16=graph_fp16, weak_flags=weak_flags,
                           strongly=strongly, fp16=fp16, int8=int8)
    shapes = _add_profile(builder, config, network, manifest, dict(
        max_batch=max_batch, max_seq=max_seq, max_past=max_past, opt_past=opt_past))
    t0 = time.perf_counter()
    engine_path = _build(builder, network, config, out / ENGINE_NAME)
    man = _engine_manifest(trt, engine_path, model_path, manifest, network,
                           precision=sorted(set(precision)),
                           requested={"fp16": fp16, "int8": int8}, workspace_gb=workspace_gb,
                           profiles=[shapes],
                           build_seconds=round(time.perf_counter() - t0, 1))
    (out / MANIFEST_NAME).write_text(json.dumps(man, indent=2) + "\n")
    return man
