"""Draft-model tooling: distillation (distill.py), ONNX / TensorRT export."""
