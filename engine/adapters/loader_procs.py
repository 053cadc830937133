"""Loader processes: the CPU-heavy half of a cold load, off the engine's GIL.

A cold load hashes, parses and packs tens of megabytes per adapter. In the engine process those
threads share one GIL with the step thread and the event loop: a storm of 24 loads froze every
running stream for 100+ ms at a time. So the engine starts ``loader_processes`` helper
processes (spawned, CPU only, no CUDA) and sends them two kinds of job:

    prepare   resolve + fetch (the resolver plugins run in the helper), sha256 digest,
              preflight -> the staged folder, its digest, pinned URI, size, stage timings
    stage     parse the staged folder and pack it straight into a host-pool region (shared
              memory the engine registered as pinned) -> the packed layout only

The engine process then only queues one async H2D copy per slot write. Messages are small
(metadata); tensor data never crosses the pipe. What every job carries alike (the source
policy, which grows with each static adapter, and the resolvers' environment) goes to a helper
only when it differs from what that helper last got (``call(..., shared=)``,
``resolve_shared``): the event loop pickles it once per change, not once per load.

Failure handling: a helper that dies fails none of the engine's requests directly. Each job it
had in flight is retried once on a fresh helper; a second death fails that job with
``LoaderProcessError`` (so only the requests waiting on that adapter fail). A job cancelled
by the engine is cancelled in the helper; its region is released only once the helper says the
job ended (it may still be writing into it). Errors raised in a helper come back as the same
typed ``LoRAError`` subclass with message and field. This module is the engine's side; a
helper runs ``loader_proc_main.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import structlog

from loraplex.engine import errors
from loraplex.engine.errors import LoaderProcessError, LoRAError

__all__ = [
    "LoaderInit",
    "LoaderProcesses",
    "helper_command",
    "resolve_shared",
]

HELPER_MODULE = "loraplex.engine.adapters.loader_proc_main"  # what each helper process runs

log = structlog.get_logger("loraplex.loader")


@dataclass(frozen=True)
class LoaderInit:
    """What every helper process is started with (pickled at spawn)."""

    model_config: Any  # ModelConfig
    enabled_plugins: tuple[str, ...] | None
    settings: Any  # ResolverSettings
    cache_dir: str
    pool_nbytes: int
    threads: int = 4


def helper_command() -> list[str]:
    """The command line of a helper process, without its descriptors (tests point this at a
    helper with delays)."""
    return [sys.executable, "-m", HELPER_MODULE]


def describe_error(e: BaseException) -> tuple[str, str, str, str | None]:
    return (type(e).__module__, type(e).__name__, str(e), getattr(e, "field", None))


def _rebuild(desc: tuple[str, str, str, str | None]) -> LoRAError:
    """The helper's error as the same typed error here (LoRAError subclasses of
    ``loraplex.engine.errors`` only, LoaderProcessError among them)."""
    module, name, message, fld = desc
    cls = getattr(errors, name, None)
    if module == LoRAError.__module__ and isinstance(cls, type) and issubclass(cls, LoRAError):
        return cls(message, field=fld)
    return LoaderProcessError(f"the adapter loader failed: {name}: {message}", field=fld)


def resolve_shared(cache: dict[str, Any], payload: dict) -> dict:
    """The helper's side of ``shared``: the payload with its shared fields filled in, from the
    message (kept in ``cache``) or, where the engine sent none, from ``cache``. Messages must
    be resolved in the order they arrived."""
    for key, new in payload.pop("_shared", {}).items():
        if new is not None:
            cache[key] = new[0]
        payload[key] = cache[key]
    return payload


# -- the engine side ---------------------------------------------------------------------------


_UNSENT = object()


@dataclass(eq=False)
class _Job:
    jid: int
    kind: str
    payload: dict
    future: asyncio.Future
    shared: dict = field(default_factory=dict)
    attempts: int = 0
    proc: _Proc | None = None
    on_end: Any = None  # on_end(ok) once no helper runs the job; ok: done and still awaited
    ended: bool = False


@dataclass(eq=False)
class _Proc:
    process: subprocess.Popen
    conn: Connection
    jobs: dict[int, _Job] = field(default_factory=dict)
    dead: bool = False
    sent: dict[str, Any] = field(default_factory=dict)  # shared field -> the value it last got


class LoaderProcesses:
    """The engine's handle on its helper processes (see the module docstring).

    ``call`` runs on the event loop; each helper has a reader thread that hands its replies to
    the loop. Jobs go to the helper with the fewest in flight.
    """

    def __init__(self, count: int, init: LoaderInit, pool_fd: int | None) -> None:
        self.count = count
        self.init = init
        self.pool_fd = pool_fd
        self.procs: list[_Proc] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count(1)
        self._closed = False
        self.deaths = 0
        self._lock = threading.Lock()

    def start(self) -> None:
        """Spawn the helpers (blocking: from a worker thread at engine start-up)."""
        for _ in range(self.count):
            self.procs.append(self._spawn())

    def _spawn(self) -> _Proc:
        ours, theirs = socket.socketpair()
        fds = [theirs.fileno()]
        cmd = [*helper_command(), "--conn-fd", str(theirs.fileno())]
        if self.pool_fd is not None:
            fds.append(self.pool_fd)
            cmd += ["--pool-fd", str(self.pool_fd)]
        env = dict(os.environ)
        # the helper imports loraplex the way this process does (source checkouts, test paths)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if isinstance(p, str) and p)
        process = subprocess.Popen(cmd, pass_fds=fds, env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        conn = Connection(ours.detach())
        conn.send(self.init)
        proc = _Proc(process, conn)
        threading.Thread(
            target=self._read, args=(proc,), name="loraplex-loader-reader", daemon=True
        ).start()
        return proc

    @property
    def pids(self) -> list[int]:
        return [p.process.pid for p in self.procs if not p.dead]

    async def call(
        self, kind: str, payload: dict, *, on_end: Any = None, shared: dict | None = None
    ) -> dict:
        """Run one job in a helper; raises the job's typed error. On cancellation the helper's
        job is cancelled too; ``on_end`` runs (on the loop) once no helper runs it any more.
        ``shared``: more payload fields, sent to a helper only when they differ from what it
        last got under that name (immutable values: compared by identity, then equality)."""
        if self._closed:
            raise LoaderProcessError("the adapter loader is closed")
        self.loop = asyncio.get_running_loop()
        job = _Job(
            next(self._ids), kind, payload, self.loop.create_future(), shared or {},
            on_end=on_end,
        )  # fmt: skip
        await self._submit(job)
        try:
            return await asyncio.shield(job.future)
        except asyncio.CancelledError:
            if not job.future.done():
                job.future.cancel()
                proc = job.proc
                if proc is not None and not proc.dead:
                    with contextlib.suppress(OSError, ValueError):
                        proc.conn.send(("cancel", job.jid, None))
                else:
                    self._end(job)
            raise

    async def _submit(self, job: _Job) -> None:
        job.attempts += 1
        live = [p for p in self.procs if not p.dead and p.process.poll() is None]
        if not live and not self._closed:  # e.g. one died before any job reached it
            with contextlib.suppress(OSError):
                self.procs.append(await asyncio.to_thread(self._spawn))
            live = [p for p in self.procs if not p.dead and p.process.poll() is None]
        if not live:
            raise LoaderProcessError("no adapter loader process is running")
        proc = min(live, key=lambda p: len(p.jobs))
        job.proc = proc
        proc.jobs[job.jid] = job
        payload = job.payload
        if job.shared:
            fields = {}
            for key, value in job.shared.items():
                last = proc.sent.get(key, _UNSENT)
                same = last is value or (last is not _UNSENT and last == value)
                fields[key] = None if same else (value,)
                proc.sent[key] = value
            payload = {**payload, "_shared": fields}
        # NOTE: a send to a dead helper fails quietly: its reader thread retries the job
        with contextlib.suppress(OSError, ValueError):
            proc.conn.send((job.kind, job.jid, payload))

    def _read(self, proc: _Proc) -> None:
        """Reader thread of one helper: replies to the loop; EOF = the helper died."""
        while True:
            try:
                msg = proc.conn.recv()
            except (EOFError, OSError):
                break
            self._to_loop(self._on_reply, proc, msg)
        if self.loop is None:  # died before any job: nothing to retry, only never pick it
            proc.dead = True
        self._to_loop(self._on_death, proc)

    def _to_loop(self, fn: Any, *args: Any) -> None:
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(fn, *args)

    def _on_reply(self, proc: _Proc, msg: tuple) -> None:
        kind, jid, data = msg
        job = proc.jobs.pop(jid, None)
        if job is None:
            return
        self._end(job, kind == "done" and not job.future.done())
        if job.future.done():
            return
        if kind == "done":
            job.future.set_result(data)
        elif kind == "error":
            job.future.set_exception(_rebuild(data))
        else:  # cancelled without our asking: the helper is shutting down
            job.future.set_exception(LoaderProcessError("the adapter loader stopped the job"))

    def _end(self, job: _Job, ok: bool = False) -> None:
        if not job.ended:
            job.ended = True
            if job.on_end is not None:
                job.on_end(ok)

    def _on_death(self, proc: _Proc) -> None:
        if proc.dead:
            return
        proc.dead = True
        jobs = list(proc.jobs.values())
        proc.jobs.clear()
        if self._closed:
            for job in jobs:
                self._end(job)
                if not job.future.done():
                    job.future.set_exception(LoaderProcessError("the adapter loader is closed"))
            return
        self.deaths += 1
        code = proc.process.poll()
        log.warning("loader_process_died", pid=proc.process.pid, exitcode=code, jobs=len(jobs))
        with contextlib.suppress(ValueError):
            self.procs.remove(proc)
        assert self.loop is not None
        self.loop.create_task(self._replace(jobs, code))

    async def _replace(self, jobs: list[_Job], code: int | None) -> None:
        """Start a new helper for the dead one, then retry its jobs once each (a retried job
        keeps what it reserved, e.g. its host-pool region: the dead helper writes no more)."""
        try:
            self.procs.append(await asyncio.to_thread(self._spawn))
        except Exception as e:  # noqa: BLE001
            log.error("loader_process_restart_failed", error=repr(e))
        for job in jobs:
            if job.future.done():  # cancelled while its helper was dying
                self._end(job)
                continue
            if job.attempts >= 2:
                self._end(job)
                job.future.set_exception(
                    LoaderProcessError(
                        f"the adapter loader process died twice while loading (exit code {code})"
                    )
                )
                continue
            try:
                await self._submit(job)
            except LoaderProcessError as e:
                self._end(job)
                job.future.set_exception(e)

    def close(self) -> None:
        """Stop every helper (blocking, bounded)."""
        self._closed = True
        for proc in self.procs:
            with contextlib.suppress(OSError, ValueError):
                proc.conn.close()
        for proc in self.procs:
            try:
                proc.process.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                proc.process.kill()
                # SIGKILL cannot be refused, but on a loaded machine the kernel may take
                # seconds to tear a torch-sized process down: wait longer, and never let a
                # slow exit fail the engine's close (the child is reaped when it goes).
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.process.wait(timeout=30.0)
        self.procs.clear()
