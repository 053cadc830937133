"""One rank of a tensor-parallel run on CPU (gloo over 127.0.0.1), for test_tensor_parallel.py.

``run`` loads the rank's shard of a model, writes each adapter's shard into a slot, prefills a
mixed batch and decodes a few given tokens, and (rank 0) saves every step's logits.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

PROMPTS = [[5, 9, 13, 2, 7], [11, 3, 8], [20, 21, 22, 23], [5, 9, 13, 2, 7], [40]]
NAMES = ["a", None, "b", None, "a"]  # rows 0 and 3: the same prompt with and without a LoRA
DECODE = [[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]]  # tokens fed per decode step (one per row)


def run(
    rank: int, size: int, port: int, model_dir: str, adapters: dict, out: str, fused: bool = False
) -> None:
    """Entry point of a spawned rank (``size`` 1: no process group). ``fused``: the GPU
    forward (fused.py) with the epilogues' torch twins, else the reference forward."""
    from loraplex.engine.adapters.parse import load_adapter
    from loraplex.engine.model.backend import KernelBackend
    from loraplex.engine.model.config import ModelConfig
    from loraplex.engine.model.loader import load_model
    from loraplex.engine.model.lora.slot_buffers import write_slot
    from loraplex.engine.model.tp import TensorParallel, TPShard, shard_adapter
    from loraplex.engine.model_runner import ModelRunner, StepItem

    torch.set_num_threads(1)
    tp = None
    full = ModelConfig.from_dir(model_dir)
    if size > 1:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
        )
        tp = TensorParallel(full, TPShard(rank, size))
    try:
        model = load_model(
            model_dir, dtype=torch.float32, device="cpu", max_loras=2, max_lora_rank=8,
            tensor_parallel=tp,
        )  # fmt: skip
        backend = KernelBackend(fused=True, triton=False) if fused else "torch"
        runner = ModelRunner(model, num_blocks=32, block_size=4, kernel_backend=backend)
        slots = {}
        for slot, (name, folder) in enumerate(sorted(adapters.items())):
            adapter = load_adapter(folder, full, max_lora_rank=8, name=name)
            if tp is not None:
                adapter = shard_adapter(adapter, full, tp.shard)
            write_slot(model, slot, adapter)
            runner.slot_ranks.set(slot, adapter.rank)
            slots[name] = slot
        tables = [[4 * i, 4 * i + 1, 4 * i + 2] for i in range(len(PROMPTS))]

        def slot_of(i: int) -> int:
            return slots[NAMES[i]] if NAMES[i] is not None else -1

        items = [StepItem(list(p), 0, tables[i], slot_of(i)) for i, p in enumerate(PROMPTS)]
        steps = [runner.execute(items).cpu()]
        for k, toks in enumerate(DECODE):
            items = [
                StepItem([toks[i]], len(p) + k, tables[i], slot_of(i))
                for i, p in enumerate(PROMPTS)
            ]
            steps.append(runner.execute(items).cpu())
        if rank == 0:
            torch.save(steps, Path(out))
    finally:
        if size > 1:
            torch.distributed.destroy_process_group()
