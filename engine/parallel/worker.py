"""A tensor-parallel worker process: rank r of N, replaying rank 0's steps on its shard.

Started by ``WorkerGroup`` as ``python -m loraplex.engine.parallel.worker --conn-fd N``; the
first message on the connection is the ``WorkerInit``. The worker joins the group, loads its
shard of the checkpoint, builds the same ``ModelRunner`` as rank 0 (same KV blocks, its own
heads), then serves messages in order until ``stop`` or until the connection closes:

    ("runner", kwargs)                        build the runner; reply ("ready",)
    ("write", slot, entries, max_rank, dtype, decisions) + raw bytes: this rank's packed
                                              slot image, written with rank 0's decisions
                                              (``zero_rest``, ``had_dora``)
    ("step", rows, slot_ranks, dora_slots, n) run the step (rows: ``StepItem`` fields as
                                              tuples); n >= 0: the feed (rank 0's last sampled
                                              ids, n of them) arrives by broadcast
    ("stop",)

Replies: ("up", NCCL_* environment) before the rendezvous, ("loaded", free GPU bytes or None)
after the shard is loaded, ("ready",), or ("error", traceback) before exiting on a failure.
The logits a worker computes are dropped: sampling runs on rank 0 (logits are gathered on
every rank by the vocab-parallel LM head).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["main"]


def _serve(conn: Connection, init: Any) -> None:
    import torch
    import torch.distributed as dist

    from loraplex.engine.model.config import ModelConfig
    from loraplex.engine.model.loader import load_model
    from loraplex.engine.model.lora.slot_image import PackedAdapter
    from loraplex.engine.model.tp import TensorParallel, TPShard
    from loraplex.engine.model_runner import ModelRunner, StepItem

    torch.set_num_threads(init.cpu_threads)
    device = torch.device(init.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    conn.send(("up", {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}))
    dist.init_process_group(
        init.backend,
        init_method=f"tcp://127.0.0.1:{init.port}",
        rank=init.rank,
        world_size=init.size,
        timeout=timedelta(seconds=init.timeout_s),
        **({"device_id": device} if device.type == "cuda" else {}),
    )
    try:
        full = ModelConfig.from_dir(init.model)
        model = load_model(
            init.model, dtype=init.dtype, device=device, max_loras=init.max_loras,
            max_lora_rank=init.max_lora_rank,
            tensor_parallel=TensorParallel(full, TPShard(init.rank, init.size)),
        )  # fmt: skip
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        conn.send(("loaded", free))
        runner = None
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return  # rank 0 is gone
            kind = msg[0]
            if kind == "step":
                _, rows, ranks, dora, n = msg
                items = [StepItem(*row) for row in rows]
                assert runner is not None
                runner.slot_ranks.load(ranks, dora)
                feed = None
                if n >= 0:
                    feed = torch.empty(n, dtype=torch.int64, device=device)
                    dist.broadcast(feed, 0)
                runner.execute(items, feed)
            elif kind == "write":
                _, slot, entries, max_rank, dtype, decisions = msg
                raw = bytearray(conn.recv_bytes())
                buf = torch.frombuffer(raw, dtype=torch.uint8).view(dtype)
                assert runner is not None
                runner.write_slot(slot, PackedAdapter(buf, entries, max_rank), **decisions)
            elif kind == "runner":
                runner = ModelRunner(model, **msg[1])
                conn.send(("ready",))
            elif kind == "stop":
                return
            else:
                raise ValueError(f"unknown message {kind!r}")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """``python -m loraplex.engine.parallel.worker --conn-fd N`` (started by ``WorkerGroup``)."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--conn-fd", type=int, required=True)
    args = ap.parse_args(argv)
    conn = Connection(args.conn_fd)
    # NOTE: Ctrl-C reaches the whole process group; rank 0 drains and then stops its workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _serve(conn, conn.recv())
    except BaseException:  # noqa: BLE001 - rank 0 gets the reason, then the worker exits
        text = traceback.format_exc()
        sys.stderr.write(text)
        with contextlib.suppress(OSError):
            conn.send(("error", text.strip().splitlines()[-1]))
        sys.exit(1)


if __name__ == "__main__":
    main()
