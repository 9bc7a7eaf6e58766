"""A packed serving load gives back the checkpoint pages its packing read
(edge_sdk.mapped_pages): the map's resident bytes drop to nothing, the logits and the
embedding read afterwards are the checkpoint's, and a map with a written page is kept."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from edge_sdk.mapped_pages import file_maps_of, model_tensors, release_checkpoint_pages
from edge_sdk.models import load_model
from edge_sdk.packed import SERVING_DTYPES, PackedLinear, pack_linears, packing_supported
from tests.conftest import tiny_model, tiny_tokenizer

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps"),
    pytest.mark.skipif(not packing_supported(torch.float32),
                       reason="oneDNN cannot pack float32 here")]


@pytest.fixture()
def checkpoint(tmp_path):
    """A float32 checkpoint spanning many pages: 2 layers, hidden 256, vocab 512."""
    tiny_model(vocab=512, hidden=256, layers=2, seed=7).save_pretrained(tmp_path)
    tiny_tokenizer(512).save_pretrained(tmp_path)
    return tmp_path


def _resident(model, folder) -> tuple[int, int]:
    """(maps, resident bytes) of ``folder``'s files holding ``model``'s tensors."""
    maps = [m for m in file_maps_of(model_tensors(model)) if m.path.startswith(str(folder))]
    return len(maps), sum(m.rss for m in maps)


def test_a_packed_load_gives_back_the_pages_and_keeps_the_checkpoint_bytes(checkpoint):
    x = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    ref = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    assert _resident(ref, checkpoint)[0] >= 1          # the checkpoint is a file map here
    pack_linears(ref, require_equal=False, dtypes=SERVING_DTYPES)
    n, before = _resident(ref, checkpoint)
    assert n >= 1 and before > 256 * 512 * 4          # packing read it: still resident

    model, _ = load_model(str(checkpoint), dtype="float32", packed=True)
    assert any(isinstance(m, PackedLinear) for m in model.modules())
    n, after = _resident(model, checkpoint)
    assert n >= 1 and after == 0                       # mapped still, nothing resident

    # the tensors left in the map (embedding, norms) fault back in with the file's bytes
    saved = load_file(str(checkpoint / "model.safetensors"))
    assert torch.equal(model.model.embed_tokens.weight, saved["model.embed_tokens.weight"])
    with torch.inference_mode():
        assert torch.equal(model(x).logits, ref(x).logits)
    assert _resident(model, checkpoint)[1] > 0


def test_a_map_with_a_written_page_is_left_alone(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    maps = file_maps_of(model_tensors(model))
    assert maps
    with torch.no_grad():                              # a copy-on-write page of the map
        model.model.norm.weight.fill_(2.0)
    assert release_checkpoint_pages(maps) == 0
    assert torch.equal(model.model.norm.weight, torch.full((256,), 2.0))
    assert release_checkpoint_pages([]) == 0
