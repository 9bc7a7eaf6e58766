"""The WISV decision head: a small classifier over :func:`.features.mismatch_features`
(WISV §III-B), and its file format.

A head is a ``.safetensors`` file (weights + the feature standardisation) with a
``.json`` manifest beside it (same stem)::

    {"format": "specrelay-wisv-head/1", "model": <preset or model name>,
     "hidden_size": H, "features": F, "width": W, "label": <criterion text>,
     "train": {...}, "metrics": {...}, "sha256": <of the .safetensors file>}
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from torch import nn

from cloud_api.wisv.features import SCALAR_FEATURES, n_features

__all__ = ["HEAD_FORMAT", "DecisionHead", "save_head", "load_head"]

HEAD_FORMAT = "specrelay-wisv-head/1"


class DecisionHead(nn.Module):
    """P(accepting the draft token keeps the task outcome) from features [N, F].

    ``width`` 0: logistic regression on the standardised features; ``width`` > 0: one
    hidden ReLU layer of that width. ``mean`` / ``std`` (float32 [F]) standardise the
    input and are fitted with the weights.
    """

    def __init__(self, hidden_size: int, width: int = 0):
        super().__init__()
        self.hidden_size = int(hidden_size)
        self.width = int(width)
        f = n_features(hidden_size)
        self.register_buffer("mean", torch.zeros(f))
        self.register_buffer("std", torch.ones(f))
        self.net = (nn.Linear(f, 1) if self.width == 0 else
                    nn.Sequential(nn.Linear(f, self.width), nn.ReLU(),
                                  nn.Linear(self.width, 1)))

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """Logits float32 [N] of features [N, F]."""
        z = (feats.float() - self.mean) / self.std
        return self.net(z)[:, 0]

    @torch.no_grad()
    def prob(self, feats: torch.Tensor) -> torch.Tensor:
        """Probabilities float32 [N] in [0, 1]."""
        return torch.sigmoid(self.forward(feats))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_head(head: DecisionHead, path: str | os.PathLike, manifest: dict) -> Path:
    """Write ``path`` (.safetensors) and its manifest (.json), each atomically.
    ``manifest`` supplies ``model``, ``label``, ``train``, ``metrics``; the format, shape
    fields and sha256 are filled in. Returns the manifest path."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()},
              str(tmp))
    os.replace(tmp, path)
    man = dict(manifest)
    man.update(format=HEAD_FORMAT, hidden_size=head.hidden_size,
               features=n_features(head.hidden_size), width=head.width,
               scalar_features=list(SCALAR_FEATURES), sha256=_sha256(path))
    mpath = path.with_suffix(".json")
    tmp = mpath.with_name(f".{mpath.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(man, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, mpath)
    return mpath


def load_head(path: str | os.PathLike, hidden_size: int | None = None
              ) -> tuple[DecisionHead, dict]:
    """Load a head and its manifest. Raises ValueError (one line, naming the file) when
    the manifest is missing or of another format, the sha256 differs, or
    ``hidden_size`` is given and differs from the head's."""
    from safetensors.torch import load_file

    path = Path(path)
    mpath = path.with_suffix(".json")
    if not path.is_file() or not mpath.is_file():
        raise ValueError(f"WISV head {path}: file or manifest {mpath.name} missing")
    man = json.loads(mpath.read_text())
    if man.get("format") != HEAD_FORMAT:
        raise ValueError(f"WISV head {path}: manifest format {man.get('format')!r}, "
                         f"expected {HEAD_FORMAT!r}")
    if man.get("sha256") != _sha256(path):
        raise ValueError(f"WISV head {path}: sha256 differs from its manifest")
    if hidden_size is not None and int(man["hidden_size"]) != int(hidden_size):
        raise ValueError(f"WISV head {path}: hidden size {man['hidden_size']} != the "
                         f"target's {hidden_size}")
    head = DecisionHead(int(man["hidden_size"]), int(man.get("width", 0)))
    head.load_state_dict(load_file(str(path)))
    head.eval()
    return head, man
