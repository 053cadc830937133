"""MoE bases through the engine: a tiny Qwen3-MoE and Mixtral served with attention-only
adapters, greedy streams identical to HF + PEFT's one request at a time; expert-targeting
adapters with bad inputs (router targets, a wrong expert count) refused at registration with a
typed error naming the field."""

from __future__ import annotations

import asyncio

import pytest
import torch

from loraplex.engine import AsyncEngine, SamplingParams
from loraplex.engine.adapters.parse import load_adapter
from loraplex.engine.errors import AdapterShapeError, AdapterTargetError
from loraplex.engine.model.config import ModelConfig
from tests.helpers.engine import assert_idle, collect, config, register
from tests.helpers.models import copy_adapter, make_peft_adapter, write_adapter
from tests.helpers.moe_models import MOE_KINDS, make_expert_adapter, make_tiny_moe, to_per_expert
from tests.helpers.peft_oracle import HFReference, compare
from tests.helpers.tokenizers import make_tokenizer

pytest.importorskip("peft")

PROMPTS = [[5, 17, 33, 9], [60, 2, 7, 81, 99, 4, 12], [40]]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=list(MOE_KINDS))
def moe(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model_dir = make_tiny_moe(root / "base", request.param, seed=4)
    make_tokenizer(model_dir)
    adapters = {
        "attn": make_peft_adapter(model_dir, root / "attn", r=4, alpha=8, seed=20),
        "qv": make_peft_adapter(
            model_dir, root / "qv", r=8, alpha=16, target_modules=["q_proj", "v_proj"], seed=21
        ),
    }
    return request.param, model_dir, adapters


async def test_moe_engine_streams_match_hf_peft(moe):
    kind, model_dir, adapters = moe
    ref = HFReference(model_dir, adapters)
    async with AsyncEngine(config(model_dir)) as engine:
        await register(engine, adapters)
        jobs = [(p, a) for p in PROMPTS for a in (None, *adapters)]
        outs = await asyncio.gather(*(collect(engine, p, PARAMS, adapter=a) for p, a in jobs))
        for (prompt, adapter), (tokens, _, _) in zip(jobs, outs, strict=True):
            want, gaps = ref.greedy(prompt, adapter, PARAMS.max_tokens)
            compare(tokens, want, gaps)
        assert_idle(engine)


def _config(**kw) -> dict:
    return dict(peft_type="LORA", r=4, lora_alpha=8, bias="none", **kw)


async def test_expert_adapters_stream_like_hf_peft(moe, tmp_path):
    """Expert adapters in both layouts (the per-expert one's oracle: PEFT on the same weights
    in the fused form) registered and served next to base rows and attention-only adapters."""
    kind, model_dir, adapters = moe
    fused = make_expert_adapter(
        model_dir, tmp_path / "fused", r=4, alpha=8, target_modules=["q_proj"], seed=30
    )
    twin = make_expert_adapter(model_dir, tmp_path / "twin", r=8, alpha=16, seed=31)
    per = to_per_expert(twin, tmp_path / "per", kind)
    refs = {"attn": adapters["attn"], "fused": fused, "per": twin}
    served = {"attn": adapters["attn"], "fused": fused, "per": per}
    async with AsyncEngine(config(model_dir)) as engine:
        await register(engine, served)
        jobs = [(p, a) for p in PROMPTS for a in (None, *served)]
        outs = await asyncio.gather(*(collect(engine, p, PARAMS, adapter=a) for p, a in jobs))
        for (prompt, adapter), (tokens, _, _) in zip(jobs, outs, strict=True):
            ref = HFReference(model_dir, {adapter or "attn": refs[adapter or "attn"]})
            want, gaps = ref.greedy(prompt, adapter, PARAMS.max_tokens)
            compare(tokens, want, gaps)
        assert_idle(engine)


async def test_bad_expert_adapters_are_refused_at_registration(moe, tmp_path):
    """Router targets and a wrong expert count: a typed error naming the field, nothing
    registered (the parser's own refusals: tests/adapters/test_expert_adapters.py)."""
    kind, model_dir, adapters = moe
    experts = MOE_KINDS[kind][1].get("num_experts", MOE_KINDS[kind][1].get("num_local_experts"))
    width = MOE_KINDS[kind][1].get("moe_intermediate_size", 48)
    key = "base_model.model.model.layers.0.mlp.experts"
    wrong = {  # rank 4 for one expert more than the base has
        f"{key}.lora_A.weight": torch.zeros(4 * (experts + 1), width),
        f"{key}.lora_B.weight": torch.zeros(64, 4 * (experts + 1)),
    }
    cases = [
        (copy_adapter(adapters["attn"], tmp_path / "router",
                      target_parameters=["mlp.gate.weight"]),
         AdapterTargetError, "target_parameters"),
        (copy_adapter(adapters["attn"], tmp_path / "gate", target_modules=["q_proj", "gate"]),
         AdapterTargetError, "target_modules"),
        (write_adapter(tmp_path / "count",
                       _config(target_modules=[], target_parameters=["mlp.experts.down_proj"]),
                       wrong),
         AdapterShapeError, "experts.lora_A"),
    ]  # fmt: skip
    async with AsyncEngine(config(model_dir)) as engine:
        for folder, error, field in cases:
            with pytest.raises(error) as e:
                await engine.add_adapter(folder.name, f"file://{folder}")
            assert field in e.value.field
        assert engine.list_adapters() == []


async def test_dense_mlp_tensors_on_a_sparse_layer_are_refused(moe, tmp_path):
    """A crafted adapter with ``mlp.gate_proj`` tensors on a layer that has experts instead."""
    kind, model_dir, _ = moe
    key = "base_model.model.model.layers.0.mlp.gate_proj"
    bad = write_adapter(
        tmp_path / "bad", _config(target_modules=["q_proj", "gate_proj"]),
        {f"{key}.lora_A.weight": torch.zeros(4, 64), f"{key}.lora_B.weight": torch.zeros(96, 4)},
    )  # fmt: skip
    async with AsyncEngine(config(model_dir)) as engine:
        with pytest.raises(AdapterTargetError, match="gate_proj"):
            await engine.add_adapter("bad", f"file://{bad}")


def test_the_parser_refuses_dense_mlp_tensors_on_a_sparse_layer_too(moe, tmp_path):
    """The same adapter straight into the parser (its own header checks, which a stage runs
    without the preflight): the typed error, not a KeyError."""
    kind, model_dir, _ = moe
    key = "base_model.model.model.layers.0.mlp.gate_proj"
    bad = write_adapter(
        tmp_path / "bad", _config(target_modules=["q_proj", "gate_proj"]),
        {f"{key}.lora_A.weight": torch.zeros(4, 64), f"{key}.lora_B.weight": torch.zeros(96, 4)},
    )  # fmt: skip
    mc = ModelConfig.from_dir(model_dir)
    with pytest.raises(AdapterTargetError, match="mixture-of-experts layer"):
        load_adapter(bad, mc, max_lora_rank=16)


async def test_expert_adapters_take_only_expert_capable_slots(moe, tmp_path):
    """max_loras 3, max_expert_loras 1: only slot 0 holds expert storage (the buffers are sized
    1). Two expert adapters take turns in it (eviction among the expert-capable slots) while
    attention-only adapters and base rows run in the same batches; every stream matches PEFT."""
    from loraplex.engine.model.moe.expert_lora import ExpertLoRA

    kind, model_dir, adapters = moe
    fused = make_expert_adapter(
        model_dir, tmp_path / "fused", r=4, alpha=8, target_modules=["q_proj"], seed=30
    )
    twin = make_expert_adapter(model_dir, tmp_path / "twin", r=8, alpha=16, seed=31)
    per = to_per_expert(twin, tmp_path / "per", kind)
    refs = {**adapters, "fused": fused, "per": twin}
    served = {**adapters, "fused": fused, "per": per}
    async with AsyncEngine(config(model_dir, max_loras=3, max_expert_loras=1)) as engine:
        blocks = [m for m in engine.testing.executor.model.modules() if isinstance(m, ExpertLoRA)]
        assert blocks and all(b.a_gate_up.shape[0] == 1 for b in blocks)
        await register(engine, served)
        slots = engine.testing.adapters.registry.slots
        seen: dict[str, set[int]] = {name: set() for name in served}
        done = asyncio.Event()

        async def watch() -> None:  # where each adapter sits while the batches run
            while not done.is_set():
                for name in served:
                    slot = slots.slot_of(engine.testing.adapters.registry.get(name))
                    if slot is not None:
                        seen[name].add(slot)
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        jobs = [(p, a) for p in PROMPTS for a in (None, *served)]
        outs = await asyncio.gather(*(collect(engine, p, PARAMS, adapter=a) for p, a in jobs))
        done.set()
        await watcher
        for (prompt, adapter), (tokens, _, _) in zip(jobs, outs, strict=True):
            ref = HFReference(model_dir, {adapter or "attn": refs[adapter or "attn"]})
            want, gaps = ref.greedy(prompt, adapter, PARAMS.max_tokens)
            compare(tokens, want, gaps)
        assert seen["fused"] == {0} and seen["per"] == {0}
        assert seen["attn"] | seen["qv"] <= {1, 2} and seen["attn"] and seen["qv"]
        assert_idle(engine)


async def test_expert_adapters_are_refused_without_expert_slots(moe, tmp_path):
    """max_expert_loras 0: no expert storage at all; an adapter with LoRA on the experts is a
    typed error naming max_expert_loras at registration, attention-only adapters serve."""
    from loraplex.engine.errors import AdapterConfigError

    kind, model_dir, adapters = moe
    fused = make_expert_adapter(model_dir, tmp_path / "fused", r=4, alpha=8, seed=30)
    async with AsyncEngine(config(model_dir, max_expert_loras=0)) as engine:
        assert engine.testing.executor.model.expert_loras() == []
        with pytest.raises(AdapterConfigError, match="max_expert_loras") as e:
            await engine.add_adapter("fused", f"file://{fused}")
        assert e.value.field == "target_modules"
        await engine.add_adapter("attn", f"file://{adapters['attn']}")
        tokens, _, _ = await collect(engine, PROMPTS[0], PARAMS, adapter="attn")
        want, gaps = HFReference(model_dir, {"attn": adapters["attn"]}).greedy(
            PROMPTS[0], "attn", PARAMS.max_tokens
        )
        compare(tokens, want, gaps)
