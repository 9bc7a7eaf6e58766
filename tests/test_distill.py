"""Draft distillation (exporters/distill/): tiny random Llama targets, end to end."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from edge_sdk.draft_format import (EVAL_NAME, MANIFEST_NAME, VOCAB_NAME,  # noqa: E402
                                   WEIGHTS_NAME, ReducedHead, build_draft, save_draft,
                                   trainable_parameters)
from exporters.distill import draft_folder, load_draft  # noqa: E402
from exporters.distill.config import DistillConfig  # noqa: E402
from exporters.distill.evaluate import (accepted_lengths, evaluate,  # noqa: E402
                                        simulate_blocks)
from exporters.distill.pipeline import run_distill  # noqa: E402
from exporters.distill.prompts import PromptItem, split_prompts  # noqa: E402
from exporters.distill.teacher import generate_batch  # noqa: E402

VOCAB = 64


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<eos>": 0, "<unk>": 1} | {f"w{i}": i for i in range(2, VOCAB)}
    tk = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>",
                                   pad_token="<eos>")


def _target(layers=4, tied=True, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, eos_token_id=0, bos_token_id=1,
                      pad_token_id=0, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(3.0)  # sharper distributions than the default init
    return m.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-target")
    _target().save_pretrained(d)
    _tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def prompts_and_corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-data")
    g = torch.Generator().manual_seed(1)
    lines = []
    for i in range(12):
        words = torch.randint(2, VOCAB, (int(torch.randint(3, 9, (1,), generator=g)),),
                              generator=g)
        lines.append(json.dumps({"id": i, "text": " ".join(f"w{int(w)}" for w in words),
                                 "kind": "completion" if i % 2 else "chat"}))
    pf = d / "prompts.jsonl"
    pf.write_text("\n".join(lines) + "\n")
    corpus = d / "corpus"
    corpus.mkdir()
    for i in range(6):
        words = torch.randint(2, VOCAB, (800,), generator=g)
        (corpus / f"doc{i}.txt").write_text(" ".join(f"w{int(w)}" for w in words))
    return pf, corpus


def _cfg(target_dir, pc, tmp_path, **kw):
    pf, corpus = pc
    base = dict(target=str(target_dir), out=str(tmp_path / "draft"),
                work_dir=str(tmp_path / "work"), layers=[0, 3], builtin_prompts=False,
                prompts_files=[str(pf)], heldout_frac=0.25, heldout_min=1,
                max_new_tokens=12, gen_batch=4, samples_per_prompt=1, corpus_tokens=256,
                corpus_dirs=[str(corpus)], chunk_tokens=32, topk=16, epochs=4,
                batch_tokens=256, lr=3e-3, warmup=2, ckpt_every=5, eval_max_new_tokens=12,
                save_dtype="float32", progress=False, train_dtype="float32",
                data_dtype="float32")
    base.update(kw)
    return DistillConfig(**base)


def test_distill_end_to_end_lowers_kl_and_round_trips(target_dir, prompts_and_corpus,
                                                      tmp_path):
    cfg = _cfg(target_dir, prompts_and_corpus, tmp_path)
    res = run_distill(cfg)
    tr = res["train"]
    assert tr["steps"] >= 5
    assert tr["probe_after"]["kl"] < 0.8 * tr["probe_before"]["kl"]
    ev = res["heldout"]
    assert ev["tokens"] > 0 and 1.0 <= ev["mean_accepted_length"] <= cfg.eval_depth + 1
    assert 0.0 <= ev["agreement"] <= 1.0
    assert res["speed"]["draft_ms_per_token"] > 0
    out = tmp_path / "draft"
    man = json.loads((out / MANIFEST_NAME).read_text())
    assert man["target"] == str(target_dir) and man["init_layers"] == [0, 3]
    assert json.loads((out / EVAL_NAME).read_text())["heldout"] == ev

    # Round trip: the loaded draft gives identical logits to a draft rebuilt from the
    # trained tensors kept in the last checkpoint.
    draft, tok = load_draft(out)
    ck = torch.load(next((tmp_path / "work").glob("train-*/ckpt.pt")), weights_only=False)
    from edge_sdk.models import load_model

    tgt, _ = load_model(str(target_dir))
    ref = build_draft(tgt, [0, 1])
    ref.load_state_dict(ck["model"], strict=False)
    x = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(draft(input_ids=x).logits, ref(input_ids=x).logits)
    assert tok.get_vocab() == _tokenizer().get_vocab()


def test_resume_skips_finished_stages(target_dir, prompts_and_corpus, tmp_path):
    cfg = _cfg(target_dir, prompts_and_corpus, tmp_path, max_steps=6, eval=False)
    run_distill(cfg)
    work = tmp_path / "work"
    shards = sorted(p.name for p in work.glob("data-*/*.pt"))
    mtimes = {p: p.stat().st_mtime_ns for p in work.glob("data-*/*.pt")}
    first = (tmp_path / "draft" / WEIGHTS_NAME).read_bytes()
    run_distill(cfg)  # everything cached: same data, same weights
    assert sorted(p.name for p in work.glob("data-*/*.pt")) == shards
    assert all(p.stat().st_mtime_ns == t for p, t in mtimes.items())
    assert (tmp_path / "draft" / WEIGHTS_NAME).read_bytes() == first
    # Same seed in a fresh work dir: identical result (deterministic).
    cfg2 = _cfg(target_dir, prompts_and_corpus, tmp_path, max_steps=6, eval=False,
                work_dir=str(tmp_path / "work2"), out=str(tmp_path / "draft2"))
    run_distill(cfg2)
    assert (tmp_path / "draft2" / WEIGHTS_NAME).read_bytes() == first


def test_stored_folder_holds_only_trained_parts(tmp_path):
    from safetensors.torch import load_file

    tgt = _target()
    d = build_draft(tgt, [1, 2], kept_ids=torch.tensor([0, 5, 7, 9]))
    save_draft(d, tmp_path / "f", "dummy-target", [1, 2], "float16", target=tgt)
    st = load_file(str(tmp_path / "f" / WEIGHTS_NAME))
    assert st and all(k.startswith(("model.layers.", "model.norm.")) for k in st)
    assert not any("embed" in k or "lm_head" in k for k in st)
    assert all(v.dtype == torch.float16 for v in st.values())
    assert {k.split(".")[2] for k in st if k.startswith("model.layers.")} == {"0", "1"}
    assert load_file(str(tmp_path / "f" / VOCAB_NAME))["kept_ids"].tolist() == [0, 5, 7, 9]
    cfg = json.loads((tmp_path / "f" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["vocab_size"] == VOCAB
    # A plain transformers load works (the shared parts come back randomly initialised;
    # load_draft is what restores them).
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tmp_path / "f")
    assert len(m.model.layers) == 2


def test_reduced_head_is_a_distribution_over_full_vocab():
    tgt = _target()
    kept = torch.tensor([0, 3, 4, 10, 33, 63])
    d = build_draft(tgt, [0, 1], kept_ids=kept)
    x = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = d(input_ids=x).logits[0]  # [7, V]
    assert logits.shape == (7, VOCAB)
    q = torch.softmax(logits.double(), dim=-1)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[kept] = False
    assert torch.all(q[:, outside] == 0)
    assert torch.allclose(q.sum(-1), torch.ones(7, dtype=torch.float64), atol=1e-12)
    assert torch.all(q[:, kept] > 0)
    # kept logits equal the full head's logits on those ids
    full = build_draft(tgt, [0, 1])
    with torch.no_grad():
        ref = full(input_ids=x).logits[0]
    assert torch.allclose(logits[:, kept], ref[:, kept], atol=1e-5)


def test_shared_parts_are_the_targets_and_frozen():
    tgt = _target(tied=False)
    d = build_draft(tgt, [2])
    assert d.model.embed_tokens.weight is tgt.model.embed_tokens.weight
    assert d.lm_head.weight is tgt.lm_head.weight
    names = {n for n, p in d.named_parameters() if p in set(trainable_parameters(d))}
    assert names and all(n.startswith(("model.layers.", "model.norm.")) for n in names)
    # the layer is a copy of target layer 2, not shared
    assert d.model.layers[0].mlp.up_proj.weight is not tgt.model.layers[2].mlp.up_proj.weight
    assert torch.equal(d.model.layers[0].mlp.up_proj.weight, tgt.model.layers[2].mlp.up_proj.weight)


def test_torch_drafter_runs_on_loaded_reduced_draft(tmp_path, target_dir):
    from edge_sdk.drafters.torch import TorchDrafter
    from edge_sdk.models import load_model
    from edge_sdk.protocol.sampling import SamplingConfig

    tgt, _ = load_model(str(target_dir))
    kept = torch.arange(0, VOCAB, 2)
    save_draft(build_draft(tgt, [0, 1], kept), tmp_path / "rd", str(target_dir), [0, 1],
                 "float32", target=tgt)
    draft, _ = load_model(str(tmp_path / "rd"))  # edge_sdk.models delegates to load_draft
    assert isinstance(draft.lm_head, ReducedHead)
    dr = TorchDrafter(draft)
    blk = dr.propose([1, 5, 9, 2], 4, SamplingConfig(temperature=0.0))
    assert len(blk.tokens) == 4 and all(t % 2 == 0 for t in blk.tokens)
    blk = dr.propose([1, 5, 9, 2, 7], 3, SamplingConfig(temperature=1.0),
                     torch.Generator().manual_seed(0))
    assert all(t % 2 == 0 for t in blk.tokens)
    assert torch.all(blk.q[:, 1::2] == 0)
    assert torch.allclose(blk.q.sum(-1), torch.ones(3, dtype=blk.q.dtype), atol=1e-6)


def test_load_draft_refuses_other_target(tmp_path, target_dir):
    tgt = _target(seed=5)
    save_draft(build_draft(tgt, [0]), tmp_path / "x", str(target_dir), [0], "float32",
                 target=tgt)
    with pytest.raises(ValueError, match="different embedding"):
        load_draft(tmp_path / "x")


def test_block_simulation():
    assert accepted_lengths([True] * 10, 4) == [5, 5]
    assert simulate_blocks([False, True, True, False, True], 4) == [(0, 1), (2, 3), (1, 1)]
    assert accepted_lengths([], 4) == []


def test_split_is_by_prompt_and_deterministic():
    items = [PromptItem(f"s/{i}", "s", "chat", f"t{i}") for i in range(20)] + \
            [PromptItem(f"c/{i}", "c", "completion", f"c{i}") for i in range(10)]
    tr, he = split_prompts(items, 0.2, 3, seed=7)
    tr2, he2 = split_prompts(items, 0.2, 3, seed=7)
    assert [p.id for p in he] == [p.id for p in he2]
    assert not {p.id for p in tr} & {p.id for p in he}
    assert len(tr) + len(he) == 30
    assert sum(p.source == "s" for p in he) == 4 and sum(p.source == "c" for p in he) == 3


@pytest.mark.real_model
def test_committed_default_draft_beats_truncated_baseline():
    """The committed demo draft agrees with the real target more than the untrained
    4-layer truncation on two short prompts (greedy, float32)."""
    from edge_sdk.models import encode_prompt, load_model

    from edge_sdk.models import draft_available

    if not draft_available("smollm2-135m-draft"):
        pytest.skip("default draft not committed")
    folder = draft_folder("smollm2-135m-draft")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    tgt, tok = load_model("smollm2-135m")
    draft, _ = load_draft("smollm2-135m-draft", target=(tgt, tok))
    trunc = build_draft(tgt, [0, 1, 2, 3])
    prompts = [("How do I make a good cup of coffee?", True),
               ("def is_prime(n: int) -> bool:\n    \"\"\"Return True if n is prime.\"\"\"\n",
                False)]
    paths = []
    for text, chat in prompts:
        ids = encode_prompt(tok, text, chat)
        r = generate_batch(tgt, [ids], 40, [tok.eos_token_id], 0)[0]
        paths.append({"id": text, "domain": "chat" if chat else "code", "ids": r["ids"],
                      "prompt_len": r["prompt_len"]})
    ours = evaluate(draft, paths, 4)
    base = evaluate(trunc, paths, 4)
    assert ours["agreement"] > base["agreement"] + 0.1, (ours, base)
    assert ours["mean_accepted_length"] > base["mean_accepted_length"]


def test_truncate_layers_leaves_the_original_intact():
    from edge_sdk.models import truncate_layers
    from tests.conftest import tiny_model

    m = tiny_model(layers=4)
    x = torch.tensor([[1, 2, 3]])
    before = m(x).logits
    small = truncate_layers(m, 2)
    assert len(small.model.layers) == 2 and len(m.model.layers) == 4
    assert torch.equal(m(x).logits, before)
    assert not torch.equal(small(x).logits, before)
