"""MoE bases through the engine: a tiny Qwen3-MoE and Mixtral served with attention-only
adapters, greedy streams identical to HF + PEFT's one request at a time; expert-targeting
adapters (issue 42, phase 2) refused at registration with a typed error naming the field."""

from __future__ import annotations

import asyncio

import pytest
import torch

from loraplex.engine import AsyncEngine, SamplingParams
from loraplex.engine.adapters.parse import load_adapter
from loraplex.engine.errors import AdapterConfigError, AdapterTargetError
from loraplex.engine.model.config import ModelConfig
from tests.helpers.engine import assert_idle, collect, config, register
from tests.helpers.models import ATTN_MODULES, copy_adapter, make_peft_adapter, write_adapter
from tests.helpers.moe_models import MOE_KINDS, make_tiny_moe
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


def _expert_keys(kind: str) -> dict[str, torch.Tensor]:
    """An older PEFT adapter's per-expert form (transformers 4 held experts as modules)."""
    parent, proj = ("block_sparse_moe", "w1") if kind == "mixtral" else ("mlp", "gate_proj")
    key = f"base_model.model.model.layers.0.{parent}.experts.1.{proj}"
    width = MOE_KINDS[kind][1].get("moe_intermediate_size", 48)
    return {
        f"{key}.lora_A.weight": torch.zeros(4, 64),
        f"{key}.lora_B.weight": torch.zeros(width, 4),
    }


def _config(**kw) -> dict:
    return dict(peft_type="LORA", r=4, lora_alpha=8, bias="none", **kw)


async def test_expert_adapters_are_refused_at_registration(moe, tmp_path):
    kind, model_dir, adapters = moe
    expert_modules = ["w1", "w2", "w3"] if kind == "mixtral" else ["experts.0.gate_proj"]
    cases = [
        # PEFT's target_parameters form (transformers 5's fused experts)
        (
            copy_adapter(
                adapters["attn"],
                tmp_path / "params",
                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            ),
            AdapterConfigError,
            "target_parameters",
        ),  # fmt: skip
        # the per-expert target_modules form, by module names and by a regex
        (
            copy_adapter(adapters["attn"], tmp_path / "names", target_modules=expert_modules),
            AdapterTargetError,
            "target_modules",
        ),  # fmt: skip
        (
            copy_adapter(adapters["attn"], tmp_path / "regex", target_modules=r".*\.experts\..*"),
            AdapterTargetError,
            "target_modules",
        ),  # fmt: skip
    ]
    async with AsyncEngine(config(model_dir)) as engine:
        for folder, error, field in cases:
            with pytest.raises(error, match=field) as e:
                await engine.add_adapter(folder.name, f"file://{folder}")
            assert e.value.field == field
        # an older adapter's per-expert tensors under a config naming an MLP projection
        # (Qwen3-MoE) or a q / k / v / o one: refused by the tensor's key
        old = write_adapter(
            tmp_path / "old", _config(target_modules=[*ATTN_MODULES, "gate_proj"]),
            _expert_keys(kind),
        )  # fmt: skip
        with pytest.raises(AdapterTargetError, match="experts.1") as e:
            await engine.add_adapter("old", f"file://{old}")
        assert "experts.1" in e.value.field
        assert engine.list_adapters() == []
        await register(engine, {"attn": adapters["attn"]})  # attention-only still registers
        assert [a["name"] for a in engine.list_adapters()] == ["attn"]


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
