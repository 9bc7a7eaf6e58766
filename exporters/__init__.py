"""Draft-model tooling (training and compile code; the edge SDK never imports it):

* :mod:`exporters.onnx` — ONNX export with KV cache, weight-only int4/int8, parity
  checks, and the cached exports the SDK's ``onnx-*`` draft runtimes load
  (:mod:`exporters.onnx.first_use`).
* :mod:`exporters.tensorrt` — TensorRT engines from an ONNX export (Jetson / GPUs).
* :mod:`exporters.speed` — draft ms/token and greedy agreement per runtime.
* :mod:`exporters.distill` — train a small draft for a target by KL distillation.
* :mod:`exporters.cli` — the ``specrelay export`` click group.
"""
