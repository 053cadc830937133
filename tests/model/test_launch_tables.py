"""Launch tables keyed by device (model/kernels/launch_table.py): every rule of every entry gives
a config its kernel can take, over the shapes the rule covers; a device without an entry of its
own (and the CPU) gets the generic one; the sm_90 rows keep the measured choices."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping

import pytest
import torch

from loraplex.engine.model import paged_attention as pa
from loraplex.engine.model.kernels import (
    add_rmsnorm,
    fp8_gemv,
    fp8_linear,
    launch_table,
    qkv_rope,
    silu_mul,
)
from loraplex.engine.model.kernels.add_rmsnorm_split import MAX_CHUNKS, MAX_ROWS
from loraplex.engine.model.kernels.launch_table import (
    GENERIC,
    GENERIC_SMEM_BYTES,
    LaunchTable,
    Rule,
    device_key,
)
from loraplex.engine.model.lora.ops import triton_expand, triton_shrink
from loraplex.engine.model.moe import triton_expert_lora

SM90_SMEM_BYTES = 227 * 1024  # a block's shared memory on an H100 / H200
WARPS = {1, 2, 4, 8, 16}


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _grid(**dims: Iterable[int]) -> list[dict[str, int]]:
    names = list(dims)
    return [dict(zip(names, vs, strict=True)) for vs in itertools.product(*dims.values())]


EPILOGUE_SHAPES = _grid(
    tokens=(1, 2, 8, 16, 17, 32, 33, 64, 65, 128, 256, 257, 1024),
    slots=(0, 1, 8, 15, 16, 32),
    rank=(0, 8, 16, 17, 32, 64, 128),
)
NORM_SHAPES = _grid(
    tokens=(1, 2, 32, 33, 64, 256, 257, 1024),
    hidden=(64, 576, 2048, 2049, 4096, 5120, 8192, 65536, 65537),
    rank=(0, 16, 17, 64),
)
FP8_NK = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (576, 576), (1536, 576)]
FP8_SHAPES = [
    {"block_m": bm, "n": n, "k": k, "group": g, "sms": sms}
    for bm, (n, k), sms in itertools.product((16, 32, 64, 128), FP8_NK, (132, 58, 16))
    for g in (32, 128, k)
]
GEMV_SHAPES = [
    {"tokens": t, "n": n, "k": k, "group": g, "e": e, "sms": sms}
    for t, (n, k), e, sms in itertools.product((1, 2, 3, 4), FP8_NK, (0, 128), (132, 16))
    for g in (32, 128, k)
]
SGMV_SHAPES = _grid(
    tokens=(0, 1, 2, 16, 17, 64, 65, 512),
    segments=(1, 8, 32),
    slices=(1, 3),
    k=(576, 4096, 14336),
    rank=(1, 8, 16, 17, 64, 128, 256, 512),
    sms=(132, 16),
)
EXPAND_SHAPES = [{**s, "width": s.pop("k")} for s in _grid(
    tokens=(0, 1, 16, 17, 64, 512), segments=(1, 8, 32), slices=(1, 3, 4), k=(64, 576, 14336),
    sms=(132, 16),
)]  # fmt: skip
EXPERT_LORA_SHAPES = _grid(
    block_m=(16, 64),
    cols=(1, 8, 16, 17, 32, 64, 128, 256, 1024),
    pairs=(1, 8, 32, 64, 127, 128, 512),
)
DECODE_SHAPES = _grid(fp32=(0, 1), head_dim=(64, 80, 128, 256), half_waves=range(0, 9))
PREFILL_SHAPES = _grid(fp32=(0, 1), head_dim=(64, 80, 128, 256))


def _smem_limit(key: str) -> int:
    return SM90_SMEM_BYTES if key == "sm90" else GENERIC_SMEM_BYTES


def _check_silu(cfg: silu_mul.SiluMulConfig, shape: Mapping[str, int], key: str) -> None:
    assert _pow2(cfg.block_t) and _pow2(cfg.block_n) and cfg.num_warps in WARPS
    if cfg.block_t >= 16:  # a tensor-core dot: 16 x 16 tiles at least
        assert cfg.block_n >= 16 and (
            cfg.block_k == 0 or (_pow2(cfg.block_k) and cfg.block_k >= 16)
        )


def _check_qkv(cfg: qkv_rope.QKVRopeConfig, shape: Mapping[str, int], key: str) -> None:
    assert _pow2(cfg.block_t) and cfg.num_warps in WARPS
    assert cfg.block_k == 0 or (_pow2(cfg.block_k) and cfg.block_k >= 16 and cfg.block_t >= 16)


def _check_norm(cfg: add_rmsnorm.NormConfig, shape: Mapping[str, int], key: str) -> None:
    assert _pow2(cfg.block_t) and _pow2(cfg.block_h) and cfg.num_warps in WARPS
    if cfg.split:  # the split launch's workspace (add_rmsnorm_split.py); LoRA steps only
        assert shape["rank"] > 0 and shape["tokens"] <= MAX_ROWS
        assert -(-shape["hidden"] // cfg.block_h) <= MAX_CHUNKS


def _check_fp8_linear(cfg: fp8_linear.Fp8LinearConfig, s: Mapping[str, int], key: str) -> None:
    assert all(_pow2(v) for v in (cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k))
    assert cfg.block_m == s["block_m"] and cfg.block_n >= 16 and cfg.block_k >= 16
    assert cfg.num_warps in WARPS and 1 <= cfg.num_stages <= 4
    assert s["group"] == s["k"] or s["group"] % cfg.block_k == 0
    assert cfg.split_k == 1 or s["k"] % (cfg.split_k * cfg.block_k) == 0
    assert fp8_linear.smem_bytes(cfg) <= _smem_limit(key), cfg


def _check_gemv(cfg: fp8_gemv.Fp8GemvConfig, s: Mapping[str, int], key: str) -> None:
    assert all(_pow2(v) for v in (cfg.block_n, cfg.block_k, cfg.split_k, cfg.unroll))
    assert cfg.num_warps in WARPS and cfg.num_stages >= 1
    assert s["group"] == s["k"] or s["group"] % cfg.block_k == 0
    assert cfg.split_k == 1 or s["k"] % (cfg.split_k * cfg.block_k) == 0


def _check_shrink(cfg: triton_shrink.ShrinkConfig, s: Mapping[str, int], key: str) -> None:
    assert all(_pow2(v) for v in (cfg.block_m, cfg.block_r, cfg.block_k, cfg.split_k))
    assert cfg.block_m >= 16 and cfg.block_k >= 16 and cfg.num_warps in WARPS  # tl.dot tiles
    assert cfg.block_r >= max(16, s["rank"])  # every rank row of A in one tile
    assert 1 <= cfg.split_k <= 64
    assert triton_shrink.smem_bytes(cfg) <= _smem_limit(key), cfg


def _check_expand(cfg: triton_expand.ExpandConfig, s: Mapping[str, int], key: str) -> None:
    assert all(_pow2(v) for v in (cfg.block_m, cfg.block_n, cfg.block_r))
    assert cfg.block_m >= 16 and cfg.block_n >= 16 and cfg.block_r >= 16
    assert cfg.num_warps in WARPS and 1 <= cfg.num_stages <= 4


def _check_expert_lora(
    cfg: triton_expert_lora.ExpertLoRAConfig, s: Mapping[str, int], key: str
) -> None:
    assert all(_pow2(v) and v >= 16 for v in (cfg.block_c, cfg.block_k, cfg.block_n))
    assert cfg.num_warps in WARPS and 1 <= cfg.num_stages <= 4
    assert cfg.smem_bytes(s["block_m"]) <= _smem_limit(key), cfg


def _check_tiles(cfg: pa.Tiles, shape: Mapping[str, int], key: str) -> None:
    assert _pow2(cfg.block_n) and cfg.block_n >= 16
    assert cfg.parts is None or _pow2(cfg.parts)
    assert cfg.block_m == 0 or (_pow2(cfg.block_m) and cfg.block_m >= 16)


TABLES: dict[str, tuple[LaunchTable, list[dict[str, int]], Callable]] = {
    "silu_mul": (silu_mul.SILU_MUL_CONFIGS, EPILOGUE_SHAPES, _check_silu),
    "qkv_rope": (qkv_rope.QKV_ROPE_CONFIGS, EPILOGUE_SHAPES, _check_qkv),
    "add_rmsnorm": (add_rmsnorm.NORM_CONFIGS, NORM_SHAPES, _check_norm),
    "fp8_linear": (fp8_linear.FP8_LINEAR_CONFIGS, FP8_SHAPES, _check_fp8_linear),
    "fp8_gemv": (fp8_gemv.FP8_GEMV_CONFIGS, GEMV_SHAPES, _check_gemv),
    "lora_shrink": (triton_shrink.SHRINK_CONFIGS, SGMV_SHAPES, _check_shrink),
    "lora_expand": (triton_expand.EXPAND_CONFIGS, EXPAND_SHAPES, _check_expand),
    "moe_expert_lora": (
        triton_expert_lora.EXPERT_LORA_CONFIGS,
        EXPERT_LORA_SHAPES,
        _check_expert_lora,
    ),
    "attention_decode": (pa.DECODE_TILES, DECODE_SHAPES, _check_tiles),
    "attention_prefill": (pa.PREFILL_TILES, PREFILL_SHAPES, _check_tiles),
}


@pytest.mark.parametrize("name", list(TABLES))
def test_every_rule_gives_a_config_its_kernel_takes(name: str) -> None:
    """Each rule of each device entry, over the grid's shapes it covers (a measured row where
    it declines is skipped: the next rule answers), and every lookup finds a config."""
    table, shapes, check = TABLES[name]
    assert GENERIC in table.entries
    for key, rules in table.entries.items():
        for rule in rules:
            covered = [s for s in shapes if rule.matches(s)]
            assert covered or rule.bounds, f"{name}[{key}] {rule}: no shape of the grid"
            for shape in covered:
                cfg = rule.resolve(shape)
                if cfg is not None:
                    check(cfg, shape, key)
        for shape in shapes:
            check(table._first(key, shape), shape, key)


def test_unknown_devices_use_the_generic_entry(monkeypatch) -> None:
    assert device_key(None) == GENERIC and device_key("cpu") == "cpu"
    assert device_key(torch.device("meta")) == "meta"
    for table, _, _ in TABLES.values():
        assert table.rules("cpu") is table.entries[GENERIC]
        assert table.rules("sm75") is table.entries[GENERIC]
    monkeypatch.setattr(launch_table, "_num_sms", lambda index: 132)
    for key in ("sm120", "sm80", "sm90"):
        monkeypatch.setattr(launch_table, "_cuda_key", lambda index, key=key: key)
        assert device_key("cuda:0") == key
        got = fp8_linear.fp8_linear_config(32, 4096, 4096, 4096, "cuda:0")
        if key == "sm90":  # the measured row
            assert got == fp8_linear.CONFIGS[(4096, 4096, 32)]
        else:  # the generic rule: the CPU's lookup (same SM count), within its budget
            assert got == fp8_linear.fp8_linear_config(32, 4096, 4096, 4096, "cpu")
            assert fp8_linear.smem_bytes(got) <= GENERIC_SMEM_BYTES
            assert got != fp8_linear.CONFIGS[(4096, 4096, 32)]


def test_sm90_rows_keep_the_measured_choices(monkeypatch) -> None:
    """Spot values of the H100 / H200 rows (decode figures were measured with them; the SGMV
    shrink / expand ones are the values of the heuristics they replaced)."""
    monkeypatch.setattr(launch_table, "_cuda_key", lambda index: "sm90")
    monkeypatch.setattr(launch_table, "_num_sms", lambda index: 132)
    dev = "cuda:0"
    assert silu_mul.silu_mul_config(32, 8, 64, dev) == silu_mul.SiluMulConfig(16, 128, 4)
    assert silu_mul.silu_mul_config(64, 8, 64, dev) == silu_mul.SiluMulConfig(16, 128, 4, 32)
    assert silu_mul.silu_mul_config(8, 8, 16, dev) == silu_mul.SiluMulConfig(16, 64, 4, 64)
    assert silu_mul.silu_mul_config(128, 32, 16, dev) == silu_mul.SiluMulConfig(64, 128, 4, 64)
    assert silu_mul.silu_mul_config(128, 0, 16, dev) == silu_mul.SiluMulConfig(16, 128, 8)
    assert qkv_rope.qkv_rope_config(32, 8, 64, dev) == qkv_rope.QKVRopeConfig(2, 4)
    assert qkv_rope.qkv_rope_config(128, 32, 16, dev) == qkv_rope.QKVRopeConfig(16, 4, 32)
    assert qkv_rope.qkv_rope_config(64, 32, 16, dev) == qkv_rope.QKVRopeConfig(16, 4, 64)
    assert qkv_rope.qkv_rope_config(16, 0, 16, dev) == qkv_rope.QKVRopeConfig(1, 4)
    norm = add_rmsnorm.NormConfig
    assert add_rmsnorm.norm_config(32, 4096, 64, dev) == norm(1, 1024, 8, split=True)
    assert add_rmsnorm.norm_config(64, 4096, 64, dev) == norm(2, 1024, 8, split=True)
    assert add_rmsnorm.norm_config(64, 4096, 16, dev) == norm(1, 4096, 16)
    assert add_rmsnorm.norm_config(64, 576, 0, dev) == norm(1, 1024, 8)
    assert add_rmsnorm.norm_config(512, 4096, 64, dev) == norm(4, 64, 4)
    for (n, k, bm), cfg in fp8_linear.CONFIGS.items():
        assert fp8_linear.fp8_linear_config(bm, n, k, k, dev) == cfg
    for (n, k, t), cfg in fp8_gemv.GEMV_CONFIGS.items():
        assert fp8_gemv.fp8_gemv_config(t, n, k, k, 0, dev) == cfg
    assert pa.decode_tiles(32, 8, 4096, 132, device=dev) == (128, 1)
    assert pa.decode_tiles(16, 8, 4096, 132, device=dev) == (64, 4)
    assert pa.decode_tiles(32, 8, 4096, 132, head_dim=256, device=dev) == (32, 2)
    shrink, expand = triton_shrink.ShrinkConfig, triton_expand.ExpandConfig
    assert triton_shrink.shrink_config(1, 8, 3, 4096, 16, dev) == shrink(16, 16, 64, 16, 4)
    assert triton_shrink.shrink_config(64, 8, 1, 4096, 64, dev) == shrink(64, 64, 32, 32, 8)
    assert triton_shrink.shrink_config(512, 32, 3, 4096, 16, dev) == shrink(64, 16, 64, 1, 8)
    assert triton_expand.expand_config(1, 8, 3, 4096, dev) == expand(16, 128, 16)
    assert triton_expand.expand_config(64, 32, 1, 14336, dev) == expand(32, 128, 16)
    lora = triton_expert_lora.ExpertLoRAConfig
    assert triton_expert_lora.expert_lora_config(16, 32, dev, 8) == lora(16, 256, 64, 4, 3)
    assert triton_expert_lora.expert_lora_config(16, 16, dev, 512) == lora(32, 256, 256, 4, 3)
    assert triton_expert_lora.expert_lora_config(16, 32, dev, 64) == lora(16, 256, 128, 4, 3)
    assert triton_expert_lora.expert_lora_config(16, 16, dev, 64) == lora(16, 256, 256, 4, 3)
    assert triton_expert_lora.expert_lora_config(16, 64, dev, 64) == lora(16, 256, 64, 4, 3)
    assert triton_expert_lora.expert_lora_config(64, 32, dev, 8192) == lora(32, 64, 64, 4, 2)


def test_sgmv_tiles_shrink_to_the_generic_budget_only_past_rank_256() -> None:
    """The generic shrink tiles equal the sm_90 ones up to rank 256 (float32 included), and
    narrow their K (then M) tiles beyond, where sm_90's would ask more than 96 KB."""
    sm90, generic = (
        triton_shrink.SHRINK_CONFIGS.entries["sm90"],
        triton_shrink.SHRINK_CONFIGS.entries[GENERIC],
    )
    for shape in SGMV_SHAPES:
        a, b = sm90[0].resolve(shape), generic[0].resolve(shape)
        if shape["rank"] <= 256:
            assert a == b
        else:
            assert triton_shrink.smem_bytes(a) > GENERIC_SMEM_BYTES >= triton_shrink.smem_bytes(b)


def test_a_table_needs_a_generic_entry_and_a_last_rule_for_every_shape() -> None:
    with pytest.raises(ValueError, match="generic"):
        LaunchTable("k", {"sm90": (Rule(1),)})
    with pytest.raises(ValueError, match="last rule"):
        LaunchTable("k", {GENERIC: (Rule(1, tokens=(None, 8)),)})
    table = LaunchTable("k", {GENERIC: (Rule(lambda s: None, tokens=(None, 8)), Rule(2))})
    assert table.pick(None, tokens=4) == 2  # a rule that declines: the next one answers
    assert table.pick("cpu", tokens=4) == 2
