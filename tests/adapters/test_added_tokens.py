"""Adapters that added tokens (full embed_tokens / lm_head tables of V + k rows, served with
``lora_extra_vocab_size`` E >= k, adapters/added_tokens.py) against PEFT on a resized base: logits
of a mixed batch (base rows, a plain LoRA, full tables without added tokens, the adapter's rows
with added ids in their prompts) within 1e-4 in float32, V + E wide with -inf where a row's
tokenizer has no id; the widened head through its Triton kernel; typed refusals."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from loraplex.engine.adapters.added_tokens import check_adapter_vocab
from loraplex.engine.adapters.parse import load_adapter
from loraplex.engine.adapters.preflight import preflight
from loraplex.engine.errors import AdapterConfigError, AdapterShapeError, AdapterTargetError
from loraplex.engine.model.backend import KernelBackend
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.lora.full import FullModules
from tests.helpers.adapters import boost_added_rows, resized_base
from tests.helpers.models import copy_adapter, make_peft_adapter, make_tiny_model
from tests.helpers.peft_oracle import (
    DECODE_STEPS,
    MODEL_KINDS,
    RTOL,
    half_ok,
    hf_mixed_batch,
    hf_rows,
    ours,
    rel_err,
)
from tests.helpers.tokenizers import make_tokenizer, swap_token_ids

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

V, ADDED, EXTRA = 256, ("<sql>", "</sql>", "<tbl>"), 4
ADAPTERS = {
    "plain": dict(r=8, alpha=16),
    "both": dict(r=4, alpha=4, target_modules=["o_proj"], modules_to_save=["embed_tokens", "lm_head"]),
    "added": dict(r=4, alpha=8, target_modules=["q_proj", "down_proj"],
                  modules_to_save=["embed_tokens", "lm_head"], added_tokens=ADDED),
}  # fmt: skip
ROWS = [("base", 5), ("added", 7), ("plain", 4), ("added", 3), ("both", 6), ("base", 8)]


@pytest.fixture(scope="module", params=["llama"])
def setup(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(f"added-{kind}")
    model_dir = make_tiny_model(root / "base", kind=kind, seed=9, **MODEL_KINDS[kind])
    make_tokenizer(model_dir, V)
    adapters = {
        name: make_peft_adapter(model_dir, root / name, seed=70 + i, **kw)
        for i, (name, kw) in enumerate(ADAPTERS.items())
    }
    boost_added_rows(adapters["added"])
    # PEFT's oracle for the adapter: the base resized to its tokenizer, as its user had it
    return kind, model_dir, adapters, resized_base(model_dir, root / "resized", V + len(ADDED))


def _mc(model_dir, extra=EXTRA):
    return replace(ModelConfig.from_dir(model_dir), lora_extra_vocab_size=extra)


def _prompts(seed):
    g = random.Random(seed)
    out = []
    for name, n in ROWS:
        p = [g.randrange(3, V) for _ in range(n)]
        if name == "added":  # the added ids, embedded from the adapter's table
            p[0], p[-1] = V + 2, V
        out.append(p)
    return out


def test_what_peft_saves_when_tokens_are_added(setup):
    """PEFT saves both tables with V + k rows (and, resized, copies of them: the adapter's
    again and the resized base's), the tokenizer with its k tokens at ids V..V+k-1."""
    _, model_dir, adapters, _ = setup
    folder = adapters["added"]
    t = load_file(folder / "adapter_model.safetensors")
    for key in ("base_model.model.model.embed_tokens", "base_model.model.lm_head"):
        assert t[f"{key}.weight"].shape == (V + len(ADDED), 64)
        assert torch.equal(t[f"{key}.weight"], t[f"{key}.modules_to_save.weight"])
    config = json.loads((folder / "adapter_config.json").read_text())
    assert sorted(config["modules_to_save"]) == ["embed_tokens", "lm_head"]
    tok = json.loads((folder / "tokenizer.json").read_text())
    assert [a["id"] for a in tok["added_tokens"] if a["content"] in ADDED] == [V, V + 1, V + 2]
    report = preflight(folder, _mc(model_dir), max_lora_rank=16, max_bytes=None, full_modules=True)
    assert report.vocab_rows == V + len(ADDED)
    a = load_adapter(folder, _mc(model_dir), max_lora_rank=16, full_modules=True)
    assert torch.equal(a.full["lm_head"], t["base_model.model.lm_head.weight"])


BACKENDS = {
    "torch": {},
    "fused_twins": dict(kernel_backend=KernelBackend(fused=True, triton=False)),
    "fused_triton": dict(kernel_backend=KernelBackend(fused=True, triton=True)),
}


def _reference(model_dir, adapters, resized, prompts, names, force=None, **kw):
    """PEFT's logits per step and tokens: the adapter's rows on the resized base with it
    active (V + k wide), the others as in tests/model/lora/test_full.py (V wide). ``force``: decode these
    tokens (per step, per row); ``kw``: dtype / device of the PEFT models."""
    other = [i for i, n in enumerate(names) if n != "added"]
    mine = [i for i, n in enumerate(names) if n == "added"]

    def part(rows):
        return None if force is None else [[f[i] for i in rows] for f in force]

    s1, t1 = hf_rows(
        model_dir, adapters, [prompts[i] for i in other], [names[i] for i in other],
        force=part(other), **kw,
    )  # fmt: skip
    s2, t2 = hf_mixed_batch(
        resized, {"added": adapters["added"]}, [prompts[i] for i in mine], ["added"] * len(mine),
        active="added", force=part(mine), **kw,
    )  # fmt: skip
    steps, tokens = [], []
    for a, ta, b, tb in zip(s1, t1, s2, t2, strict=True):
        rows, toks = [None] * len(names), [0] * len(names)
        for j, i in enumerate(other):
            rows[i], toks[i] = a[j], ta[j]
        for j, i in enumerate(mine):
            rows[i], toks[i] = b[j], tb[j]
        steps.append(rows)
        tokens.append(toks)
    return steps, tokens


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_added_tokens_match_peft_in_a_mixed_batch(setup, backend):
    kind, model_dir, adapters, resized = setup
    prompts = _prompts(4)
    names = [n for n, _ in ROWS]
    hf_steps, hf_tokens = _reference(model_dir, adapters, resized, prompts, names)
    assert any(
        t >= V for step in hf_tokens for t, n in zip(step, names, strict=True) if n == "added"
    )
    our = ours(
        model_dir, adapters, prompts, names, hf_tokens, max_full=3, extra=EXTRA,
        **BACKENDS[backend],
    )  # fmt: skip
    assert len(our) == DECODE_STEPS + 1
    for step, (a, b) in enumerate(zip(our, hf_steps, strict=True)):
        assert a.shape == (len(ROWS), V + EXTRA)
        for row, name in enumerate(names):
            width = V + len(ADDED) if name == "added" else V
            ref = b[row][:width]  # (PEFT's base rows on the resized model are not ours)
            err = ((a[row][:width] - ref).norm() / ref.norm()).item()
            assert err < RTOL, f"{kind} {backend} step {step} row {row} ({name}): {err:.2e}"
            assert torch.isneginf(a[row][width:]).all(), (step, row, name)
            assert int(a[row].argmax()) == hf_tokens[step][row]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_added_tokens_mixed_batch_on_gpu(setup, dtype):
    """The fused path on CUDA in half precision, decode steps as CUDA graphs (the widened head
    and the -inf past each row's vocabulary inside them): against PEFT in float32, within the
    error PEFT itself makes in that precision on the same row."""
    kind, model_dir, adapters, resized = setup
    prompts = _prompts(6)
    names = [n for n, _ in ROWS]
    refs, tokens = _reference(model_dir, adapters, resized, prompts, names, device="cuda")
    half, _ = _reference(
        model_dir, adapters, resized, prompts, names, force=tokens, dtype=dtype, device="cuda"
    )
    our = ours(
        model_dir, adapters, prompts, names, tokens, dtype=dtype, device="cuda", max_full=3,
        extra=EXTRA,
    )  # fmt: skip
    for step in range(DECODE_STEPS + 1):
        for row, name in enumerate(names):
            width = V + len(ADDED) if name == "added" else V
            ref = refs[step][row][:width].float().cpu()
            got = our[step][row].float().cpu()
            err = rel_err(got[:width], ref)
            floor = rel_err(half[step][row][:width].float().cpu(), ref)
            assert half_ok(err, floor), (
                f"{kind} {dtype} step {step} row {row} ({name}): {err:.2e} "
                f"(PEFT in {dtype}: {floor:.2e})"
            )
            assert torch.isneginf(got[width:]).all(), (step, row, name)


def test_widened_head_kernel_matches_its_twin():
    """``widen_logits`` on the Triton head kernel and on its twin: full rows written whole
    (V + E), -inf past each row's vocabulary; the base rows padded and masked."""
    g = torch.Generator().manual_seed(1)
    F, vocab, extra, H, T = 3, 70, 9, 24, 21
    fm = FullModules(F, vocab, H, dtype=torch.float32, device="cpu", extra=extra)
    tabs = {
        0: {"embed_tokens": torch.randn(vocab + 5, H, generator=g),
            "lm_head": torch.randn(vocab + 5, H, generator=g)},
        2: {"lm_head": torch.randn(vocab, H, generator=g)},
    }  # fmt: skip
    for f, t in tabs.items():
        fm.write(f, t)
    assert fm.limit.tolist() == [vocab + 5, vocab, vocab]
    assert torch.equal(fm.head[0, vocab + 5 :], torch.zeros(extra - 5, H))
    h = torch.randn(T, H, generator=g)
    slots = torch.randint(-1, F, (T,), generator=g, dtype=torch.int32)
    slots[:3] = torch.tensor([0, 1, 2], dtype=torch.int32)
    base = torch.randn(T, vocab, generator=g)
    want = torch.cat([base, torch.full((T, extra), float("-inf"))], 1)
    for t, s in enumerate(slots.tolist()):
        if s in tabs:
            lim = tabs[s]["lm_head"].shape[0]
            want[t] = float("-inf")
            want[t, :lim] = h[t] @ tabs[s]["lm_head"].T
    for triton in (False, True):
        got = fm.widen_logits(base.clone(), h, slots, triton=triton)
        torch.testing.assert_close(got, want)
    ids = torch.tensor([1, vocab + 4, vocab - 1])
    assert fm.base_ids(ids).tolist() == [1, vocab - 1, vocab - 1]
    fm.write(0, {})  # a plain adapter over it: the base's vocabulary again
    assert fm.limit.tolist() == [vocab, vocab, vocab]


def test_refusals(setup, tmp_path):
    _, model_dir, adapters, _ = setup
    src = adapters["added"]
    tensors = load_file(src / "adapter_model.safetensors")

    def checks(d, mc):
        return (
            lambda: load_adapter(d, mc, max_lora_rank=16, full_modules=True),
            lambda: preflight(d, mc, max_lora_rank=16, max_bytes=None, full_modules=True),
        )

    # E = 0: refused as before (the served vocabulary is the base's): PEFT's copies of the
    # resized tables are no module of the base; without them, the rows are named
    mc0 = ModelConfig.from_dir(model_dir)
    for check in checks(src, mc0):
        with pytest.raises(AdapterTargetError, match="modules_to_save"):
            check()
    plain = {
        k: v for k, v in tensors.items() if "modules_to_save." not in k and "original" not in k
    }
    for check in checks(copy_adapter(src, tmp_path / "plain", tensors=plain), mc0):
        with pytest.raises(AdapterShapeError, match=f"{V + 3} vocabulary rows.*the base has {V}"):
            check()
    # k > E
    for check in checks(src, _mc(model_dir, extra=2)):
        with pytest.raises(AdapterShapeError, match=f"{V + 3} vocabulary rows.*allows {V + 2}"):
            check()
    # added tokens with only one table
    head = "base_model.model.lm_head"
    one = {k: v for k, v in tensors.items() if not k.startswith(head)}
    lone = copy_adapter(src, tmp_path / "lone", tensors=one, modules_to_save=["embed_tokens"])
    for check in checks(lone, _mc(model_dir)):
        with pytest.raises(AdapterConfigError, match="needs full embed_tokens and lm_head"):
            check()
    # tables of two sizes
    short = {**tensors, f"{head}.weight": tensors[f"{head}.weight"][: V + 1]}
    for check in checks(copy_adapter(src, tmp_path / "short", tensors=short), _mc(model_dir)):
        with pytest.raises(AdapterShapeError, match="one vocabulary"):
            check()


def test_tokenizer_checks(setup, tmp_path):
    """The adapter's tokenizer.json: present, V + k ids, the base's ids below V."""
    from tokenizers import Tokenizer

    _, model_dir, adapters, _ = setup
    src = adapters["added"]
    base = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    check_adapter_vocab(src, base, V, V + 3)  # fits
    with pytest.raises(AdapterShapeError, match=f"has {V + 3} tokens.*{V + 4} rows"):
        check_adapter_vocab(src, base, V, V + 4)
    with pytest.raises(AdapterConfigError, match="no tokenizer to check"):
        check_adapter_vocab(src, None, V, V + 3)
    bare = copy_adapter(src, tmp_path / "bare")  # the adapter's files only
    with pytest.raises(AdapterConfigError, match="has no tokenizer.json"):
        check_adapter_vocab(bare, base, V, V + 3)
    # the base's tokens at ids 40 and 41 swapped: not an extension of the base tokenizer
    other = copy_adapter(src, tmp_path / "other")
    a, b = swap_token_ids(src, other)
    with pytest.raises(AdapterConfigError, match=f"id 40 is {b!r} in the adapter's, {a!r}"):
        check_adapter_vocab(other, base, V, V + 3)
