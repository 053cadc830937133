"""Fused decode kernels: Triton vs torch twin, twin vs a from-scratch HF-style composition.

Without CUDA the Triton kernels run through the interpreter (set before the kernels are
imported; modules already imported by an earlier test are decorated again). bfloat16 Triton
cases only on a GPU (the interpreter's bfloat16 tl.dot is broken).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in ("lora_delta", "add_rmsnorm_split", "add_rmsnorm", "silu_mul", "qkv_rope"):
        if f"loraplex.engine.model.kernels.{_name}" in sys.modules:
            importlib.reload(sys.modules[f"loraplex.engine.model.kernels.{_name}"])

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from loraplex.engine.model import kernels as K  # noqa: E402
from loraplex.engine.model.lora.mapping import DoraRows, LoRAMapping  # noqa: E402
from loraplex.engine.model.rope import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
HALF_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}
SLOTS = [0, -1, 2, 2, -1, 0, 2]  # L = 3 with slot 1 unused
L, R, EPS = 3, 8, 1e-5
HQ, HKV, D = 4, 2, 16


def _aug(slots: list[int], n_base: int, num_slices: int, dtype: torch.dtype, triton: bool = False):
    """y_aug (T, N + R*S*L) (rank-major shrink columns, ``_col``) as a column window of a wider tensor, B (L, N, R) strided, and the
    step's mapping (``triton``: its kernel choice).

    Slots no token uses get huge shrink columns and B rows: reading them shows up loudly."""
    g = torch.Generator().manual_seed(0)
    t, width = len(slots), n_base + num_slices * L * R
    big = torch.randn(t, width + 5, generator=g)
    b = torch.randn(L, n_base, R + 3, generator=g) * R**-0.5
    for unused in set(range(L)) - set(slots):
        b[unused] = 1e3
        for s in range(num_slices):
            for r in range(R):
                big[:, 2 + _col(n_base, s, num_slices, unused, r)] = 1e3
    y_aug = big.to(DEVICE, dtype)[:, 2 : 2 + width]
    lora_b = b.to(DEVICE, dtype)[:, :, :R]
    return y_aug, lora_b, _mapping(torch.tensor(slots, dtype=torch.int32, device=DEVICE), triton)


def _col(n_base: int, s: int, num_slices: int, slot: int, r: int) -> int:
    """Column of the shrink of (slice s, slot, rank r) in y_aug: rank-major (model/lora/layers.py)."""
    return n_base + (r * num_slices + s) * L + slot


def _mapping(token_slots: torch.Tensor, triton: bool = False) -> LoRAMapping:
    """The step's LoRA metadata as the fused forward builds it (token slots, no segments)."""
    return LoRAMapping(token_slots, triton=triton)


DORA_ON = (2,)  # the slot whose DoRA scales are flagged; slot 0 is plain LoRA


def _dora(n_base: int, dtype: torch.dtype, kind: str | None) -> DoraRows | None:
    """DoRA tables (model/lora/dora.py) for ``kind`` "bias" / "nobias" (None: no DoRA): slot 2
    flagged; the plain slot 0 and the unused slot 1 hold huge scales that must never be read."""
    if kind is None:
        return None
    g = torch.Generator().manual_seed(11)
    scale = 0.5 + torch.rand(L + 1, n_base, generator=g)
    scale[[0, 1]] = 1e3
    scale[L] = 1.0
    on = torch.zeros(L + 1, dtype=torch.int32)
    on[list(DORA_ON)] = 1
    bias = torch.randn(n_base, generator=g).to(DEVICE, dtype) if kind == "bias" else None
    return DoraRows(scale.to(DEVICE, dtype), on.to(DEVICE), bias)


def _naive_proj(y_aug, n_base, lora_b, mapping, s, lo, hi, num_slices, dora=None):
    """Per-token loop: round(dora(base) + hA @ B[slot].T) for slice s (B rows lo..hi)."""
    rows = []
    slots = mapping.token_slots.tolist() if lora_b is not None else [-1] * len(y_aug)
    for t, slot in enumerate(slots):
        row = y_aug[t, lo:hi].float()
        if dora is not None and slot >= 0 and int(dora.on[slot]):
            b = dora.bias[lo:hi].float() if dora.bias is not None else 0.0
            row = dora.scale[slot, lo:hi].float() * (row - b) + b
        if slot >= 0:
            cols = [_col(n_base, s, num_slices, slot, r) for r in range(R)]
            row = row + lora_b[slot, lo:hi].float() @ y_aug[t, cols].float()
        rows.append(row.to(y_aug.dtype))
    return torch.stack(rows)


def _hf_rmsnorm(x, w):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)


def _close(got, want, tol):
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def _hf_close(got, want, dtype):
    """Twin vs HF-style ops: close, and in 16 bits mostly bit-identical (same roundings)."""
    _close(got, want, HALF_TOL[dtype])
    if dtype != torch.float32:
        assert (got != want).float().mean().item() <= 0.02


# --- inputs and runners per op: fn(impl) -> tuple of outputs ---------------------------------


def _run_add_rmsnorm(dtype, lora, impl, cfg=None, triton=False, dora=None):
    h = 64
    y_aug, lora_b, slots = _aug(SLOTS, h, 1, dtype, triton)
    g = torch.Generator().manual_seed(1)
    res = torch.randn(len(SLOTS), h + 3, generator=g).to(DEVICE, dtype)[:, 1 : 1 + h]
    w = torch.randn(h, generator=g).to(DEVICE, dtype)
    out = torch.full((len(SLOTS), h + 4), float("nan"), dtype=dtype, device=DEVICE)[:, :h]
    b = lora_b if lora else None
    d = _dora(h, dtype, dora)
    res0 = res.clone()
    impl(
        y_aug, res, b, slots, w, EPS, out, *((d,) if d else ()), **({"config": cfg} if cfg else {})
    )
    if impl is K.lora_add_rmsnorm_torch:  # naive composition of the same inputs
        want_res = res0 + _naive_proj(y_aug, h, b, slots, 0, 0, h, 1, d)
        _hf_close(res, want_res, dtype)
        _hf_close(out, _hf_rmsnorm(want_res, w), dtype)
    return res, out


def _run_rmsnorm(dtype, lora, impl, cfg=None):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 96, generator=g).to(DEVICE, dtype)[:, :80]
    w = torch.randn(80, generator=g).to(DEVICE, dtype)
    out = torch.full((5, 80), float("nan"), dtype=dtype, device=DEVICE)
    impl(x, w, EPS, out, **({"config": cfg} if cfg else {}))
    _hf_close(out, _hf_rmsnorm(x, w), dtype)
    return (out,)


def _run_silu_mul(dtype, lora, impl, cfg=None, triton=False, dora=None):
    inter = 128
    y_aug, lora_b, slots = _aug(SLOTS, 2 * inter, 2, dtype, triton)
    out = torch.full((len(SLOTS), inter), float("nan"), dtype=dtype, device=DEVICE)
    b = lora_b if lora else None
    d = _dora(2 * inter, dtype, dora)
    impl(y_aug, b, slots, out, *((d,) if d else ()), **({"config": cfg} if cfg else {}))
    if impl is K.lora_silu_mul_torch:
        gate = _naive_proj(y_aug, 2 * inter, b, slots, 0, 0, inter, 2, d)
        up = _naive_proj(y_aug, 2 * inter, b, slots, 1, inter, 2 * inter, 2, d)
        _hf_close(out, F.silu(gate) * up, dtype)
    return (out,)


def _qkv_inputs(dtype, lora, slot_mapping, triton=False):
    q_size, kv_size = HQ * D, HKV * D
    n = q_size + 2 * kv_size
    y_aug, lora_b, slots = _aug(SLOTS, n, 3, dtype, triton)
    t = len(SLOTS)
    positions = torch.tensor([0, 5, 3, 17, 2, 9, 31][:t], device=DEVICE)
    rope = RotaryEmbedding(D, 32, 10000.0, None, DEVICE)
    g = torch.Generator().manual_seed(3)
    caches = [
        torch.randn(4, 4, HKV, D + 2, generator=g).to(DEVICE, dtype)[..., :D] for _ in range(2)
    ]
    q_out = torch.full((t, HQ, D + 1), float("nan"), dtype=dtype, device=DEVICE)[..., :D]
    smap = torch.tensor(slot_mapping, dtype=torch.int64, device=DEVICE)
    b = lora_b if lora else None
    args = (y_aug, b, slots, positions, rope.cos, rope.sin)
    return args, caches, smap, q_out


def _run_qkv_rope(
    dtype, lora, impl, cfg=None, triton=False, slot_mapping=(3, -1, 0, 15, -1, 8, 9), dora=None
):
    args, (kc, vc), smap, q_out = _qkv_inputs(dtype, lora, list(slot_mapping), triton)
    kc0, vc0 = kc.clone(), vc.clone()
    q_size, kv_size = HQ * D, HKV * D
    n = q_size + 2 * kv_size
    d = _dora(n, dtype, dora)
    impl(*args, kc, vc, smap, q_out, *((d,) if d else ()), **({"config": cfg} if cfg else {}))
    if impl is K.lora_qkv_rope_torch:  # naive: per-slice projection, HF rotary, loop write
        y_aug, b, slots, *_ = args
        t = len(SLOTS)
        q = _naive_proj(y_aug, n, b, slots, 0, 0, q_size, 3, d).view(t, HQ, D)
        k = _naive_proj(y_aug, n, b, slots, 1, q_size, q_size + kv_size, 3, d).view(t, HKV, D)
        v = _naive_proj(y_aug, n, b, slots, 2, q_size + kv_size, n, 3, d).view(t, HKV, D)
        cos = args[4][args[3]].unsqueeze(1).to(dtype)
        sin = args[5][args[3]].unsqueeze(1).to(dtype)
        _hf_close(q_out, q * cos + _rotate_half(q) * sin, dtype)
        k = k * cos + _rotate_half(k) * sin
        for ti, slot in enumerate(smap.tolist()):
            if slot >= 0:
                kc0[slot // 4, slot % 4], vc0[slot // 4, slot % 4] = k[ti], v[ti]
        _hf_close(kc, kc0, dtype)
        _hf_close(vc, vc0, dtype)
    return q_out, kc, vc


TRITON = {  # op: (module, function, config class)
    "add_rmsnorm": ("add_rmsnorm", "lora_add_rmsnorm_triton", "NormConfig"),
    "rmsnorm": ("add_rmsnorm", "rmsnorm_triton", "NormConfig"),
    "silu_mul": ("silu_mul", "lora_silu_mul_triton", "SiluMulConfig"),
    "qkv_rope": ("qkv_rope", "lora_qkv_rope_triton", "QKVRopeConfig"),
}


def _triton(op):
    pytest.importorskip("triton")
    mod, fn, config = TRITON[op]
    module = importlib.import_module(f"loraplex.engine.model.kernels.{mod}")
    return getattr(module, fn), getattr(module, config)


RUNNERS = {
    "add_rmsnorm": (_run_add_rmsnorm, K.lora_add_rmsnorm_torch),
    "rmsnorm": (_run_rmsnorm, K.rmsnorm_torch),
    "silu_mul": (_run_silu_mul, K.lora_silu_mul_torch),
    "qkv_rope": (_run_qkv_rope, K.lora_qkv_rope_torch),
}
CONFIGS = {  # block_t 1 / 4: broadcast delta; 16: tensor-core dot; last 16 / 32: packed delta;
    # add_rmsnorm True: rows split over column chunks, 1 / 4 / 16 rows a block (add_rmsnorm_split.py)
    "add_rmsnorm": [
        (1, 32, 4),
        (4, 32, 4),
        (16, 16, 4),
        (1, 32, 4, True),
        (1, 16, 2, True),
        (4, 16, 2, True),
        (16, 32, 4, True),
    ],  # fmt: skip
    "rmsnorm": [(1, 32, 4), (4, 64, 4)],
    "silu_mul": [
        (16, 32, 4),
        (1, 64, 4),
        (2, 128, 4),
        (16, 32, 4, 16),
        (16, 64, 4, 32),
    ],  # fmt: skip
    "qkv_rope": [(16, 4), (1, 4), (2, 4), (16, 4, 16), (16, 4, 32)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", list(RUNNERS))
def test_twin_matches_naive_composition(op: str, dtype: torch.dtype) -> None:
    run, twin = RUNNERS[op]
    for lora in (True, False):
        outs = run(dtype, lora, twin)  # asserts against the naive composition inside
        assert all(not o.isnan().any() for o in outs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(RUNNERS))
def test_triton_matches_twin(op: str, dtype: torch.dtype) -> None:
    run, twin = RUNNERS[op]
    fn, config = _triton(op)
    for lora in (True, False):
        want = run(dtype, lora, twin)
        for cfg in [None] + [config(*c) for c in CONFIGS[op]]:
            got = run(dtype, lora, fn, cfg)
            for g_, w_ in zip(got, want, strict=True):
                assert not g_.isnan().any(), f"{op} {cfg}: a row was not written"
                _close(g_, w_, TOL[dtype])
                # Same roundings as the twin: 16-bit results agree bit for bit up to rare
                # flips from fp32 summation order (a skipped rounding step changes many).
                if dtype != torch.float32:
                    assert (g_ != w_).float().mean().item() <= 0.02, f"{op} {cfg}: rounding"


DORA_OPS = ["add_rmsnorm", "silu_mul", "qkv_rope"]


@pytest.mark.parametrize("kind", ["nobias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", DORA_OPS)
def test_dora_rows_triton_matches_twin(op: str, dtype: torch.dtype, kind: str) -> None:
    """DoRA row scales inside the epilogues (model/lora/dora.py): the twin against the naive
    composition (in the runner), every Triton config against the twin; only the flagged
    slot's rows change (the plain slot's and unused slot's huge scales are never read)."""
    run, twin = RUNNERS[op]
    fn, config = _triton(op)
    want = run(dtype, True, twin, dora=kind)
    plain = run(dtype, True, twin)
    flagged = torch.tensor([s in DORA_ON for s in SLOTS], device=DEVICE)
    for w_, p_ in zip(want, plain, strict=True):
        if w_.shape[0] == len(SLOTS):  # per-row outputs (not the KV caches)
            rows = w_.reshape(len(SLOTS), -1).float(), p_.reshape(len(SLOTS), -1).float()
            assert torch.equal(rows[0][~flagged], rows[1][~flagged])
            assert (rows[0][flagged] - rows[1][flagged]).abs().max() > 1e-2
    for cfg in [None] + [config(*c) for c in CONFIGS[op]]:
        got = run(dtype, True, fn, cfg, dora=kind)
        for g_, w_ in zip(got, want, strict=True):
            assert not g_.isnan().any(), f"{op} {cfg}: a row was not written"
            _close(g_, w_, TOL[dtype])
            if dtype != torch.float32:
                assert (g_ != w_).float().mean().item() <= 0.02, f"{op} {cfg}: rounding"


def test_qkv_rope_skips_padded_rows_and_writes_nothing_else() -> None:
    fn, config = _triton("qkv_rope")
    smap = (-1, 2, -1, -1, 7, -1, 11)
    for impl, cfg in ((K.lora_qkv_rope_torch, None), (fn, config(16)), (fn, config(1))):
        args, (kc, vc), sm, q_out = _qkv_inputs(torch.float32, True, list(smap))
        kc0, vc0 = kc.clone(), vc.clone()
        impl(*args, kc, vc, sm, q_out, **({"config": cfg} if cfg else {}))
        written = torch.zeros(16, dtype=torch.bool, device=DEVICE)
        written[[s for s in smap if s >= 0]] = True
        untouched = ~written.view(4, 4)
        assert torch.equal(kc[untouched], kc0[untouched])
        assert torch.equal(vc[untouched], vc0[untouched])
        assert not torch.equal(kc[~untouched], kc0[~untouched])
        assert not q_out.isnan().any()


def test_augmented_gemm_layout_matches_peft_style_math() -> None:
    """y_aug from a real x @ [W; A].T against base + (x A^T) B^T per token (fp32)."""
    g = torch.Generator().manual_seed(4)
    t, hidden, inter = len(SLOTS), 32, 48
    x = torch.randn(t, hidden, generator=g)
    w = torch.randn(2 * inter, hidden, generator=g) / hidden**0.5
    a = torch.randn(2, L, R, hidden, generator=g) / hidden**0.5  # (S, L, R, in)
    b = torch.randn(L, 2 * inter, R, generator=g) / R**0.5
    y_aug = x @ torch.cat([w, a.permute(2, 0, 1, 3).reshape(-1, hidden)]).T  # rank-major rows
    slots = _mapping(torch.tensor(SLOTS, dtype=torch.int32))
    out = torch.empty(t, inter)
    K.lora_silu_mul_torch(y_aug, b, slots, out)
    gu = x @ w.T
    for ti, slot in enumerate(SLOTS):
        if slot >= 0:
            for s, (lo, hi) in enumerate(((0, inter), (inter, 2 * inter))):
                gu[ti, lo:hi] += (x[ti] @ a[s, slot].T) @ b[slot, lo:hi].T
    _close(out, F.silu(gu[:, :inter]) * gu[:, inter:], 1e-5)


def test_dispatch_by_the_mapping_and_shape_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ops run the Triton kernel or the twin as the step's mapping says."""
    pytest.importorskip("triton")
    from loraplex.engine.model.kernels import silu_mul

    calls = []
    real = silu_mul.lora_silu_mul_triton
    monkeypatch.setattr(silu_mul, "lora_silu_mul_triton", lambda *a: calls.append(1) or real(*a))
    for triton in (False, True):
        _close(_run_silu_mul(torch.float32, True, K.lora_silu_mul, triton=triton)[0],
               _run_silu_mul(torch.float32, True, K.lora_silu_mul_torch)[0], 1e-5)  # fmt: skip
        assert len(calls) == int(triton)
        _run_rmsnorm(torch.float32, False, functools.partial(K.rmsnorm, triton=triton))
        _run_add_rmsnorm(torch.float32, True, K.lora_add_rmsnorm, triton=triton)
        _run_qkv_rope(torch.float32, True, K.lora_qkv_rope, triton=triton)
    y_aug, lora_b, slots = _aug(SLOTS, 64, 2, torch.float32)
    out = torch.empty(len(SLOTS), 32, device=DEVICE)
    with pytest.raises(ValueError, match="N \\+ S\\*L\\*R"):
        K.lora_silu_mul(y_aug[:, :-1], lora_b, slots, out)
    with pytest.raises(ValueError, match="lora_b"):
        K.lora_silu_mul(y_aug, lora_b[:, :32], slots, out)
    with pytest.raises(ValueError, match="token_slots"):
        K.lora_silu_mul(y_aug, lora_b, _mapping(slots.token_slots[:3]), out)
