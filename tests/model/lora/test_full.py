"""Full-table adapters (PEFT ``modules_to_save`` on ``embed_tokens`` / ``lm_head``, model/lora/full.py)
against PEFT: logits of batches mixing base rows, plain LoRA rows and rows of adapters with a
full embedding, a full LM head or both within 1e-4 in float32, untied (llama) and tied (qwen2:
each table replaces only its own module, as in PEFT); the head kernel against its twin; slot
writes; typed refusals (no full-table slots, a vocabulary that is not the base's, ...)."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from loraplex.engine.adapters.combine import combine_adapters
from loraplex.engine.adapters.parse import load_adapter, load_full_tables
from loraplex.engine.adapters.preflight import preflight
from loraplex.engine.adapters.registry import AdapterRegistry, AdapterState
from loraplex.engine.adapters.slot_store import SlotStore
from loraplex.engine.adapters.staging import stage_packed
from loraplex.engine.errors import (
    AdapterConfigError,
    AdapterFormatError,
    AdapterShapeError,
    AdapterTargetError,
)
from loraplex.engine.model.backend import KernelBackend
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.loader import load_model
from loraplex.engine.model.lora.full import attach_full_modules
from loraplex.engine.model.lora.ops.full_head import full_head, full_head_torch
from loraplex.engine.model.lora.slot_buffers import clear_slot, write_slot, write_slot_reference
from tests.helpers.models import copy_adapter, make_peft_adapter, make_tiny_model
from tests.helpers.peft_oracle import (
    DECODE_STEPS,
    MODEL_KINDS,
    RTOL,
    half_ok,
    hf_rows,
    ours,
    rel_err,
)
from tests.helpers.slots import FakeWriter, land

pytest.importorskip("peft")

# NOTE: ``ours`` takes slots in reverse order: "both" -> 0, "head" -> 1, "embed" -> 2 (the
# full-table slots, FULL = 3), "plain" -> 3
ADAPTERS = {
    "plain": dict(r=8, alpha=16),
    # a full embedding next to LoRA on the LM head and a projection
    "embed": dict(r=4, alpha=8, target_modules=["q_proj", "lm_head"],
                  modules_to_save=["embed_tokens"]),
    "head": dict(r=6, alpha=6, target_modules=["v_proj", "down_proj"], modules_to_save=["lm_head"]),
    "both": dict(r=4, alpha=4, target_modules=["o_proj"], modules_to_save=["embed_tokens", "lm_head"]),
}  # fmt: skip
FULL = 3
ROWS = [("base", 5), ("both", 7), ("plain", 4), ("embed", 3), ("head", 6), ("base", 8),
        ("both", 2), ("head", 9)]  # fmt: skip


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(f"full-{kind}")
    model_dir = make_tiny_model(root / "base", kind=kind, seed=6, **MODEL_KINDS[kind])
    adapters = {
        name: make_peft_adapter(model_dir, root / name, seed=60 + i, **kw)
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


def test_peft_saves_full_tables_as_plain_weights(setup):
    """What this parser reads: PEFT 0.21 drops ``modules_to_save.<adapter>`` from the keys."""
    _, _, adapters = setup
    keys = set(load_file(adapters["both"] / "adapter_model.safetensors"))
    assert {"base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"} <= keys
    config = json.loads((adapters["both"] / "adapter_config.json").read_text())
    assert sorted(config["modules_to_save"]) == ["embed_tokens", "lm_head"]


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_full_tables_match_peft_in_a_mixed_batch(setup, backend):
    kind, model_dir, adapters = setup
    if backend == "fused_triton" and kind == "llama":
        pytest.skip("the Triton interpreter is slow: one model kind is enough")
    prompts = _prompts(4)
    names = [n for n, _ in ROWS]
    hf_steps, hf_tokens = hf_rows(model_dir, adapters, prompts, names)
    our_steps = ours(
        model_dir, adapters, prompts, names, hf_tokens, max_full=FULL, **BACKENDS[backend]
    )
    for step, (a, b) in enumerate(zip(our_steps, hf_steps, strict=True)):
        for row in range(len(ROWS)):
            err = rel_err(a[row], b[row])
            assert err < RTOL, f"{kind} {backend} step {step} row {row} ({names[row]}): {err:.2e}"
        assert a.argmax(-1).tolist() == hf_tokens[step]
    assert len(our_steps) == DECODE_STEPS + 1


def test_full_tables_are_not_nothing(setup):
    """A full table changes the output beyond the adapter's LoRA: the same adapter with its
    tables dropped gives other logits (guards against a path that silently reads the base)."""
    kind, model_dir, adapters = setup
    prompt = _prompts(5)[0]
    names = ["embed", "head"]
    hf_steps, hf_tokens = hf_rows(model_dir, adapters, [prompt] * 2, names)

    def without_tables(model):
        out = {}
        for n in names:
            a = load_adapter(adapters[n], model.cfg, max_lora_rank=16, name=n, full_modules=True)
            a.full = {}
            out[n] = a
        return out

    stripped = ours(
        model_dir, {}, [prompt] * 2, names, hf_tokens, loaded=without_tables, max_full=FULL
    )
    for row, name in enumerate(names):
        diff = rel_err(stripped[0][row], hf_steps[0][row])
        assert diff > 1e-2, f"{kind}: {name}'s table changes nothing ({diff:.1e})"


def test_head_kernel_matches_its_twin():
    g = torch.Generator().manual_seed(0)
    F, V, H, T = 3, 300, 40, 37
    table = torch.randn(F, V, H, generator=g)
    on = torch.tensor([1, 0, 1], dtype=torch.int32)
    h = torch.randn(T, H, generator=g)
    slots = torch.randint(-1, F + 2, (T,), generator=g, dtype=torch.int32)
    slots[:16] = -1  # a whole block of base rows
    slots[17], slots[20] = 0, 1  # a full slot, a slot without a table
    y = torch.randn(T, V, generator=g)
    want = y.clone()
    for t, s in enumerate(slots.tolist()):
        if 0 <= s < F and on[s]:
            want[t] = h[t] @ table[s].T
    twin, kern = y.clone(), y.clone()
    full_head_torch(twin, h, table, on, slots)
    full_head(kern, h, table, on, slots, triton=True)
    torch.testing.assert_close(twin, want)
    torch.testing.assert_close(kern, want)
    keep = ~((slots >= 0) & (slots < F) & (on[slots.clamp(0, F - 1).long()] != 0))
    assert torch.equal(kern[keep], y[keep])  # other rows untouched


@pytest.mark.parametrize("scatter", ["torch", "triton"])
def test_slot_write_of_full_tables(setup, scatter):
    """The one-copy write and the reference write set a slot's tables and flags; a plain
    adapter written over it (or a clear) drops them; a slot past the full ones refuses."""
    _, model_dir, adapters = setup
    models = [
        load_model(model_dir, dtype=torch.float32, device="cpu", max_loras=3, max_lora_rank=8)
        for _ in range(2)
    ]
    for m in models:
        attach_full_modules(m, 2)
    both = load_adapter(adapters["both"], models[0].cfg, max_lora_rank=8, full_modules=True)
    assert set(both.full) == {"embed_tokens", "lm_head"}
    stage_packed(both, 8, pin=False)
    write_slot(models[0], 1, both, scatter=scatter)
    write_slot_reference(models[1], 1, both)
    for m in models:
        fm = m.full_modules
        assert fm.on.tolist() == [[0, 1], [0, 1]] and fm.held == ({1}, {1})
        assert torch.equal(fm.embed[1], both.full["embed_tokens"])
        assert torch.equal(fm.head[1], both.full["lm_head"])
    head = load_adapter(adapters["head"], models[0].cfg, max_lora_rank=8, full_modules=True)
    write_slot(models[0], 0, head, scatter=scatter)
    assert models[0].full_modules.on.tolist() == [[0, 1], [1, 1]]
    plain = load_adapter(adapters["plain"], models[0].cfg, max_lora_rank=8)
    write_slot(models[0], 1, plain, scatter=scatter)
    assert models[0].full_modules.on.tolist() == [[0, 0], [1, 0]]
    clear_slot(models[0], 0)
    assert models[0].full_modules.on.abs().sum() == 0 and models[0].full_modules.held == (
        set(),
        set(),
    )
    with pytest.raises(ValueError, match="no full-table storage"):
        write_slot(models[0], 2, both, scatter=scatter)


def test_full_tables_refusals(setup, tmp_path):
    _, model_dir, adapters = setup
    mc = ModelConfig.from_dir(model_dir)
    src = adapters["both"]
    tensors = load_file(src / "adapter_model.safetensors")

    def checks(d, full=True):
        return (
            lambda: load_adapter(d, mc, max_lora_rank=16, full_modules=full),
            lambda: preflight(d, mc, max_lora_rank=16, max_bytes=None, full_modules=full),
        )

    # no full-table slots (max_full_module_loras 0): refused as before this form was served
    for check in checks(src, full=False):
        with pytest.raises(AdapterConfigError, match="modules_to_save") as e:
            check()
        assert e.value.field == "modules_to_save"
    # a table of another vocabulary (an adapter that added tokens): both sizes named
    key = "base_model.model.lm_head.weight"
    grown = torch.cat([tensors[key], tensors[key][:3]])
    resized = copy_adapter(src, tmp_path / "resized", tensors={**tensors, key: grown})
    for check in checks(resized):
        with pytest.raises(AdapterShapeError, match=f"{mc.vocab_size + 3} vocabulary rows.*"
                           f"the base has {mc.vocab_size}"):  # fmt: skip
            check()
    wide = {**tensors, key: tensors[key][:, :-1]}
    for check in checks(copy_adapter(src, tmp_path / "wide", tensors=wide)):
        with pytest.raises(AdapterShapeError, match="lm_head"):
            check()
    # listed in modules_to_save, missing from the file
    missing = {k: v for k, v in tensors.items() if k != key}
    for check in checks(copy_adapter(src, tmp_path / "missing", tensors=missing)):
        with pytest.raises(AdapterFormatError, match="modules_to_save"):
            check()
    # a table the config does not list
    unlisted = copy_adapter(src, tmp_path / "unlisted", modules_to_save=["embed_tokens"])
    for check in checks(unlisted):
        with pytest.raises(AdapterTargetError, match="lm_head"):
            check()
    # a module other than the embedding / LM head
    other = copy_adapter(src, tmp_path / "other", modules_to_save=["norm"])
    for check in checks(other):
        with pytest.raises(AdapterConfigError, match="modules_to_save"):
            check()
    # PEFT's weight tying of a table to its tied twin
    tying = copy_adapter(src, tmp_path / "tying", ensure_weight_tying=True)
    for check in checks(tying):
        with pytest.raises(AdapterConfigError, match="ensure_weight_tying"):
            check()
    # a LoRA and a full table on one module
    twice = copy_adapter(src, tmp_path / "twice", target_modules=["o_proj", "lm_head"])
    for check in checks(twice):
        with pytest.raises(AdapterConfigError, match="lm_head is both"):
            check()
    # no composition with full tables
    a = load_adapter(src, mc, max_lora_rank=16, full_modules=True)
    b = load_adapter(adapters["plain"], mc, max_lora_rank=16)
    with pytest.raises(AdapterConfigError, match="modules_to_save"):
        combine_adapters([(a, 0.5), (b, 0.5)], name="c", max_lora_rank=16)


def test_header_only_load_then_tables(setup):
    """A loader process packs the LoRA weights only (``read_full=False``); the engine reads
    the tables after (``load_full_tables``): the same tensors as one full load."""
    _, model_dir, adapters = setup
    mc = ModelConfig.from_dir(model_dir)
    lean = load_adapter(adapters["both"], mc, max_lora_rank=16, full_modules=True, read_full=False)
    whole = load_adapter(adapters["both"], mc, max_lora_rank=16, full_modules=True)
    assert lean.full == {} and set(whole.full) == {"embed_tokens", "lm_head"}
    tables = load_full_tables(adapters["both"], mc, torch.float32)
    for m, t in whole.full.items():
        assert torch.equal(tables[m], t)
    assert whole.nbytes == lean.nbytes + sum(t.nbytes for t in tables.values())


def _version(m: AdapterRegistry, name: str, full: bool):
    v = m.new_version(name, f"file:///{name}")
    v.digest, v.state, v.full = name, AdapterState.CPU, full
    v.adapter = SimpleNamespace(rank=4, nbytes=1, dora=None, image=None, full={})
    return m.register(v)


def test_manager_gives_full_adapters_only_full_slots():
    slots = SlotStore(3, 1, writer=FakeWriter())
    m = AdapterRegistry(max_loras=3, max_cpu_loras=6, loader=None, max_full=1, slots=slots)  # type: ignore[arg-type]
    plain = [_version(m, f"p{i}", False) for i in range(3)]
    # plain adapters take the slots without full storage first
    assert [slots.assign(v) for v in plain[:2]] == [1, 2]
    assert slots.assign(plain[2]) == 0
    land(slots, *plain)
    full = _version(m, "f", True)
    assert slots.can_assign(full)
    assert slots.assign(full) == 0  # the one full-table slot, taken from its idle owner
    land(slots, full)
    slots.acquire(full)  # a running request reads it
    other = _version(m, "g", True)
    assert not slots.can_assign(other) and slots.assign(other) is None
    assert slots.can_assign(_version(m, "p9", False))  # a plain one still finds a slot


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_full_tables_mixed_batch_on_gpu(setup, dtype):
    """The fused path on CUDA in half precision, decode steps as CUDA graphs (the full
    embedding gather and the full LM head kernel inside them): against PEFT in float32."""
    kind, model_dir, adapters = setup
    prompts = _prompts(6)
    names = [n for n, _ in ROWS]
    run = dict(dtype=torch.float32, device="cuda")
    refs, tokens = hf_rows(model_dir, adapters, prompts, names, **run)
    half, _ = hf_rows(model_dir, adapters, prompts, names, dtype=dtype, device="cuda", force=tokens)
    our_steps = ours(
        model_dir, adapters, prompts, names, tokens, dtype=dtype, device="cuda", max_full=FULL
    )
    for step in range(DECODE_STEPS + 1):
        for row in range(len(ROWS)):
            ref = refs[step][row]
            err, floor = rel_err(our_steps[step][row], ref), rel_err(half[step][row], ref)
            assert half_ok(err, floor), (
                f"{kind} {dtype} step {step} row {row} ({names[row]}): {err:.2e} "
                f"(PEFT in {dtype}: {floor:.2e})"
            )
