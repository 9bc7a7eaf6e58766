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
``logits_to_keep``             int64    [logits_length]: positions among the new tokens
``logits``                     kv       [batch_size, logits_length, V]
``present.N.key`` / ``.value`` kv       [batch_size, H_kv, past_sequence_length + sequence_length, D]
=============================  =======  ==========================================

``kv`` is float32 (fp32, int4 and int8 exports) or float16 (fp16 export). A first call with
``past_sequence_length = 0`` (empty past tensors) is valid. ``logits_to_keep`` picks the
rows of the LM head that run (``arange(sequence_length)``: all; a prefill needs only the
last): transformers' tensor ``logits_to_keep``. Exports before it have no such input;
:class:`~edge_sdk.drafters.onnx.OnnxRunner` drives both.

Modules: :mod:`~exporters.onnx.graph` (trace the graph), :mod:`~exporters.onnx.quantize`
(weight-only int4 / int8), :mod:`~exporters.onnx.parity` (checks against torch and
between exports), :mod:`~exporters.onnx.manifest` (``specrelay_onnx.json``),
:mod:`~exporters.onnx.export` (a folder with its variants: ``specrelay export onnx``),
:mod:`~exporters.onnx.first_use` (the cached export the ``onnx-*`` draft runtimes load,
built on first use). Running an export is the SDK's job
(:mod:`edge_sdk.drafters.onnx`); the SDK never imports this package (the body of the
``specrelay edge-serve`` command aside: ``tests/test_architecture.py`` lists why).
"""
