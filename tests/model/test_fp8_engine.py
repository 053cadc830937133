"""The fp8 base end to end on CPU: ``AsyncEngine`` with ``quantization="fp8"`` and with a
pre-quantized checkpoint, LoRA rows and base rows in the same steps.

The oracle is HF + PEFT on a float checkpoint holding the de-quantized weights (what the fp8
base computes on CPU); ``loraplex serve --quantization fp8`` reaches the config; on CUDA the
loader warns once that the fp8 GEMMs are not built yet.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from structlog.testing import capture_logs

from loraplex.engine import AsyncEngine, EngineConfig, SamplingParams
from loraplex.engine.model import loader
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.quant import dequantize_fp8, fp8_layers, quantize_fp8
from tests.helpers.fp8 import write_fp8_checkpoint
from tests.helpers.models import ALL_MODULES, make_peft_adapter, make_tiny_model
from tests.helpers.peft_oracle import HFReference, compare

pytest.importorskip("peft")
PROJ = tuple(f".{m}.weight" for m in ALL_MODULES)
NEW = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8e")
    base = make_tiny_model(root / "base", kind="llama", seed=5)
    adapters = {
        "a": make_peft_adapter(base, root / "a", r=8, target_modules=ALL_MODULES, seed=21),
        "b": make_peft_adapter(base, root / "b", r=4, seed=22),
    }
    # the oracle's checkpoint: every projection quantized and de-quantized, in float32
    deq = root / "dequantized"
    deq.mkdir()
    shutil.copy(base / "config.json", deq / "config.json")
    tensors = load_file(base / "model.safetensors")
    for key, w in tensors.items():
        if key.endswith(PROJ):
            q, s = quantize_fp8(w)
            tensors[key] = dequantize_fp8(q, s[:, None], torch.float32)
    save_file(tensors, deq / "model.safetensors")
    write_fp8_checkpoint(base, root / "ct", "ct-channel")  # the same quantizer, published form
    return base, deq, root / "ct", adapters


def _config(model_dir, **kw) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_loras=2,
                        max_cpu_loras=2, max_lora_rank=8, block_size=4,
                        max_num_batched_tokens=32, **kw)  # fmt: skip


def _requests():
    g = random.Random(7)
    names = [None, "a", "b", "a", None, "b", "a", None]
    return [([g.randrange(3, 250) for _ in range(g.randint(2, 20))], n) for n in names]


async def _serve(cfg: EngineConfig, adapters, reqs):
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(cfg) as engine:
        for name, path in adapters.items():
            await engine.add_adapter(name, f"file://{path}")

        async def one(prompt, name):
            tokens = []
            async for out in engine.generate(prompt, params, adapter=name):
                tokens += out.token_ids
            return tokens

        results = await asyncio.gather(*(one(p, n) for p, n in reqs))
        layers = len(fp8_layers(engine.testing.executor.model))
    return results, layers


@pytest.mark.parametrize("source", ["on-load", "checkpoint"])
async def test_fp8_base_with_mixed_lora_rows_matches_hf_peft(setup, source):
    base, deq, ct, adapters = setup
    cfg = _config(base, quantization="fp8") if source == "on-load" else _config(ct)
    reqs = _requests()
    results, layers = await _serve(cfg, adapters, reqs)
    assert layers == 4 * 2, "every projection of both layers must hold fp8 weights"
    hf = HFReference(deq, adapters)
    for (prompt, name), tokens in zip(reqs, results, strict=True):
        ref, gaps = hf.greedy(prompt, name, NEW)
        compare(tokens, ref, gaps)
    # the de-quantized checkpoint served as floats gives the same tokens
    plain, plain_layers = await _serve(_config(deq), adapters, reqs)
    assert plain == results and plain_layers == 0


def test_engine_config_quantization():
    assert EngineConfig().quantization is None
    assert EngineConfig(quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match="quantization must be None or one of fp8, not 'int4'"):
        EngineConfig(quantization="int4")


def test_serve_flag_reaches_the_engine_config():
    from loraplex.engine.server.launch import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert config_from_args(p.parse_args([])).quantization is None
    assert config_from_args(p.parse_args(["--quantization", "fp8"])).quantization == "fp8"
    with pytest.raises(SystemExit):
        p.parse_args(["--quantization", "gptq"])


def test_cuda_load_frees_float_rows_and_says_so(setup, monkeypatch):
    """On CUDA the loader drops the float base rows (the fp8 GEMM reads the fp8 rows) and
    logs one info line; on CPU the rows stay (de-quantized slow path)."""
    base = setup[0]
    model = loader.build_model(ModelConfig.from_dir(base))
    reader = loader._Fp8Reader(model, None, quantize=True)
    monkeypatch.setattr(reader.rows, "attach", lambda device: 8)
    dropped = []
    monkeypatch.setattr(loader, "drop_float_bases", lambda m: dropped.append(m))
    with capture_logs() as logs:
        reader.finish(torch.device("cuda"), torch.bfloat16)
        reader.finish(torch.device("cpu"), torch.float32)
    assert [e["log_level"] for e in logs] == ["info", "info"]
    assert logs[0]["event"] == "fp8_base" and logs[0]["gemm"] == "fp8 (W8A16)"
    assert dropped == [model]
