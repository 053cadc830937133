"""Packed slot writes (one H2D copy + batched scatter) give exactly the per-module writes' buffers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.engine.adapters.parse import LoRAAdapter, load_adapter
from loraplex.engine.adapters.slot_store import SlotStore
from loraplex.engine.adapters.slot_writer import InlineWriter
from loraplex.engine.adapters.staging import stage_packed
from loraplex.engine.adapters.version import AdapterState, AdapterVersion
from loraplex.engine.bench.coldload.bandwidth import measure_slot_write
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.llama import LlamaForCausalLM
from loraplex.engine.model.loader import load_model
from loraplex.engine.model.lora.slot_buffers import (
    SlotBuffers,
    clear_slot,
    write_slot,
    write_slot_reference,
)
from loraplex.engine.model.lora.slot_image import pack_adapter
from tests.helpers.models import ALL_MODULES, ATTN_MODULES, make_peft_adapter, make_tiny_model

pytest.importorskip("peft")

MAX_LORAS, MAX_RANK = 3, 16
ADAPTERS = {
    "full16": dict(r=16, target_modules=ALL_MODULES),
    "attn8": dict(r=8, target_modules=ATTN_MODULES),
    "patterns": dict(
        r=8,
        target_modules=ALL_MODULES,
        rank_pattern={"down_proj": 5, "model.layers.1.self_attn.q_proj": 2},
    ),
    "qv_layer1": dict(r=4, target_modules=("q_proj", "v_proj"), layers_to_transform=[1]),
    "gate_up": dict(r=3, target_modules=("gate_proj", "up_proj", "k_proj")),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("slots")
    base = make_tiny_model(root / "base")
    out = {
        name: make_peft_adapter(base, root / name, alpha=16, seed=i, **kw)
        for i, (name, kw) in enumerate(ADAPTERS.items())
    }
    return base, out


def _model(base: Path, dtype: torch.dtype, device: str = "cpu") -> LlamaForCausalLM:
    """A model whose slot regions hold seeded garbage, so every zero-fill is checked."""
    model = load_model(
        base, dtype=dtype, device=device, max_loras=MAX_LORAS, max_lora_rank=MAX_RANK
    )
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, linears in model.lora_linears():
            for lin in dict.fromkeys(linears.values()):
                n = lin.out_features
                lin.weight_aug[n:].copy_(torch.randn(lin.weight_aug[n:].shape, generator=g))
                lin.lora_b.copy_(torch.randn(lin.lora_b.shape, generator=g))
    return model


def _buffers(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    out = {}
    for layer, linears in model.lora_linears():
        for lin in dict.fromkeys(linears.values()):
            name = f"{layer}.{lin.slice_names[0]}"
            out[name + ".weight_aug"] = lin.weight_aug.detach().cpu().clone()
            out[name + ".lora_b"] = lin.lora_b.cpu().clone()  # (L, N, R)
            out[name + ".lora_a"] = lin.lora_a.cpu().transpose(0, 1).clone()  # (L, S, R, in)
    return out


def _assert_same(a: LlamaForCausalLM, b: LlamaForCausalLM) -> None:
    ba, bb = _buffers(a), _buffers(b)
    for k in ba:
        assert torch.equal(ba[k], bb[k]), k


def _load(base: Path, path: Path, dtype: torch.dtype) -> LoRAAdapter:
    return load_adapter(path, ModelConfig.from_dir(base), max_lora_rank=MAX_RANK, dtype=dtype)


@pytest.mark.parametrize(
    ("dtype", "scatter"),
    [
        (torch.float32, "torch"),
        (torch.bfloat16, "torch"),
        # the one-launch Triton scatter, interpreted on CPU (float32/float16: the interpreter's
        # bfloat16 is not trusted; bfloat16 runs in test_packed_write_cuda_pinned)
        (torch.float32, "triton"),
        (torch.float16, "triton"),
    ],
)
@pytest.mark.parametrize("staged", [False, True])
def test_packed_write_matches_reference(
    dirs, dtype: torch.dtype, scatter: str, staged: bool
) -> None:
    base, paths = dirs
    ref, new = _model(base, dtype), _model(base, dtype)
    _assert_same(ref, new)
    adapters = {name: _load(base, p, dtype) for name, p in paths.items()}
    if staged:  # the loader's form: packed, tensors re-pointed into the packed buffer
        for ad in adapters.values():
            orig = {k: (w.a.clone(), w.b.clone()) for k, w in ad.weights.items()}
            stage_packed(ad, MAX_RANK, pin=False)
            assert ad.image is not None
            for k, (a, b) in orig.items():
                assert torch.equal(ad.weights[k].a, a) and torch.equal(ad.weights[k].b, b)
    # slot 0 gets a rank-16 adapter, then a rank-4 one on one layer: padding and the rest zero
    steps = [("full16", 0), ("attn8", 1), ("patterns", 2), ("qv_layer1", 0), ("gate_up", 1)]
    steps += [("full16", 2), ("patterns", 0)]
    for name, slot in steps:
        before = _buffers(new)
        write_slot_reference(ref, slot, adapters[name])
        write_slot(new, slot, adapters[name], scatter=scatter)
        _assert_same(ref, new)
        after = _buffers(new)
        for k, t in after.items():  # other slots untouched
            other = [s for s in range(MAX_LORAS) if s != slot]
            if not k.endswith(".weight_aug"):
                assert torch.equal(t[other], before[k][other]), k
    # after qv_layer1 over full16, padding and untargeted regions of slot 0 were zeroed
    write_slot(new, 0, adapters["qv_layer1"], scatter=scatter)
    for layer, linears in new.lora_linears():
        for module, lin in linears.items():
            s = lin.slice_index(module)
            lo, hi = lin.slice_offsets[s], lin.slice_offsets[s + 1]
            r = 4 if (layer, module) in adapters["qv_layer1"].weights else 0
            assert not lin.lora_a[s, 0, r:].any() and not lin.lora_b[0, lo:hi, r:].any()
            if r:
                assert lin.lora_a[s, 0, :r].all() and lin.lora_b[0, lo:hi, :r].any()


@pytest.mark.parametrize("scatter", ["torch", "triton"])
def test_refill_with_the_same_layout_skips_only_known_zeros(dirs, scatter: str) -> None:
    """The slot store's decisions on real buffers: a slot written again with the layout it
    holds skips the zero-fill of what the layout does not fill (it is zero already); after a
    per-module or direct write, or another layout, the write zero-fills."""
    base, paths = dirs
    ref, new = _model(base, torch.float32), _model(base, torch.float32)
    attn, gate = (_load(base, paths[n], torch.float32) for n in ("attn8", "gate_up"))
    for ad in (attn, gate):
        stage_packed(ad, MAX_RANK, pin=False)  # (staged adapters carry their image's layout)
    buffers = SlotBuffers(new)
    store = SlotStore(
        1,
        writer=InlineWriter(lambda slot, a, **kw: buffers.write(slot, a, scatter=scatter, **kw)),
        generation=buffers.generation,
    )
    mlp = next(iter(new.lora_linears()))[1]["gate_proj"]  # a region attn8 does not fill
    s = mlp.slice_index("gate_proj")
    lo, hi = mlp.slice_offsets[s], mlp.slice_offsets[s + 1]

    def write(adapter: LoRAAdapter) -> None:
        for old in store.resident:
            store.free(old)
        v = AdapterVersion(adapter.name, "", "d", 1, state=AdapterState.CPU, adapter=adapter)
        assert store.assign(v) == 0
        jobs = store.begin([v], set())
        store.issue(jobs, after=None, busy=set(), read=set())
        store.collected(jobs)
        assert [w.version for w in store.poll()] == [v]

    def poison() -> None:  # behind the store's back: what a skip leaves alone
        with torch.no_grad():
            mlp.lora_b[0, lo:hi].fill_(7.0)

    write_slot_reference(ref, 0, attn)
    write(attn)  # garbage before: the first write zero-fills
    _assert_same(ref, new)
    poison()
    write(attn)
    assert (mlp.lora_b[0, lo:hi] == 7.0).all()  # same layout: no zero-fill
    mlp.set_lora(0, "gate_proj", torch.ones(2, mlp.in_features), torch.ones(hi - lo, 2))
    write(attn)  # a per-module write voids what was known
    _assert_same(ref, new)
    write(gate)
    poison()
    write(attn)  # another layout before: zero-fill
    _assert_same(ref, new)
    poison()
    clear_slot(new, 0)  # a direct write: what the store knew is void
    write(gate)
    write_slot_reference(ref, 0, gate)
    _assert_same(ref, new)


def test_packed_form_and_explicit_packed(dirs) -> None:
    base, paths = dirs
    ref, new = _model(base, torch.float32), _model(base, torch.float32)
    ad = _load(base, paths["patterns"], torch.float32)
    packed = pack_adapter(ad, new)
    # B padded to R, A kept at its rank: bytes below a full padded image
    assert packed.max_rank == MAX_RANK
    assert packed.nbytes < sum(
        (MAX_RANK * (w.a.shape[1] + w.b.shape[0])) * 4 for w in ad.weights.values()
    )
    write_slot(new, 1, packed)
    write_slot_reference(ref, 1, ad)
    _assert_same(ref, new)
    assert measure_slot_write(new, packed, 2, slot=1) > 0
    _assert_same(ref, new)
    assert measure_slot_write(new, packed, 2, slot=1, zero_fill=True) > 0
    _assert_same(ref, new)
    with pytest.raises(ValueError, match="rank"):
        write_slot(new, 1, pack_adapter(ad, 32))
    with pytest.raises(ValueError):
        pack_adapter(ad, 4)  # rank 8 > R
    with pytest.raises(IndexError):
        write_slot(new, MAX_LORAS, packed)


def test_clear_slot_matches_reference(dirs) -> None:
    base, _ = dirs
    ref, new = _model(base, torch.float32), _model(base, torch.float32)
    for _, linears in ref.lora_linears():
        for lin in dict.fromkeys(linears.values()):
            lin.reset_lora(2)
    clear_slot(new, 2)
    _assert_same(ref, new)


def test_rebuilt_buffers_are_noticed(dirs) -> None:
    """Cached slot views follow a model whose LoRA buffers were replaced."""
    base, paths = dirs
    ref, new = _model(base, torch.float32), _model(base, torch.float32)
    ad = _load(base, paths["attn8"], torch.float32)
    write_slot(new, 0, ad)
    for m in (ref, new):
        for _, linears in m.lora_linears():
            for lin in dict.fromkeys(linears.values()):
                lin.lora_b = lin.lora_b.clone()
    write_slot(new, 1, ad)
    write_slot_reference(ref, 0, ad)
    write_slot_reference(ref, 1, ad)
    _assert_same(ref, new)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_write_cuda_pinned(dirs, dtype: torch.dtype) -> None:
    base, paths = dirs
    ref, new = _model(base, dtype, "cuda"), _model(base, dtype, "cuda")
    adapters = {name: _load(base, p, dtype) for name, p in paths.items()}
    for ad in adapters.values():
        packed = stage_packed(ad, MAX_RANK, pin=True)
        assert packed.buffer.is_pinned()
    side = torch.cuda.Stream()
    steps = [("full16", 0), ("attn8", 1), ("qv_layer1", 0), ("gate_up", 2), ("patterns", 0)]
    for name, slot in steps:
        write_slot_reference(ref, slot, adapters[name])
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            write_slot(new, slot, adapters[name])
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        _assert_same(ref, new)


def test_packed_image_holds_only_the_adapters_rank(dirs) -> None:
    """A rank-8 adapter packs to the same bytes for slots of rank 16 or 64: A and B^T of its
    own rank, no padding to max_lora_rank (pinned memory and H2D bytes follow its rank)."""
    base, paths = dirs
    ad = _load(base, paths["attn8"], torch.float32)
    p16, p64 = pack_adapter(ad, 16), pack_adapter(ad, 64)
    assert p16.buffer.numel() == p64.buffer.numel()
    own = sum(e.rank * (e.in_features + e.out_features) for e in p64.entries.values())
    assert own <= p64.buffer.numel() <= own + 64 * 2 * len(p64.entries)  # alignment gaps
    for k, w in ad.weights.items():
        e = p64.entries[k]
        assert torch.equal(p64.a(e), w.a) and torch.equal(p64.b(e), w.b)


def test_equal_layouts_are_one_key(dirs) -> None:
    """Packed images with the same blocks share one layout key (slot writes look their plan
    and zero state up by identity); another rank pattern is another key."""
    base, paths = dirs
    a, b, c = (_load(base, paths[n], torch.float32) for n in ("attn8", "attn8", "gate_up"))
    pa, pb, pc = (pack_adapter(x, MAX_RANK) for x in (a, b, c))
    assert pa.layout is pb.layout and pa.layout == pb.layout
    assert pa.layout != pc.layout and hash(pa.layout) == hash(pb.layout)
