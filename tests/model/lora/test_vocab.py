"""Embedding LoRA (PEFT ``lora_embedding_A/B`` on ``embed_tokens``) and LM head LoRA (target
``lm_head``) against PEFT: logits of batches mixing base rows, plain LoRA rows and rows of
adapters on the embedding / LM head within 1e-4 in float32, untied (llama) and tied (qwen2:
an LM head LoRA on a tied model is its own delta); the expand kernel against its twin; slot
writes; typed refusals."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file

from loraplex.engine.adapters.combine import combine_adapters
from loraplex.engine.adapters.parse import load_adapter
from loraplex.engine.adapters.preflight import preflight
from loraplex.engine.adapters.staging import stage_packed
from loraplex.engine.errors import AdapterConfigError, AdapterShapeError, AdapterTargetError
from loraplex.engine.model.backend import KernelBackend
from loraplex.engine.model.config import VOCAB_LAYER, ModelConfig
from loraplex.engine.model.loader import load_model
from loraplex.engine.model.lora.ops.vocab import lora_vocab_expand, lora_vocab_expand_torch
from loraplex.engine.model.lora.slot_buffers import clear_slot, write_slot, write_slot_reference
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

pytest.importorskip("peft")

ADAPTERS = {
    "vocab": dict(r=4, alpha=8, target_modules=["q_proj", "embed_tokens", "lm_head"]),
    "embed": dict(r=6, alpha=6, target_modules=["embed_tokens", "down_proj"]),
    "head": dict(r=8, alpha=4, target_modules=["lm_head"]),
    "plain": dict(r=8, alpha=16),
}
ROWS = [("base", 5), ("vocab", 7), ("plain", 4), ("embed", 3), ("head", 6), ("base", 8),
        ("vocab", 2), ("embed", 9)]  # fmt: skip
SAME_PROMPT = {"vocab": 1, "embed": 3, "head": 4}  # row -> the base row 5 gets its prompt too


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(f"vocab-{kind}")
    model_dir = make_tiny_model(root / "base", kind=kind, seed=5, **MODEL_KINDS[kind])
    adapters = {
        name: make_peft_adapter(model_dir, root / name, seed=20 + i, **kw)
        for i, (name, kw) in enumerate(ADAPTERS.items())
    }
    return kind, model_dir, adapters


def _prompts(seed):
    g = random.Random(seed)
    return [[g.randrange(3, 250) for _ in range(n)] for _, n in ROWS]


BACKENDS = {
    "torch": {},
    "fused_twins": dict(kernel_backend=KernelBackend(fused=True, triton=False)),
    "fused_triton": dict(kernel_backend=KernelBackend(fused=True, triton=True)),
}


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_vocab_lora_matches_peft_in_a_mixed_batch(setup, backend):
    kind, model_dir, adapters = setup
    if backend == "fused_triton" and kind == "llama":
        pytest.skip("the Triton interpreter is slow: one model kind is enough")
    prompts = _prompts(4)
    names = [n for n, _ in ROWS]
    hf_steps, hf_tokens = hf_mixed_batch(model_dir, adapters, prompts, names)
    our_steps = ours(model_dir, adapters, prompts, names, hf_tokens, **BACKENDS[backend])
    for step, (a, b) in enumerate(zip(our_steps, hf_steps, strict=True)):
        for row in range(len(ROWS)):
            err = ((a[row] - b[row]).norm() / b[row].norm()).item()
            assert err < RTOL, f"{kind} {backend} step {step} row {row} ({names[row]}): {err:.2e}"
        assert a.argmax(-1).tolist() == hf_tokens[step]
    assert len(our_steps) == DECODE_STEPS + 1


def test_vocab_deltas_are_not_nothing(setup):
    """Each vocab target changes the output: an adapter row against the base on one prompt
    (guards against a path that silently adds nothing)."""
    kind, model_dir, adapters = setup
    prompt = _prompts(5)[0]
    names = ["base", *SAME_PROMPT]
    hf_steps, hf_tokens = hf_mixed_batch(model_dir, adapters, [prompt] * len(names), names)
    our_steps = ours(model_dir, adapters, [prompt] * len(names), names, hf_tokens)
    for row, name in enumerate(names[1:], start=1):
        diff = ((our_steps[0][row] - our_steps[0][0]).norm() / our_steps[0][0].norm()).item()
        assert diff > 1e-2, f"{kind}: {name} row equals the base row ({diff:.1e})"


def test_composition_with_vocab_modules_matches_peft_cat(setup):
    """``cat`` of an embedding + head adapter with an embedding one (the embedding's A stacked
    by rows, B scaled and stacked by columns) equals PEFT's ``add_weighted_adapter``."""
    kind, model_dir, adapters = setup
    use = {k: adapters[k] for k in ("vocab", "embed")}
    weights = [0.7, 0.4]
    prompts = _prompts(7)[:3]
    names = ["combo", "base", "vocab"]

    def prepare(m):
        m.add_weighted_adapter(list(use), weights, "combo", combination_type="cat")

    hf_steps, hf_tokens = hf_mixed_batch(model_dir, use, prompts, names, prepare=prepare)

    def loaded(model):
        parts = [
            (load_adapter(use[n], model.cfg, max_lora_rank=16, name=n), w)
            for n, w in zip(use, weights, strict=True)
        ]
        vocab = load_adapter(use["vocab"], model.cfg, max_lora_rank=16, name="vocab")
        return {"combo": combine_adapters(parts, name="combo", max_lora_rank=16), "vocab": vocab}

    our_steps = ours(model_dir, {}, prompts, names, hf_tokens, loaded=loaded)
    for step, (a, b) in enumerate(zip(our_steps, hf_steps, strict=True)):
        for row in range(len(names)):
            err = ((a[row] - b[row]).norm() / b[row].norm()).item()
            assert err < RTOL, f"{kind} step {step} row {row} ({names[row]}): {err:.2e}"


def test_ensure_weight_tying_matches_peft(setup, tmp_path):
    """PEFT's ``ensure_weight_tying``: on a tied base (qwen2) a LoRA on embed_tokens also wraps
    lm_head (and the other way round), saved as the partner's own LoRA, which is served; on an
    untied base (llama) nothing more is saved. Equal to PEFT in a mixed batch either way."""
    kind, model_dir, adapters = setup
    tied = {
        f"tie-{t}": make_peft_adapter(model_dir, tmp_path / t, seed=40 + i, r=4, alpha=8,
                                      target_modules=[t, "v_proj"], ensure_weight_tying=True)
        for i, t in enumerate(("embed_tokens", "lm_head"))
    }  # fmt: skip
    use = {**tied, "plain": adapters["plain"]}
    names = ["tie-embed_tokens", "base", "tie-lm_head", "plain", "tie-lm_head"]
    prompts = _prompts(8)[: len(names)]
    # NOTE: each adapter's rows as a PEFT batch of their own: PEFT (0.21) loading a second
    # adapter whose lm_head LoRA comes from ensure_weight_tying gives it none (its embedding
    # LoRA only), so a PEFT mixed batch is no oracle here; ours is still one mixed batch
    hf_steps, hf_tokens = hf_rows(model_dir, use, prompts, names)
    our_steps = ours(model_dir, use, prompts, names, hf_tokens)
    for step, (a, b) in enumerate(zip(our_steps, hf_steps, strict=True)):
        for row in range(len(names)):
            err = ((a[row] - b[row]).norm() / b[row].norm()).item()
            assert err < RTOL, f"{kind} step {step} row {row} ({names[row]}): {err:.2e}"
        assert a.argmax(-1).tolist() == hf_tokens[step]
    partner = {"tie-embed_tokens": "lm_head", "tie-lm_head": "embed_tokens"}
    for name, path in tied.items():
        keys = load_file(path / "adapter_model.safetensors")
        saved = any(f".{partner[name]}.lora_" in k for k in keys)
        assert saved == (kind == "qwen2"), (kind, name, sorted(keys))


def test_expand_kernel_matches_its_twin():
    g = torch.Generator().manual_seed(0)
    L, N, R, T = 3, 300, 8, 21
    lora_b = torch.randn(L, N, R, generator=g)
    shrink = torch.randn(T, L * R, generator=g)
    slots = torch.tensor([g.seed() % (L + 1) - 1 for _ in range(T)], dtype=torch.int32)
    slots[:16] = -1  # a whole block of base rows
    slots[16:] = torch.tensor([1, 2, 1, 0, -1], dtype=torch.int32)
    y = torch.randn(T, N, generator=g)
    for on in ([1, 1, 1], [1, 0, 1]):  # slot 1's adapter without this module: its rows skip
        on = torch.tensor(on, dtype=torch.int32)
        want = y.clone()
        for t, s in enumerate(slots.tolist()):
            if s >= 0 and on[s]:
                want[t] += shrink[t, s * R : (s + 1) * R] @ lora_b[s].T
        twin, kern = y.clone(), y.clone()
        lora_vocab_expand_torch(twin, shrink, lora_b, slots, on)
        lora_vocab_expand(kern, shrink, lora_b, slots, on, triton=True)
        torch.testing.assert_close(twin, want)
        torch.testing.assert_close(kern, want)
        base = (slots < 0) | (on[slots.clamp(min=0).long()] == 0)
        assert torch.equal(kern[base], y[base]) and torch.equal(twin[base], y[base])
        assert not torch.equal(kern[~base], y[~base])
    with pytest.raises(ValueError, match="int32"):
        lora_vocab_expand(y, shrink, lora_b, slots, on.long(), triton=False)


@pytest.mark.parametrize("scatter", ["torch", "triton"])
def test_slot_write_of_vocab_modules(setup, scatter):
    """The packed one-copy write equals the per-module reference write, vocab modules too, and
    a re-write with a plain adapter zeroes them."""
    _, model_dir, adapters = setup
    models = [
        load_model(model_dir, dtype=torch.float32, device="cpu", max_loras=3, max_lora_rank=8)
        for _ in range(2)
    ]
    vocab = load_adapter(adapters["vocab"], models[0].cfg, max_lora_rank=8)
    assert {(VOCAB_LAYER, "embed_tokens"), (VOCAB_LAYER, "lm_head")} <= set(vocab.weights)
    stage_packed(vocab, 8, pin=False)
    write_slot(models[0], 1, vocab, scatter=scatter)
    write_slot_reference(models[1], 1, vocab)
    for mod in ("embed_tokens", "lm_head"):
        got, ref = models[0].lora_vocab()[mod], models[1].lora_vocab()[mod]
        assert torch.equal(got.lora_a, ref.lora_a) and torch.equal(got.lora_b, ref.lora_b)
        assert got.lora_b[1].abs().sum() > 0 and got.lora_b[0].abs().sum() == 0
        # the slot's flag (the expand reads rows of flagged slots only), in both writes
        assert got.lora_on.tolist() == ref.lora_on.tolist() == [0, 1, 0]
    plain = load_adapter(adapters["plain"], models[0].cfg, max_lora_rank=8)
    write_slot(models[0], 1, plain, scatter=scatter)
    write_slot_reference(models[1], 1, plain)
    for mod in [*models[0].lora_vocab().values(), *models[1].lora_vocab().values()]:
        assert mod.lora_a.abs().sum() == 0 and mod.lora_b.abs().sum() == 0
        assert mod.lora_on.tolist() == [0, 0, 0]
    write_slot(models[0], 2, vocab, scatter=scatter)
    clear_slot(models[0], 2)
    assert all(m.lora_on.tolist() == [0, 0, 0] for m in models[0].lora_vocab().values())


def test_vocab_refusals(setup, tmp_path):
    _, model_dir, adapters = setup
    mc = ModelConfig.from_dir(model_dir)
    src = adapters["vocab"]
    tensors = load_file(src / "adapter_model.safetensors")
    checks = lambda d: (  # noqa: E731
        lambda: load_adapter(d, mc, max_lora_rank=16),
        lambda: preflight(d, mc, max_lora_rank=16, max_bytes=None),
    )
    # DoRA on the embedding / LM head
    dora = copy_adapter(src, tmp_path / "dora", use_dora=True)
    with pytest.raises(AdapterConfigError, match="use_dora on embed_tokens / lm_head"):
        load_adapter(dora, mc, max_lora_rank=16)
    # PEFT's copy of the base table, from a resized vocabulary
    key = next(k for k in tensors if k.endswith("embed_tokens.base_layer.weight"))
    resized = copy_adapter(src, tmp_path / "resized", tensors={**tensors, key: tensors[key][:-3]})
    for check in checks(resized):
        with pytest.raises(AdapterShapeError, match="resized vocabulary"):
            check()
    # an embedding A whose vocabulary is not the base's
    key = next(k for k in tensors if k.endswith("lora_embedding_A"))
    short = copy_adapter(src, tmp_path / "short", tensors={**tensors, key: tensors[key][:, :-1]})
    for check in checks(short):
        with pytest.raises(AdapterShapeError, match="lora_embedding_A"):
            check()
    # weights of an untargeted LM head
    head_only = {k: v for k, v in tensors.items() if "lm_head" in k or "q_proj" in k}
    untargeted = copy_adapter(
        src, tmp_path / "untargeted", tensors=head_only, target_modules=["q_proj"]
    )
    for check in checks(untargeted):
        with pytest.raises(AdapterTargetError, match="lm_head"):
            check()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_vocab_lora_mixed_batch_on_gpu(setup, dtype):
    """The fused path on CUDA in half precision, decode steps as CUDA graphs (the embedding
    and LM head deltas inside them): against PEFT in float32 on the same GPU."""
    kind, model_dir, adapters = setup
    prompts = _prompts(6)
    names = [n for n, _ in ROWS]
    run = dict(dtype=torch.float32, device="cuda")
    refs, tokens = hf_mixed_batch(model_dir, adapters, prompts, names, **run)
    # PEFT itself in the same half precision on the same tokens: the noise floor (the bf16
    # base rows of these models are ~4e-2 off in PEFT too)
    half, _ = hf_mixed_batch(
        model_dir, adapters, prompts, names, dtype=dtype, device="cuda", force=tokens
    )
    our_steps = ours(model_dir, adapters, prompts, names, tokens, dtype=dtype, device="cuda")
    for step in range(DECODE_STEPS + 1):
        for row in range(len(ROWS)):
            ref = refs[step][row]
            err, floor = rel_err(our_steps[step][row], ref), rel_err(half[step][row], ref)
            assert half_ok(err, floor), (
                f"{kind} {dtype} step {step} row {row} ({names[row]}): {err:.2e} "
                f"(PEFT in {dtype}: {floor:.2e})"
            )
            top2 = ref.topk(2).values
            if (top2[0] - top2[1]).item() > 1.0:
                assert int(our_steps[step][row].argmax()) == tokens[step][row]
