"""``loraplex serve ... --dry-run``: the memory estimate, without loading (or downloading) weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraplex.engine.config import EngineConfig
from loraplex.engine.server.cli import main
from loraplex.engine.server.memory_estimate import estimate_memory, format_table
from loraplex.engine.server.model_files import local_metadata
from tests.server.fake_hub import (  # noqa: F401 - fixtures
    FakeHub,
    hub_fixture,
    quiet_logging_fixture,
    tiny_files_fixture,
)


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to load weights or start an engine fails the test."""

    def refuse(*args: object, **kw: object) -> None:
        raise AssertionError("a --dry-run loaded weights")

    monkeypatch.setattr("loraplex.engine.startup.build_core", refuse)
    monkeypatch.setattr("loraplex.engine.model.loader.load_model", refuse)
    monkeypatch.setattr("safetensors.safe_open", refuse)


def test_demo_dry_run_prints_the_table(
    capsys: pytest.CaptureFixture, no_weights: None, quiet_logging: None
) -> None:
    args = ["serve", "--dry-run", "--device", "cpu", "--max-num-seqs", "8",
            "--max-model-len", "256", "--max-loras", "2"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    for row in ("model", "parameters", "weights", "KV cache per token", "KV cache", "LoRA slots",
                "total CPU memory", "fp8"):  # fmt: skip
        assert f"\n  {row} " in out, row
    assert "demo" in out and "compute capability >= 8.9" in out
    # the demo: 4 layers x 2 KV heads x head dim 32 x (K, V) x 4 bytes (float32 on CPU)
    assert "KV cache per token       2.00 KiB" in out
    assert "4.00 MiB for 8 sequences x 256 tokens" in out


def test_estimate_matches_what_the_engine_allocates(tmp_path: Path) -> None:
    """Weights, LoRA slots and buffers as estimated == the bytes of a loaded model."""
    from loraplex.engine.model.loader import load_model
    from tests.helpers.models import make_tiny_model

    folder = make_tiny_model(tmp_path / "m", kind="qwen2", seed=1)  # tied embeddings, biases
    config = EngineConfig(model=str(folder), device="cpu", dtype="float32", max_loras=3,
                          max_cpu_loras=3, max_lora_rank=8)  # fmt: skip
    est = estimate_memory(local_metadata(folder), config, "m")
    model = load_model(folder, dtype=torch.float32, device="cpu", max_loras=3, max_lora_rank=8)
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    allocated = sum(t.numel() * t.element_size() for t in tensors.values())
    estimated = est.weight_bytes + est.lora_bytes + est.buffer_bytes
    assert abs(allocated - estimated) <= 0.005 * allocated, (allocated, estimated)
    # the LoRA slots exactly: every A and B buffer of the projections and vocab targets
    lins = {id(v): v for _, by in model.lora_linears() for v in by.values()}
    lins.update({id(v): v for v in model.lora_vocab().values()})
    lora = sum((v.lora_a.numel() + v.lora_b.numel()) * 4 for v in lins.values())
    assert est.lora_bytes == lora
    assert est.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # layers x KV heads x head dim x K,V


def test_load_buffers_counted_where_loads_run_in_threads(tmp_path: Path) -> None:
    """A CPU engine loads adapters in its own threads: the chunk buffers its passes keep
    (pass_chunks.py) are a row; with loader processes, or without LoRA slots, there is none."""
    from loraplex.engine.adapters import pass_chunks
    from tests.helpers.models import make_tiny_model

    folder = make_tiny_model(tmp_path / "m", kind="llama", seed=1)
    meta = local_metadata(folder)

    def est(**kw):
        return estimate_memory(meta, EngineConfig(model=str(folder), device="cpu", **kw), "m")

    threads = est(max_loras=2, max_concurrent_loads=3)  # each load keeps its own chunks
    assert threads.load_buffer_bytes >= 3 * pass_chunks.RETAIN_BYTES
    assert est(max_loras=2, max_concurrent_loads=1).load_buffer_bytes < threads.load_buffer_bytes
    assert "\n  load buffers " in "\n" + format_table(threads)
    assert est(max_loras=2, loader_processes=1).load_buffer_bytes == 0
    assert est(max_loras=0).load_buffer_bytes == 0


def test_fp8_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from tests.helpers.models import make_tiny_model

    folder = make_tiny_model(tmp_path / "m", seed=2)
    meta = local_metadata(folder)
    plain = estimate_memory(meta, EngineConfig(model=str(folder), device="cuda"), "m")
    fp8 = estimate_memory(
        meta, EngineConfig(model=str(folder), device="cuda", quantization="fp8"), "m"
    )
    assert plain.dtype == "bfloat16"  # a float32 checkpoint on CUDA
    assert fp8.fp8 == "on load" and fp8.weight_bytes < plain.weight_bytes < fp8.load_bytes
    assert fp8.weight_bytes == plain.fp8_weight_bytes
    assert fp8.total_bytes >= fp8.load_bytes + fp8.lora_bytes + fp8.headroom_bytes
    table = format_table(fp8)
    assert "weights while loading" in table and "compute capability >= 8.9" in table

    # this machine's GPU, when there is one: whether the total fits and it has fp8 kernels
    for cap, has in (((8, 0), "has not"), ((9, 0), "has them")):
        props = SimpleNamespace(name="GPU-X", major=cap[0], minor=cap[1], total_memory=80 << 30)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index, p=props: p)
        est = estimate_memory(
            meta, EngineConfig(model=str(folder), device="cuda", quantization="fp8"), "m"
        )
        table = format_table(est)
        assert (
            "GPU-X, 80.00 GiB: fits" in table
            and f"this GPU (GPU-X, {cap[0]}.{cap[1]}) {has}" in table
        )


def test_hub_dry_run_reads_only_config_and_headers(
    hub: FakeHub, tiny_files: dict[str, bytes], tmp_path: Path, capsys: pytest.CaptureFixture,
    no_weights: None, quiet_logging: None,
) -> None:  # fmt: skip
    sha = hub.commit("org/tiny", tiny_files)
    assert main(["serve", "org/tiny", "--dry-run", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"org/tiny  (hf://org/tiny@{sha})" in out and "3 safetensors file(s)" in out
    whole = sorted(p.rsplit("/", 1)[-1] for p in hub.downloads())
    assert whole == ["config.json", "model.safetensors.index.json"]
    assert len({p for p in hub.ranged()}) == 3  # one header read per shard
    cache = tmp_path / "hf-home" / "hub"
    assert not [p for p in cache.rglob("*.safetensors")]

    # the same numbers as from the downloaded folder
    local = tmp_path / "local"
    local.mkdir()
    for name, data in tiny_files.items():
        if "/" not in name:
            (local / name).write_bytes(data)
    assert main(["serve", str(local), "--dry-run", "--device", "cpu"]) == 0
    rows = lambda text: [ln for ln in text.splitlines() if "KV" in ln or "weights" in ln]  # noqa: E731
    assert rows(capsys.readouterr().out) == rows(out)

    assert main(["serve", "org/absent", "--dry-run", "--device", "cpu"]) == 2


def test_moe_estimate_counts_the_expert_lora_slots(tmp_path: Path) -> None:
    """A MoE model's slots carry expert LoRA storage in every sparse layer: the estimate's LoRA
    bytes equal every slot buffer of the loaded model, the experts' included, and the table
    says how much of a slot the experts take."""
    from loraplex.engine.model.loader import load_model
    from loraplex.engine.model.moe.expert_lora import ExpertLoRA
    from tests.helpers.moe_models import make_tiny_moe

    folder = make_tiny_moe(tmp_path / "moe", "qwen3_moe", seed=1)
    config = EngineConfig(model=str(folder), device="cpu", dtype="float32", max_loras=2,
                          max_cpu_loras=2, max_lora_rank=4)  # fmt: skip
    est = estimate_memory(local_metadata(folder), config, "m")
    model = load_model(folder, dtype=torch.float32, device="cpu", max_loras=2, max_lora_rank=4)
    lins = {id(v): v for _, by in model.lora_linears() for v in by.values()}
    lins.update({id(v): v for v in model.lora_vocab().values()})
    dense = sum((v.lora_a.numel() + v.lora_b.numel()) * 4 for v in lins.values())
    experts = [m for m in model.modules() if isinstance(m, ExpertLoRA)]
    assert experts  # the tiny model has sparse layers
    expert_bytes = sum(m.slot_bytes for m in experts) * 2
    assert est.expert_slot_bytes * 2 == expert_bytes
    assert est.lora_bytes == dense + expert_bytes
    assert "of it the experts" in format_table(est)


def test_moe_estimate_counts_only_the_expert_capable_slots(tmp_path: Path) -> None:
    """--max-expert-loras 1 of 3 slots: the estimate's LoRA bytes equal the loaded model's
    buffers (every slot's dense LoRA, the experts' storage in one slot), and the table says
    so."""
    from loraplex.engine.model.loader import load_model
    from loraplex.engine.model.moe.expert_lora import ExpertLoRA
    from tests.helpers.moe_models import make_tiny_moe

    folder = make_tiny_moe(tmp_path / "moe", "qwen3_moe", seed=1)
    kw = dict(max_loras=3, max_lora_rank=4)
    config = EngineConfig(model=str(folder), device="cpu", dtype="float32", max_cpu_loras=3,
                          max_expert_loras=1, **kw)  # fmt: skip
    est = estimate_memory(local_metadata(folder), config, "m")
    model = load_model(folder, dtype=torch.float32, device="cpu", max_expert_loras=1, **kw)
    lins = {id(v): v for _, by in model.lora_linears() for v in by.values()}
    lins.update({id(v): v for v in model.lora_vocab().values()})
    dense = sum((v.lora_a.numel() + v.lora_b.numel()) * 4 for v in lins.values())
    experts = [m for m in model.modules() if isinstance(m, ExpertLoRA)]
    assert experts and all(m.a_down.shape[0] == 1 for m in experts)
    expert_bytes = sum(m.slot_bytes for m in experts)
    assert est.expert_slot_bytes == expert_bytes
    assert est.lora_bytes == dense + expert_bytes
    assert "1 (--max-expert-loras)" in format_table(est)
    none = EngineConfig(model=str(folder), device="cpu", dtype="float32", max_cpu_loras=3,
                        max_expert_loras=0, **kw)  # fmt: skip
    assert estimate_memory(local_metadata(folder), none, "m").lora_bytes == dense


def test_draft_model_is_counted(tmp_path: Path) -> None:
    """--speculative-method draft: the draft's weights (at the served dtype) and its KV cache
    for the KV line's tokens plus K drafted ones per sequence are in the estimate and its
    total."""
    from loraplex.engine.spec.draft import draft_kv_blocks
    from tests.helpers.models import make_tiny_model

    target = make_tiny_model(tmp_path / "t", kind="llama", seed=1)
    draft = make_tiny_model(tmp_path / "d", kind="llama", seed=2, num_hidden_layers=1)
    kw = dict(model=str(target), device="cpu", dtype="float32", max_loras=1, max_num_seqs=4,
              max_model_len=64, block_size=16)  # fmt: skip
    plain = estimate_memory(local_metadata(target), EngineConfig(**kw), "m")
    spec = EngineConfig(**kw, speculative_method="draft", speculative_model=str(draft))
    est = estimate_memory(local_metadata(target), spec, "m")
    weights = sum(t.numel * 4 for t in local_metadata(draft).tensors)
    assert est.draft_weight_bytes == weights
    # the tiny draft: 1 layer x 2 KV heads x head dim 16 x (K, V) x 4 bytes a token
    blocks = draft_kv_blocks(4 * 64, 16, 4, 4)
    assert est.draft_kv_bytes == blocks * 16 * 1 * 2 * 16 * 2 * 4
    assert est.total_bytes == plain.total_bytes + weights + est.draft_kv_bytes
    assert "draft model" in format_table(est) and "draft model" not in format_table(plain)
