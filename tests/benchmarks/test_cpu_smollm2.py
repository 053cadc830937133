"""The CPU engine on a real checkpoint (SmolLM2-135M-Instruct, float32) against HF + PEFT:
greedy tokens with a rank-8 adapter on q/v/o/down, batch of 3 over two adapters and the base.

Slow: runs only with ``LORAPLEX_SLOW_TESTS=1`` and where the checkpoint was built already
(``python -m benchmarks.checkpoints``); tests download nothing.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from benchmarks.checkpoints import smollm2_built
from loraplex.engine import AsyncEngine, EngineConfig, SamplingParams

MODEL = smollm2_built()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("LORAPLEX_SLOW_TESTS") != "1", reason="slow: opt in"),
    pytest.mark.skipif(
        MODEL is None, reason="SmolLM2 not built (python -m benchmarks.checkpoints)"
    ),
]
NEW = 12


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    from benchmarks.cpu import make_adapters

    return make_adapters(MODEL, tmp_path_factory.mktemp("smol"), 2, 8)


def _hf(adapters, prompt, name):
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    model = base if name is None else peft.PeftModel.from_pretrained(base, adapters[name])
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
            min_new_tokens=NEW, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


async def test_greedy_matches_hf_peft(adapters):
    prompts = [[100 + 7 * i + j for j in range(20 + 5 * i)] for i in range(3)]
    names = [0, None, 1]
    cfg = EngineConfig(model=str(MODEL), device="cpu", max_loras=2, max_cpu_loras=2,
                       max_lora_rank=8)  # fmt: skip
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    async with AsyncEngine(cfg) as engine:
        for i, path in enumerate(adapters):
            await engine.add_adapter(f"a{i}", str(path))

        async def one(i):
            toks = []
            name = None if names[i] is None else f"a{names[i]}"
            async for out in engine.generate(prompts[i], params, adapter=name):
                toks += out.token_ids
            return toks

        ours = await asyncio.gather(*(one(i) for i in range(3)))
    for i, name in enumerate(names):
        assert ours[i] == _hf(adapters, prompts[i], name), f"row {i} (adapter {name})"
