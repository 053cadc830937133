"""The MoE path's pieces on random data: routing against HF's routers, the expert-sorted
blocks, the grouped GEMM's Triton kernel (interpreted on CPU) against its torch twin in float32
and float16 (and bfloat16 on a GPU), the experts' MLP against HF's expert loop, and Qwen3's
q / k norm epilogue against its twin."""

from __future__ import annotations

import itertools

import pytest
import torch

from loraplex.engine.model.moe.grouped_gemm import grouped_gemm, moe_experts
from loraplex.engine.model.moe.pairs import route_pairs, sort_pairs
from loraplex.engine.model.moe.routing import max_blocks, route, sort_by_expert
from loraplex.engine.model.moe.triton_routing import MAX_SORT_PAIRS, sort_by_expert_triton

transformers = pytest.importorskip("transformers")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _tol(dtype: torch.dtype) -> dict:
    if dtype == torch.float32:
        return dict(rtol=1e-5, atol=1e-5)
    return dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else dict(rtol=2e-2, atol=2e-2)


def _router(kind: str, e: int, k: int, h: int, norm: bool):
    if kind == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        cfg = transformers.Qwen3MoeConfig(
            hidden_size=h, num_experts=e, num_experts_per_tok=k, norm_topk_prob=norm
        )
        return Qwen3MoeTopKRouter(cfg), dict(renormalize=norm, fp32_weights=False)
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    cfg = transformers.MixtralConfig(hidden_size=h, num_local_experts=e, num_experts_per_tok=k)
    return MixtralTopKRouter(cfg), dict(renormalize=True, fp32_weights=True)


@pytest.mark.parametrize(
    ("kind", "norm"), [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", True)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_matches_hf_routers(kind, norm, dtype):
    g = torch.Generator().manual_seed(0)
    hf, kw = _router(kind, 8, 3, 32, norm)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(8, 32, generator=g))
    hf = hf.to(dtype)
    x = torch.randn(11, 32, generator=g).to(dtype)
    _, hf_w, hf_ids = hf(x)
    w, ids = route(torch.nn.functional.linear(x, hf.weight), 3, **kw)
    assert torch.equal(ids, hf_ids)
    assert w.dtype == hf_w.dtype and torch.equal(w, hf_w)


@pytest.mark.parametrize(("t", "k", "e", "block_m"), [(1, 2, 4, 16), (7, 3, 5, 16), (40, 2, 3, 16)])
def test_sort_by_expert_blocks(t, k, e, block_m):
    g = torch.Generator().manual_seed(t)
    experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])  # (T, k)
    blocks = sort_by_expert(experts, e, block_m)
    p = t * k
    assert blocks.num_blocks == max_blocks(p, e, block_m)  # static: T, k, E only
    flat = experts.reshape(-1)
    seen = []
    for b, owner in enumerate(blocks.experts.tolist()):
        pairs = [q for q in blocks.pairs[b * block_m : (b + 1) * block_m].tolist() if q < p]
        if owner < 0:
            assert not pairs
            continue
        assert all(flat[q] == owner for q in pairs)
        seen += pairs
    assert sorted(seen) == list(range(p))
    used = blocks.experts >= 0
    assert bool((used[:-1] | ~used[1:]).all()), "unused blocks only at the end"


@pytest.mark.parametrize(
    ("t", "k", "e", "block_m"),
    [(1, 2, 4, 16), (1, 8, 128, 16), (7, 3, 5, 16), (40, 2, 3, 16), (33, 4, 60, 64), (9, 2, 2, 64)],
)
def test_sort_kernel_matches_twin(t, k, e, block_m):
    """The one-launch sort: the twin's blocks bit for bit (pairs, owners, padding), also with
    skewed routings (most pairs on one expert) and experts left unused."""
    g = torch.Generator().manual_seed(t * 7 + e)
    uniform = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    skewed = torch.where(
        torch.rand(t, k, generator=g) < 0.7, 0, torch.randint(0, e, (t, k), generator=g)
    )
    for experts in (uniform, skewed):
        experts = experts.to(DEVICE)
        want = sort_by_expert(experts, e, block_m)
        got = sort_by_expert_triton(experts, e, block_m)
        assert got.pairs.dtype == torch.int32 and got.experts.dtype == torch.int32
        assert torch.equal(got.pairs, want.pairs) and torch.equal(got.experts, want.experts)
        assert (got.block_m, got.num_pairs) == (want.block_m, want.num_pairs)


def test_sort_pairs_takes_the_twin_past_one_program():
    experts = torch.zeros(MAX_SORT_PAIRS + 1, dtype=torch.int64, device=DEVICE)
    blocks = sort_pairs(experts, 4, 64, triton=True)
    assert torch.equal(blocks.pairs, sort_by_expert(experts, 4, 64).pairs)
    with pytest.raises(ValueError, match="one-program sort"):
        sort_by_expert_triton(experts, 4, 64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "e", "k"), [(1, 128, 8), (5, 6, 2), (17, 60, 4)])
@pytest.mark.parametrize(
    ("renormalize", "fp32_weights"), [(True, False), (False, False), (True, True)]
)
def test_route_kernel_matches_twin(dtype, t, e, k, renormalize, fp32_weights):
    """The one-launch routing: float32 logits choose the twin's experts in its order with its
    weights; 16-bit logits (ties between equal probabilities possible, torch.topk's order
    among them unspecified) choose experts of the same probabilities, weights as the twin's."""
    g = torch.Generator().manual_seed(t + e)
    logits = (torch.randn(t, e, generator=g) * 2).to(DEVICE, dtype)
    kw = dict(renormalize=renormalize, fp32_weights=fp32_weights)
    w0, e0 = route(logits, k, **kw)
    w1, e1 = route_pairs(logits, k, triton=True, **kw)
    assert w1.dtype == w0.dtype and e1.dtype == e0.dtype == torch.int64
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    assert torch.equal(probs.gather(1, e1), probs.gather(1, e0))  # the same top k values
    assert all(len(set(r)) == k for r in e1.tolist())
    tol = dict(rtol=1e-6, atol=1e-7) if w0.dtype == torch.float32 else _tol(w0.dtype)
    torch.testing.assert_close(w1, w0, **tol)
    if dtype == torch.float32:
        assert torch.equal(e1, e0)


def _weights(e: int, n: int, k: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return (torch.randn(e, n, k, generator=g) / k**0.5).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "top_k", "e", "n", "kdim"), [(1, 2, 4, 40, 24), (13, 3, 6, 72, 136)])
@pytest.mark.parametrize("scaled", [False, True])
def test_grouped_gemm_triton_matches_twin(dtype, t, top_k, e, n, kdim, scaled):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(t, kdim, generator=g).to(DEVICE, dtype)
    w = _weights(e, n, kdim, dtype, g).to(DEVICE)
    experts = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(t)]).reshape(-1)
    experts = experts.to(DEVICE)
    scale = torch.rand(t * top_k, generator=g).to(DEVICE) if scaled else None
    outs = []
    for triton in (False, True):
        out = torch.full((t * top_k, n), float("nan"), dtype=dtype, device=DEVICE)
        grouped_gemm(a, w, experts, out, a_div=top_k, scale=scale, triton=triton)
        outs.append(out)
    tol = _tol(dtype)
    torch.testing.assert_close(outs[1], outs[0], **tol)
    # the loop of the docstring, pair by pair
    p = t * top_k - 1  # the last pair
    want = (a[p // top_k].float() @ w[experts[p]].float().t()).to(dtype)
    if scale is not None:
        want = (want.float() * scale[p]).to(dtype)
    torch.testing.assert_close(outs[0][p], want, **tol)


def test_grouped_gemm_refuses_bad_shapes():
    a, w = torch.zeros(3, 8), torch.zeros(2, 4, 8)
    with pytest.raises(ValueError, match="experts"):
        grouped_gemm(a, w, torch.zeros(5, dtype=torch.int64), torch.zeros(6, 4), a_div=2,
                     triton=False)  # fmt: skip
    with pytest.raises(ValueError, match="w"):
        grouped_gemm(a, torch.zeros(2, 4, 7), torch.zeros(6, dtype=torch.int64),
                     torch.zeros(6, 4), a_div=2, triton=False)  # fmt: skip


@pytest.mark.parametrize("triton", [False, True])
def test_moe_experts_match_hf_expert_loop(triton):
    """float32: the twin and the kernel against ``Qwen3MoeExperts.forward`` (HF's loop)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = transformers.Qwen3MoeConfig(hidden_size=48, num_experts=5, moe_intermediate_size=24)
    hf = Qwen3MoeExperts(cfg)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        hf.gate_up_proj.copy_(_weights(5, 48, 48, torch.float32, g))
        hf.down_proj.copy_(_weights(5, 48, 24, torch.float32, g))
    hf = hf.to(DEVICE)
    x = torch.randn(9, 48, generator=g).to(DEVICE)
    weights, experts = route(torch.randn(9, 5, generator=g).to(DEVICE), 2, renormalize=False,
                             fp32_weights=False)  # fmt: skip
    want = hf(x, experts, weights)
    got = moe_experts(x, hf.gate_up_proj, hf.down_proj, weights, experts, triton=triton)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["lora", "dora", "base"])
def test_qk_norm_triton_matches_twin(dtype, case):
    """``lora_qk_norm`` (Qwen3's q / k norm after the qkv LoRA epilogue): the kernel against its
    twin on rows of three slots and base rows, and the twin against HF's RMSNorm per head."""
    from loraplex.engine.model.kernels.qk_norm import lora_qk_norm
    from loraplex.engine.model.lora.mapping import DoraRows, LoRAMapping

    g = torch.Generator().manual_seed(5)
    t, hq, hkv, d, slots_n, rank = 19, 4, 2, 16, 3, 8
    n = (hq + 2 * hkv) * d
    y = torch.randn(t, n + 3 * slots_n * rank, generator=g).to(DEVICE, dtype)
    b = 0.1 * torch.randn(slots_n, n, rank, generator=g)
    b = b.to(DEVICE, dtype) if case != "base" else None
    slots = torch.randint(-1, slots_n, (t,), generator=g, dtype=torch.int32).to(DEVICE)
    qw, kw = ((1 + 0.1 * torch.randn(d, generator=g)).to(DEVICE, dtype) for _ in range(2))
    dora = None
    if case == "dora":
        scale = (1 + 0.1 * torch.randn(slots_n + 1, n, generator=g)).to(DEVICE, dtype)
        on = torch.tensor([1, 0, 1, 0], dtype=torch.int32, device=DEVICE)
        dora = DoraRows(scale, on, None)
    outs = []
    for triton in (False, True):
        out = torch.empty(t, n, dtype=dtype, device=DEVICE)
        lora_qk_norm(y, b, LoRAMapping(slots, triton=triton), qw, kw, 1e-6, out, hq, dora)
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], **_tol(dtype))
    if case == "base":  # HF: weight * round(x * rsqrt(mean(x^2) + eps)) per head of q and k
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

        norm = Qwen3MoeRMSNorm(d, eps=1e-6).to(DEVICE, dtype)
        with torch.no_grad():
            norm.weight.copy_(qw)
        want_q = norm(y[:, : hq * d].reshape(t, hq, d)).reshape(t, -1)
        torch.testing.assert_close(outs[0][:, : hq * d], want_q, rtol=0, atol=0)
        torch.testing.assert_close(outs[0][:, (hq + hkv) * d :], y[:, (hq + hkv) * d : n])


def test_grouped_gemm_launch_rows_fit_every_gpu(monkeypatch):
    """Each row of the grouped GEMM's launch table (every device entry) fits the shared memory
    of its devices and Triton's dot tiles, for the block sizes the sort makes; the sm_90 rows
    keep the measured choices (benchmarks/moe_configs.py) and only where they were measured."""
    from loraplex.engine.model.kernels import launch_table
    from loraplex.engine.model.kernels.launch_table import GENERIC, GENERIC_SMEM_BYTES
    from loraplex.engine.model.moe.grouped_gemm import block_m_for
    from loraplex.engine.model.moe.triton_grouped import GROUPED_CONFIGS, GroupedConfig

    assert set(GROUPED_CONFIGS.entries) == {GENERIC, "sm90"}
    limits = {GENERIC: GENERIC_SMEM_BYTES, "sm90": 227 * 1024}
    for key, block_m, pairs in itertools.product(
        limits, {block_m_for(p, 128) for p in (8, 512, 8192, 65536)}, (1, 8, 64, 65, 512)
    ):
        for (n, k), elem in itertools.product(((1536, 2048), (2048, 768), (28672, 4096)), (2, 4)):
            shape = {"block_m": block_m, "n": n, "k": k, "elem": elem, "pairs": pairs}
            cfg = GROUPED_CONFIGS._first(key, shape)
            assert block_m >= 16 and cfg.block_n >= 16 and cfg.block_k >= 16
            assert cfg.smem_bytes(block_m, elem) <= limits[key], (key, cfg, elem)
    monkeypatch.setattr(launch_table, "_cuda_key", lambda index: "sm90")
    pick = GROUPED_CONFIGS.pick
    assert pick("cuda:0", block_m=16, n=1536, k=2048, elem=2, pairs=8) == GroupedConfig(
        128, 128, 4, 4
    )
    assert pick("cuda:0", block_m=16, n=2048, k=768, elem=2, pairs=8) == GroupedConfig(
        32, 256, 4, 2
    )
    for shape in ({"pairs": 512, "elem": 2}, {"pairs": 8, "elem": 4}):  # not measured: generic
        got = pick("cuda:0", block_m=16, n=1536, k=2048, **shape)
        assert got == pick(None, block_m=16, n=1536, k=2048, **shape)
