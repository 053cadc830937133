"""Tensor parallelism (engine/model/tp.py): which rows / columns each rank holds, and TP = 2
and 4 on CPU (gloo over 127.0.0.1, spawned ranks) against TP = 1, mixed adapters in a batch."""

from __future__ import annotations

import dataclasses
import socket

import pytest
import torch
import torch.multiprocessing as mp

from loraplex.engine.model.tp import (
    TensorParallelError,
    TPShard,
    shard_config,
    shard_lora,
    shard_tensor,
    vocab_range,
)
from tests.helpers.models import make_peft_adapter, make_tiny_model
from tests.helpers.tp import CFG
from tests.model import tp_run


def _gather(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return torch.cat(parts, dim=dim)


@pytest.mark.parametrize("size", [2, 4, 8])
def test_shards_put_back_together_are_the_checkpoint(size: int) -> None:
    g = torch.Generator().manual_seed(size)
    shards = [TPShard(r, size) for r in range(size)]
    q = torch.randn(CFG.q_size, 64, generator=g)
    k = torch.randn(CFG.kv_size, 64, generator=g)
    gate = torch.randn(96, 64, generator=g)
    o = torch.randn(64, CFG.q_size, generator=g)
    down = torch.randn(64, 96, generator=g)
    emb = torch.randn(250, 64, generator=g)
    key = "model.layers.0.{}.weight"
    for name, w, dim in [
        ("self_attn.q_proj", q, 0), ("mlp.gate_proj", gate, 0),
        ("self_attn.o_proj", o, 1), ("mlp.down_proj", down, 1),
    ]:  # fmt: skip
        parts = [shard_tensor(key.format(name), w, CFG, s) for s in shards]
        torch.testing.assert_close(_gather(parts, dim), w)
    parts = [shard_tensor("model.embed_tokens.weight", emb, CFG, s) for s in shards]
    per = vocab_range(250, shards[0])[2]
    assert all(p.shape == (per, 64) for p in parts)
    torch.testing.assert_close(_gather(parts, 0)[:250], emb)
    assert not _gather(parts, 0)[250:].any()  # padding rows stay zero
    kv = [shard_tensor(key.format("self_attn.k_proj"), k, CFG, s) for s in shards]
    if size <= CFG.num_kv_heads:
        torch.testing.assert_close(_gather(kv, 0), k)
    else:  # GQA: each KV head on the ranks whose query heads read it
        for r, part in enumerate(kv):
            q_head = r * CFG.num_heads // size
            head = q_head // (CFG.num_heads // CFG.num_kv_heads)
            torch.testing.assert_close(part, k[head * 8 : (head + 1) * 8])
    local = shard_config(CFG, shards[1])
    assert local.q_size == CFG.q_size // size and local.intermediate_size == 96 // size
    assert local.vocab_size == per and local.hidden_size == 64
    bias = torch.randn(64, generator=g)
    parts = [shard_tensor("model.layers.0.self_attn.o_proj.bias", bias, CFG, s) for s in shards]
    torch.testing.assert_close(sum(parts), bias)  # row-parallel bias: added once


def test_lora_shards_give_the_full_delta() -> None:
    """Column-parallel: A whole, B rows; row-parallel: A columns, B whole: summed partials."""
    g = torch.Generator().manual_seed(0)
    shards = [TPShard(r, 2) for r in range(2)]
    x = torch.randn(3, 64, generator=g)
    a, b = torch.randn(4, 64, generator=g), torch.randn(CFG.q_size, 4, generator=g)
    parts = [shard_lora("q_proj", a, b, CFG, s) for s in shards]
    got = torch.cat([x @ pa.t() @ pb.t() for pa, pb in parts], dim=1)
    torch.testing.assert_close(got, x @ a.t() @ b.t())
    xo = torch.randn(3, CFG.q_size, generator=g)
    a, b = torch.randn(4, CFG.q_size, generator=g), torch.randn(64, 4, generator=g)
    parts = [shard_lora("o_proj", a, b, CFG, s) for s in shards]
    xs = xo.chunk(2, dim=1)
    got = sum(xi @ pa.t() @ pb.t() for xi, (pa, pb) in zip(xs, parts, strict=True))
    torch.testing.assert_close(got, xo @ a.t() @ b.t())


def test_models_that_do_not_split_are_refused() -> None:
    with pytest.raises(TensorParallelError, match="heads"):
        shard_config(CFG, TPShard(0, 3))
    with pytest.raises(TensorParallelError, match="KV heads"):
        shard_config(dataclasses.replace(CFG, num_kv_heads=3, num_heads=12), TPShard(0, 2))
    with pytest.raises(TensorParallelError, match="intermediate"):
        shard_config(dataclasses.replace(CFG, intermediate_size=97), TPShard(0, 2))
    with pytest.raises(TensorParallelError):
        TPShard(2, 2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    out = {}
    for kind, extra in (("llama", dict(vocab_size=251)), ("qwen2", {})):  # padded vocab; tied
        model_dir = make_tiny_model(root / kind, kind=kind, seed=3, **extra)
        adapters = {
            "a": make_peft_adapter(model_dir, root / f"{kind}-a", seed=4, r=8, alpha=16,
                                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                   "gate_proj", "up_proj", "down_proj"]),
            "b": make_peft_adapter(model_dir, root / f"{kind}-b", seed=5, r=4, alpha=8,
                                   target_modules=["v_proj", "o_proj", "down_proj"]),
        }  # fmt: skip
        out[kind] = (str(model_dir), {k: str(v) for k, v in adapters.items()})
    return root, out


@pytest.mark.parametrize(
    "kind,size,fused", [("llama", 2, False), ("qwen2", 4, False), ("llama", 2, True)]
)
def test_tp_logits_equal_tp1(tiny, kind: str, size: int, fused: bool) -> None:
    """TP = size over gloo against one process, float32: prefill and two decode steps of a
    batch with two adapters (ranks 8 and 4, different modules) and base rows. qwen2: tied
    embeddings, qkv bias; at 4 ranks its 2 KV heads are replicated. ``fused``: the GPU forward
    (augmented GEMMs; shrink partials all-reduced with the base output) with torch epilogues."""
    root, models = tiny
    model_dir, adapters = models[kind]
    ref = root / f"{kind}-tp1-{fused}.pt"
    tp_run.run(0, 1, 0, model_dir, adapters, str(ref), fused)
    got = root / f"{kind}-tp{size}-{fused}.pt"
    mp.start_processes(
        tp_run.run, args=(size, _free_port(), model_dir, adapters, str(got), fused),
        nprocs=size, join=True, start_method="spawn",
    )  # fmt: skip
    want, have = torch.load(ref), torch.load(got)
    assert len(have) == len(want) == 1 + len(tp_run.DECODE)
    for step, (a, b) in enumerate(zip(have, want, strict=True)):
        assert a.shape == b.shape
        err = ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()
        assert err < 1e-5, f"step {step}: relative error {err:.2e}"
    same, base = want[0][0], want[0][3]  # one prompt with and without adapter "a"
    assert ((same - base).norm() / base.norm()).item() > 1e-2
