"""Which sampling configs a scoring backend verifies exactly from top-N rows.

The acceptance rule needs p_i(d_i) and, at a rejection, the residual over p's support
(Leviathan et al. 2023 §2.3). From the engine's top-N raw logprobs:

* greedy without a repetition penalty: the argmax is the top-1 row entry: exact (up to
  the engine's numerics and its tie order);
* top-k sampling with k <= N, no repetition penalty (temperature and top-p applied on
  top): every token p can put mass on is inside the returned rows, with its exact raw
  score: exact;
* temperature- or top-p-only sampling (support = the whole vocabulary), k > N, or a
  repetition penalty (it reorders the scores, pushing unreturned tokens into the top):
  not exact; refused with 422 ``not_exact_on_backend``.
"""

from __future__ import annotations

from cloud_api.sessions import ApiError
from edge_sdk.protocol.sampling import SamplingConfig

__all__ = ["check_exact", "exact_on_top_n"]


def exact_on_top_n(cfg: SamplingConfig, top_n: int) -> str | None:
    """None when ``cfg`` is verified exactly from top-``top_n`` rows, else the reason."""
    if cfg.repetition_penalty != 1.0:
        return "a repetition penalty reorders tokens the engine did not return"
    if cfg.greedy:
        return None
    if cfg.top_k == 0:
        return (f"sampling without top_k has the whole vocabulary as support; the engine "
                f"returns the top {top_n} only (use top_k <= {top_n})")
    if cfg.top_k > top_n:
        return f"top_k {cfg.top_k} exceeds the {top_n} scores the engine returns"
    return None


def check_exact(cfg: SamplingConfig, top_n: int) -> None:
    """Raises ApiError 422 ``not_exact_on_backend`` (field ``sampling``) for a config
    the scoring backend cannot verify exactly."""
    why = exact_on_top_n(cfg, top_n)
    if why is not None:
        raise ApiError(422, "not_exact_on_backend", f"this server verifies through a "
                       f"scoring engine: {why}", "sampling")
