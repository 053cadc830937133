"""Rank 0's side of a tensor-parallel engine: the worker processes, their connections, liveness.

The engine process is rank 0 and stays the asyncio process its user embeds. ``WorkerGroup``
starts ranks 1..N-1 as fresh interpreters (``python -m loraplex.engine.parallel.worker``, as
the loader helpers: multiprocessing's spawn would re-import the embedding application's
``__main__``), one per GPU, each with one socketpair ``Connection`` to rank 0, and joins them
in one ``torch.distributed`` group (NCCL on CUDA, gloo on CPU) whose rendezvous listens on
127.0.0.1 only. The workers inherit this process's environment (NCCL_* included).

Liveness: one reader thread per worker sees its connection close (the process died) or its
error message, marks the group failed and, on CUDA, aborts the NCCL group so that rank 0 does
not wait in a collective for a dead peer (gloo fails such a collective at once by itself).
Every later step raises that ``TensorParallelWorkerError``. Workers stop with the engine
(``close``, and an ``atexit`` hook if the engine is never closed); a worker whose connection
closes (rank 0 died) exits.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import structlog
import torch
import torch.distributed as dist

from loraplex.engine.config import EngineConfig
from loraplex.engine.errors import TensorParallelWorkerError
from loraplex.engine.model.config import ModelConfig
from loraplex.engine.model.tp import TensorParallel, TensorParallelError, TPShard, shard_config

__all__ = ["WorkerGroup", "WorkerInit", "COLLECTIVE_TIMEOUT_S"]

log = structlog.get_logger("loraplex.engine")

WORKER_MODULE = "loraplex.engine.parallel.worker"
COLLECTIVE_TIMEOUT_S = 120.0  # a collective waiting this long for a hung (alive) peer fails
START_TIMEOUT_S = 600.0  # a worker's start: interpreter, imports, its shard of the checkpoint
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class WorkerInit:
    """What a worker starts with (the first message on its connection)."""

    rank: int
    size: int
    port: int  # the rendezvous on 127.0.0.1
    backend: str  # "nccl" | "gloo"
    model: str  # checkpoint folder
    dtype: torch.dtype
    device: str  # "cpu" or "cuda:K"
    max_loras: int
    max_lora_rank: int
    cpu_threads: int
    timeout_s: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_threads_per_rank(config: EngineConfig) -> int:
    """torch threads of each CPU rank: the cores left to the event loop, shared by the ranks."""
    if config.cpu_threads is not None:
        return max(1, config.cpu_threads)
    return max(1, ((os.cpu_count() or 1) - 1) // config.tensor_parallel_size)


class WorkerGroup:
    """Ranks 1..N-1 of one engine, seen from rank 0 (module docstring). Blocking methods run in
    the engine's step thread (start-up, steps) or a worker thread (``close``)."""

    def __init__(
        self, config: EngineConfig, model_dir: str, cfg: ModelConfig, dtype: torch.dtype
    ) -> None:
        self.size = config.tensor_parallel_size
        self.cfg = cfg  # the full model's config
        device = config.resolved_device
        if config.quantization is not None:
            raise TensorParallelError("fp8 bases are not split over ranks yet")
        shard_config(cfg, TPShard(0, self.size))  # refuses a model that does not split
        self.cuda = device.startswith("cuda")
        base = torch.device(device).index or 0 if self.cuda else 0
        if self.cuda and torch.cuda.device_count() < base + self.size:
            raise TensorParallelError(
                f"tensor_parallel_size={self.size} from {device} needs GPUs {base}.."
                f"{base + self.size - 1}; {torch.cuda.device_count()} are visible"
            )
        self.devices = [f"cuda:{base + r}" if self.cuda else "cpu" for r in range(self.size)]
        self.backend = "nccl" if self.cuda else "gloo"
        self.threads = cpu_threads_per_rank(config)
        self.config, self.model_dir, self.dtype = config, model_dir, dtype
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self.inbox: list[queue.Queue] = []
        self.error: TensorParallelWorkerError | None = None
        self.failed = threading.Event()
        self.worker_env: list[dict[str, str]] = []  # NCCL_* each worker reported (tests)
        self._closing = False
        self._pg = False

    # -- start-up -------------------------------------------------------------------------------

    def start(self) -> TensorParallel:
        """Start the workers and join rank 0 to their group; returns rank 0's ``TensorParallel``.
        The workers then load their shards while this process loads its own."""
        if dist.is_initialized():
            raise TensorParallelError(
                "this process already has a torch.distributed group: one tensor-parallel "
                "engine per process"
            )
        port = _free_port()
        atexit.register(self.close)
        for rank in range(1, self.size):
            self._spawn(rank, port)
        for rank in range(1, self.size):
            msg = self.wait(rank, "up")
            self.worker_env.append(msg[1])
        with _loopback_env(self.cuda):
            self._join(port)
        self._pg = True
        log.info("tensor_parallel_started", size=self.size, backend=self.backend,
                 pids=[p.pid for p in self.procs])  # fmt: skip
        return TensorParallel(self.cfg, TPShard(0, self.size))

    def _join(self, port: int) -> None:
        """Rank 0 joins the group. The rendezvous runs in a thread so that a worker dying
        before it joins fails the start at once (its reader names it) instead of after the
        rendezvous timeout; the abandoned rendezvous ends by that timeout, in its thread."""
        done = threading.Event()
        raised: list[BaseException] = []

        def join() -> None:
            try:
                dist.init_process_group(
                    self.backend,
                    init_method=f"tcp://127.0.0.1:{port}",
                    rank=0,
                    world_size=self.size,
                    timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                    **({"device_id": torch.device(self.devices[0])} if self.cuda else {}),
                )
            except BaseException as e:  # noqa: BLE001 - handed to the starting thread
                raised.append(e)
            finally:
                done.set()

        threading.Thread(target=join, name="loraplex-tp-rendezvous", daemon=True).start()
        while not done.wait(0.05):
            if self.failed.is_set():
                self.check()
        if raised:
            self.check()  # a dead worker is the cause of a failed rendezvous
            raise TensorParallelWorkerError(f"tensor-parallel rendezvous failed: {raised[0]!r}")

    def _spawn(self, rank: int, port: int) -> None:
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", WORKER_MODULE, "--conn-fd", str(theirs.fileno())]
        env = dict(os.environ)  # NOTE: NCCL_* (NVLink multicast off and friends) carried over
        # the worker imports loraplex the way this process does (source checkouts, test paths)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if isinstance(p, str) and p)
        env.update(_loopback_vars(self.cuda))
        proc = subprocess.Popen(
            cmd, pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL
        )  # fmt: skip
        theirs.close()
        conn = Connection(ours.detach())
        inbox: queue.Queue = queue.Queue()
        self.procs.append(proc)
        self.conns.append(conn)
        self.inbox.append(inbox)
        conn.send(
            WorkerInit(
                rank, self.size, port, self.backend, self.model_dir, self.dtype,
                self.devices[rank], self.config.max_loras, self.config.max_lora_rank,
                self.threads, COLLECTIVE_TIMEOUT_S,
            )
        )  # fmt: skip
        threading.Thread(
            target=self._read, args=(rank, proc, conn, inbox), daemon=True,
            name=f"loraplex-tp-reader-{rank}",
        ).start()  # fmt: skip

    def _read(self, rank: int, proc: subprocess.Popen, conn: Connection, inbox: queue.Queue):
        """Reader thread of one worker: its messages to ``inbox``; its end to ``_died``."""
        reason = None
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "error":
                reason = msg[1]
            inbox.put(msg)
        if self._closing:
            return
        code = None
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = proc.wait(timeout=2.0)
        text = f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited (code {code})"
        self._fail(TensorParallelWorkerError(f"{text}: {reason}" if reason else text))
        inbox.put(("died",))

    def wait(self, rank: int, kind: str, timeout: float = START_TIMEOUT_S) -> tuple:
        """Start-up: the next message of worker ``rank``, which must be ``kind``."""
        try:
            msg = self.inbox[rank - 1].get(timeout=timeout)
        except queue.Empty:
            raise TensorParallelWorkerError(
                f"tensor-parallel worker rank {rank} sent no {kind!r} in {timeout:.0f} s"
            ) from None
        if msg[0] == "error":  # (its "died" follows)
            self.inbox[rank - 1].get(timeout=5.0)
        if msg[0] != kind:
            self.check()
            raise TensorParallelWorkerError(f"tensor-parallel worker rank {rank}: {msg}")
        return msg

    def wait_all(self, kind: str) -> list[tuple]:
        return [self.wait(rank, kind) for rank in range(1, self.size)]

    # -- serving --------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise the group's failure, if any (cheap: one attribute)."""
        if self.error is not None:
            raise self.error

    def send(self, rank: int, msg: Any = None, data: Any = None) -> None:
        """Send ``msg`` (pickled here) and / or ``data`` (bytes: raw, or a message pickled by
        the caller, which ``Connection.recv`` unpickles) to worker ``rank``; a closed pipe
        fails the group."""
        try:
            if msg is not None:
                self.conns[rank - 1].send(msg)
            if data is not None:
                self.conns[rank - 1].send_bytes(data)
        except (OSError, ValueError) as e:
            self.failed.wait(5.0)  # the reader names the dead worker
            self.check()
            raise self._fail(TensorParallelWorkerError(f"worker rank {rank}: {e}")) from e

    def send_all(self, msg: Any = None, data: Any = None) -> None:
        for rank in range(1, self.size):
            self.send(rank, msg, data)

    def failure(self, cause: BaseException) -> TensorParallelWorkerError:
        """The error of a step that raised on rank 0: the ranks are out of step from here on,
        so the group fails (workers stopped) whatever the cause."""
        if self.error is None:
            self.failed.wait(5.0)  # a dead peer broke the collective: its reader says which
        if self.error is None:
            text = f"tensor-parallel step failed on rank 0: {cause!r}"
            self._fail(TensorParallelWorkerError(text))
        assert self.error is not None
        self._stop_workers(kill=True)
        return self.error

    def _fail(self, error: TensorParallelWorkerError) -> TensorParallelWorkerError:
        if self.error is None:
            self.error = error
            log.error("tensor_parallel_failed", error=str(error))
            self.failed.set()
            if self.cuda:  # a collective in flight never sees a dead NCCL peer by itself
                abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
                if abort is not None and self._pg:
                    with contextlib.suppress(Exception):
                        abort()
        return self.error

    # -- shutdown -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers (asked, then killed after ``STOP_TIMEOUT_S``) and leave the group."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.close)
        self._stop_workers(kill=False)
        if self._pg and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self._pg = False

    def _stop_workers(self, *, kill: bool) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            if proc.poll() is None and not kill:
                with contextlib.suppress(OSError, ValueError):
                    conn.send(("stop",))
        deadline = time.monotonic() + (0 if kill else STOP_TIMEOUT_S)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.close()


def _loopback_vars(cuda: bool) -> dict[str, str]:
    """Interface variables that keep the group's sockets on the loopback interface."""
    if not sys.platform.startswith("linux"):
        return {}
    if cuda:  # NCCL's bootstrap; GPU traffic itself goes over NVLink / PCIe
        return {"NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", "lo")}
    return {"GLOO_SOCKET_IFNAME": "lo"}


@contextlib.contextmanager
def _loopback_env(cuda: bool):
    """``_loopback_vars`` set in this process while its group is made (read then), and put
    back after (the embedding application's environment is left as it was), except NCCL's,
    which NCCL reads when a communicator first runs."""
    saved = {k: os.environ.get(k) for k in _loopback_vars(cuda)}
    os.environ.update(_loopback_vars(cuda))
    try:
        yield
    finally:
        if not cuda:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
