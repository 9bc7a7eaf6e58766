"""Verifier backends behind one interface (:mod:`~cloud_api.scoring.interface`).

* the torch :class:`cloud_api.verifier.Verifier` (the embedded default: exact, owns
  each session's KV cache);
* :class:`~cloud_api.scoring.verifier.ScoringVerifier`: keeps each session's committed
  ids and asks a serving engine to *score* context + drafts (top-N logprobs per
  position), then applies our acceptance rule, residual and certificates to those
  rows. Exact only where the rows suffice (:mod:`~cloud_api.scoring.exactness`);
* scorers: :class:`~cloud_api.scoring.sglang.SGLangScorer` (SGLang ``/generate`` with
  input logprobs), :class:`~cloud_api.scoring.vllm.VLLMScorer` (vLLM completions with
  prompt logprobs), :class:`~cloud_api.scoring.local.ModelScorer` (a local HF model's
  top-N: tests and the conformance check);
* :mod:`~cloud_api.scoring.engines`: the verifier of ``specrelay serve --backend
  sglang|vllm`` (scorer + the target's shape from its config, no weights). The engine
  clients are plain HTTP (the standard library): no extra to install.
"""
