"""fp8 test helpers: checkpoints written in each published fp8 form (``FORMS``,
``write_fp8_checkpoint``), the mixed-adapter fp8 case of the forward tests (``make_fp8_case``,
``load_fp8``, ``run_fp8_rows``, ``argmax_tokens``, ``rel_norm``) and the CUDA-graph check of the fp8
GEMMs (``assert_graph_matches_eager``)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from loraplex.engine.adapters.parse import load_adapter
from loraplex.engine.model.backend import KernelBackend
from loraplex.engine.model.loader import load_model
from loraplex.engine.model.lora.slot_buffers import write_slot
from loraplex.engine.model.quant import FP8_DTYPE, FP8_MAX, drop_float_bases, quantize_fp8
from loraplex.engine.model_runner import ModelRunner, StepItem
from tests.helpers.models import ALL_MODULES, make_peft_adapter, make_tiny_model

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = (48, 32)  # rows, cols: 48 does not divide 64 or 32 (a partial last block of rows)


def is_proj(key: str, lm_head: bool = False) -> bool:
    return key.endswith(".weight") and (
        key.split(".")[-2] in PROJ or (lm_head and key == "lm_head.weight")
    )


def per_tensor(w):
    s = w.abs().max() / FP8_MAX
    return (w / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s


def per_block(w):
    bn, bk = BLOCK
    rows, cols = w.shape
    grid = torch.empty(-(-rows // bn), cols // bk)
    q = torch.empty(rows, cols, dtype=FP8_DTYPE)
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            tile = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
            grid[i, j] = tile.abs().max() / FP8_MAX
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (tile / grid[i, j]).to(FP8_DTYPE)
    return q, grid


def ct_config(strategy: str, ignore: list[str]) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": strategy,
                    "symmetric": True,
                    "dynamic": False,
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "token",
                    "symmetric": True,
                    "dynamic": True,
                },
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


FORMS = {
    # name: (quantization_config, quantizer, scale key, scale dtype, lm_head quantized too)
    "fp8-tensor": ({"quant_method": "fp8", "activation_scheme": "static"}, per_tensor,
                   "weight_scale", torch.float32, False),
    "fp8-block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                   "weight_block_size": list(BLOCK)}, per_block, "weight_scale_inv",
                  torch.float32, False),
    "ct-channel": (ct_config("channel", ["lm_head"]), lambda w: quantize_fp8(w),
                   "weight_scale", torch.float32, False),
    "ct-tensor": (ct_config("tensor", []), per_tensor, "weight_scale", torch.bfloat16, True),
}  # fmt: skip


def write_fp8_checkpoint(src: Path, out: Path, form: str, *, split_scales: bool = False):
    """``src`` re-written in ``form``; returns {key: (fp8 values, stored scale)}."""
    qc, quantizer, scale_key, scale_dtype, lm_head = FORMS[form]
    tensors = load_file(src / "model.safetensors")
    weights, scales, stored = {}, {}, {}
    for key, w in tensors.items():
        if not is_proj(key, lm_head):
            weights[key] = w
            continue
        q, s = quantizer(w.float())
        if form == "ct-channel":
            s = s[:, None]  # llm-compressor's (out, 1)
        elif form == "ct-tensor":
            s = s.reshape(1)
        s = s.to(scale_dtype)
        weights[key] = q
        scales[key.removesuffix("weight") + scale_key] = s
        stored[key] = (q, s)
        if form == "fp8-tensor":  # a static activation scale, which the loader leaves alone
            scales[key.removesuffix("weight") + "input_scale"] = torch.tensor(1.0)
    out.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg))
    if split_scales:  # scales in another shard than their weights
        save_file(weights, out / "model-00001-of-00002.safetensors")
        save_file(scales, out / "model-00002-of-00002.safetensors")
        names = {k: "model-00001-of-00002.safetensors" for k in weights}
        names.update({k: "model-00002-of-00002.safetensors" for k in scales})
        (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    else:
        save_file({**weights, **scales}, out / "model.safetensors")
    return stored


def assert_graph_matches_eager(x: torch.Tensor, call) -> None:
    """``call()`` (reading ``x``) captured in a CUDA graph: every replay writes the eager
    result bit for bit, also after new inputs are copied into ``x``."""
    eager = call()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        y = call()
    for _ in range(3):
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, eager)
    x.copy_(torch.randn_like(x))  # new inputs through the same graph
    graph.replay()
    assert torch.equal(y, call())


TWINS = KernelBackend(fused=True, triton=False)


NAMES = [None, "a", "b", "a", None, "b"]


STEPS = 4


def make_fp8_case(root):
    """A tiny llama base under ``root`` and two adapters: "a" (rank 8, every module), "b" (rank 4)."""
    base = make_tiny_model(root / "base", kind="llama", seed=3)
    adapters = {
        "a": make_peft_adapter(base, root / "a", r=8, target_modules=ALL_MODULES, seed=31),
        "b": make_peft_adapter(base, root / "b", r=4, seed=32),
    }
    return base, adapters


def load_fp8(base, device, dtype, drop):
    model = load_model(
        base, dtype=dtype, device=device, max_loras=2, max_lora_rank=8, quantization="fp8"
    )
    if drop:
        drop_float_bases(model)  # (the loader does this itself on CUDA)
    return model


def run_fp8_rows(model, adapters, dtype, forced=None, **runner_kw):
    """Logits (float32, CPU) of a prefill step and STEPS decode steps of mixed rows; decode
    feeds ``forced`` tokens (step -> row -> token) or, without them, the argmax."""
    runner = ModelRunner(model, num_blocks=48, block_size=4, **runner_kw)
    slots = {}
    for slot, name in enumerate(adapters):
        ad = load_adapter(adapters[name], model.cfg, max_lora_rank=8, name=name, dtype=dtype)
        write_slot(model, slot, ad)
        runner.slot_ranks.set(slot, ad.rank)
        slots[name] = slot
    g = random.Random(5)
    prompts = [[g.randrange(3, 200) for _ in range(g.randint(2, 9))] for _ in NAMES]
    tables = [list(range(i * 6, i * 6 + 6)) for i in range(len(NAMES))]
    rows = [slots.get(n, -1) for n in NAMES]
    items = [StepItem(list(p), 0, tables[i], rows[i]) for i, p in enumerate(prompts)]
    steps = [runner.execute(items).float().cpu()]
    for step in range(STEPS):
        toks = forced[step] if forced else steps[-1].argmax(-1).tolist()
        items = [
            StepItem([toks[i]], len(p) + step, tables[i], rows[i]) for i, p in enumerate(prompts)
        ]
        steps.append(runner.execute(items).float().cpu())
    return steps


def argmax_tokens(steps):
    return [s.argmax(-1).tolist() for s in steps[:-1]]


def rel_norm(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()
