"""What runs inside one loader process: serves the engine's prepare / stage jobs (the other
end of loader_procs.py's channel).

Started by ``LoaderProcesses`` as ``python -m loraplex.engine.adapters.loader_proc_main
--conn-fd N [--pool-fd M]``; the first message on the connection is the ``LoaderInit``. Jobs
run as tasks of the helper's own event loop (fetch is async I/O; hashing, parsing and packing
go to its threads); every reply is ``(done | error | cancelled, job id, data)``. Its GIL-bound
work takes turns through a ``PriorityGate``.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from loraplex.engine.adapters.loader_procs import LoaderInit, describe_error, resolve_shared
from loraplex.engine.adapters.thread_jobs import run_to_end
from loraplex.engine.errors import LoaderProcessError

__all__ = ["PriorityGate", "main"]


def _helper_main(conn: Connection, init: LoaderInit, fd: int | None) -> None:
    """Serve jobs until the engine closes the connection."""
    import torch

    torch.set_num_threads(1)
    with contextlib.suppress(OSError):
        os.nice(10)  # where CPUs are short, the engine's step thread and event loop go first
    pool = None
    if fd is not None and init.pool_nbytes:
        pool = torch.frombuffer(mmap.mmap(fd, init.pool_nbytes, mmap.MAP_SHARED), dtype=torch.uint8)
    _Helper(conn, init, pool).serve()


def main(argv: list[str] | None = None) -> None:
    """``python -m loraplex.engine.adapters.loader_proc_main --conn-fd N [--pool-fd M]``: started by
    ``LoaderProcesses`` (not by multiprocessing's spawn, which would re-import the embedding
    application's ``__main__``). The first message on the connection is the LoaderInit."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--conn-fd", type=int, required=True)
    ap.add_argument("--pool-fd", type=int, default=None)
    args = ap.parse_args(argv)
    conn = Connection(args.conn_fd)
    init = conn.recv()
    _helper_main(conn, init, args.pool_fd)


class _Helper:
    def __init__(self, conn: Connection, init: LoaderInit, pool: Any) -> None:
        from loraplex.plugins import PluginManager

        self.conn, self.init, self.pool = conn, init, pool
        self.plugins = PluginManager(init.enabled_plugins, init.settings)
        self.loop = asyncio.new_event_loop()
        self.loop.set_default_executor(ThreadPoolExecutor(init.threads))
        self.tasks: dict[int, asyncio.Task] = {}
        self.shared: dict[str, Any] = {}  # what the engine sent once for many jobs
        self.send_lock = threading.Lock()
        # one job at a time in the GIL-bound parts (header and value checks, parse and pack),
        # a waiting stage (a request waits on it) before waiting registration checks: jobs
        # interleaved on one interpreter's GIL run slower in sum than one after the other (16
        # loads at once on 4 helpers: 19.9 loads/s against 37.8 with 8); fetch and sha256
        # (which releases the GIL) still overlap
        self.cpu_gate = PriorityGate()

    def serve(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()
        self.loop.run_forever()

    def _read(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                os._exit(0)  # the engine is gone: nothing to finish
            self.loop.call_soon_threadsafe(self._on_message, msg)

    def _send(self, msg: tuple) -> None:
        with self.send_lock:
            self.conn.send(msg)

    def _on_message(self, msg: tuple) -> None:
        kind, jid, payload = msg
        if kind == "cancel":
            task = self.tasks.get(jid)
            if task is not None:
                task.cancel()
            return
        try:
            resolve_shared(self.shared, payload)  # here, in the order the messages came
        except KeyError as e:  # a field never sent to this helper: fail the job, not hang it
            err = LoaderProcessError(f"the loader helper has no {e.args[0]!r} for this job")
            self._send(("error", jid, describe_error(err)))
            return
        task = self.loop.create_task(self._run(jid, kind, payload))
        self.tasks[jid] = task
        task.add_done_callback(lambda t: self._unstarted(jid, t))

    def _unstarted(self, jid: int, task: asyncio.Task) -> None:
        """A job cancelled before its task first ran never entered ``_run`` (nor sent its
        reply): say so, or the engine would wait for it for ever (and keep its region). The
        job and its cancel arrive together when this loop is slow to take the first."""
        if task.cancelled():
            self.tasks.pop(jid, None)
            self._send(("cancelled", jid, None))

    async def _run(self, jid: int, kind: str, payload: dict) -> None:
        try:
            fn = self._prepare if kind == "prepare" else self._stage
            result = await fn(payload)
        except asyncio.CancelledError:
            self._send(("cancelled", jid, None))
        except BaseException as e:  # noqa: BLE001 - every error goes back to the engine
            self._send(("error", jid, describe_error(e)))
        else:
            self._send(("done", jid, result))
        finally:
            self.tasks.pop(jid, None)

    async def _prepare(self, p: dict) -> dict:
        from loraplex.engine.adapters.fetch import fetch_and_check

        os.environ.update(p["env"])  # HF_* / AWS_* as the engine sees them now
        t0 = time.perf_counter()
        if self.plugins.settings.policy != p["resolver_policy"]:
            self.plugins.update_settings(
                replace(self.plugins.settings, policy=p["resolver_policy"])
            )
        resolver = self.plugins.resolver_for(p["uri"])
        await asyncio.to_thread(p["policy"].check, p["uri"])
        t1 = time.perf_counter()
        dest = Path(tempfile.mkdtemp(prefix=p["prefix"], dir=self.init.cache_dir))
        dtype, out = None, None
        if p.get("region") is not None:  # the same pass packs the slot image into the region
            import torch

            dtype = getattr(torch, p["dtype"])
            offset, nbytes = p["region"]
            out = self.pool[offset : offset + nbytes].view(dtype)
        got = await fetch_and_check(
            resolver, p["uri"], dest, name=p["name"], shown_uri=p["uri"], sha256=p["sha256"],
            expect_digest=p["expect_digest"], model_config=self.init.model_config,
            max_lora_rank=p["max_lora_rank"], max_bytes=p["max_bytes"],
            full_modules=p["full_modules"], extra_files=tuple(p.get("extra_files", ())),
            cpu_gate=self.cpu_gate.hold(urgent=p.get("urgent", out is not None)), dtype=dtype,
            out=out,
        )  # fmt: skip
        report = got.checked.report
        reply = {
            "local_dir": str(got.result.local_dir),
            "digest": got.digest,
            "seal": got.checked.seal,
            "pinned_uri": got.result.pinned_uri,
            "nbytes": got.result.nbytes,
            "rank": report.rank,
            "dora": report.config.use_dora,
            "full": bool(report.full),
            "vocab_rows": report.vocab_rows,
            "timings": {"resolve": t1 - t0, **got.stages},
        }
        packed = got.checked.packed
        if packed is not None:
            reply["config"] = report.config
            reply["numel"] = packed.buffer.numel()
            reply["entries"] = [tuple(vars(e).values()) for e in packed.entries.values()]
        return reply

    async def _stage(self, p: dict) -> dict:
        # NOTE: the "cancelled" reply frees the region on the engine's side: it may only go
        # once this thread has stopped writing into it
        return await run_to_end(lambda stop: self._stage_sync(p, stop))

    def _stage_sync(self, p: dict, stop: threading.Event) -> dict:
        import torch

        from loraplex.engine.adapters.staging import stage_file

        t0 = time.perf_counter()
        dtype = getattr(torch, p["dtype"])
        offset, nbytes = p["region"]
        with self.cpu_gate.hold(urgent=True):
            adapter = stage_file(
                p["local_dir"], self.init.model_config, p["max_lora_rank"], dtype=dtype,
                name=p["name"], full_modules=p["full_modules"],
                read_full=False,  # the engine reads the full tables (not in the region)
                out=self.pool[offset : offset + nbytes].view(dtype), stop=stop,
                seal=p.get("seal"), expect_digest=p.get("expect_digest"),
            )  # fmt: skip
        packed = adapter.image
        assert packed is not None
        return {
            "config": adapter.config,
            "path": adapter.path,
            "numel": packed.buffer.numel(),
            "entries": [tuple(vars(e).values()) for e in packed.entries.values()],
            "stage_s": time.perf_counter() - t0,
        }


class PriorityGate:
    """One holder at a time; waiting urgent holders go before waiting others. A loader
    helper's GIL-bound work: a stage (a request waits on it) before registration checks."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._urgent = 0  # urgent holders waiting

    @contextlib.contextmanager
    def hold(self, *, urgent: bool) -> Iterator[None]:
        with self._cond:
            self._urgent += urgent
            try:
                while self._busy or (not urgent and self._urgent):
                    self._cond.wait()
            finally:
                self._urgent -= urgent
            self._busy = True
        try:
            yield
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()


if __name__ == "__main__":
    main()
