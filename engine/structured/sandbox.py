"""The engine's grammar sandbox: untrusted constraints are compiled first in helper processes.

A request's JSON schema, regex, choice list or grammar reaches native code (llguidance) that a
hostile input can crash: a segfault or a stack overflow there would end the server. So every
constraint the engine has not seen is first converted, compiled and exercised in a sandbox
process (sandbox_helper.py), one job per process at a time; only a constraint that came through
is compiled again in the engine (``GrammarCache``), from the grammar text the sandbox returned.

- A helper that dies during a job (signal, abort, out of memory) fails that job with
  ``SandboxCrash``; the next job starts a fresh helper.
- A job longer than its budget (``timeout``), or whose every waiter went away, is ended by
  killing its helper (``SandboxTimeout`` / cancelled): a compile cannot be interrupted otherwise.
- At most ``processes`` jobs run at once; others queue in arrival order. Helpers run at nice 10
  and under a data-size limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import structlog

from loraplex.engine.structured.sandbox_helper import Checked, SandboxInit

__all__ = [
    "Checked",
    "GrammarSandbox",
    "SandboxCrash",
    "SandboxError",
    "SandboxTimeout",
    "SandboxUnavailable",
]

log = structlog.get_logger("loraplex.structured")

HELPER_MODULE = "loraplex.engine.structured.sandbox_helper"
_START_TIMEOUT_S = 120.0  # a helper builds its token trie before it says ready


class SandboxError(Exception):
    """The constraint does not compile (the grammar library's reason)."""


class SandboxCrash(SandboxError):
    """The constraint crashed the sandbox process (``how``: the signal or exit code)."""

    def __init__(self, how: str) -> None:
        super().__init__(f"it crashed the grammar compiler ({how})")
        self.how = how


class SandboxTimeout(SandboxError):
    """The constraint took longer than the compile budget."""


class SandboxUnavailable(SandboxError):
    """No sandbox process could start: the engine's fault, not the constraint's."""


@dataclass(eq=False)
class _Helper:
    process: subprocess.Popen
    conn: Connection
    reply: asyncio.Future | None = None
    dead: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class GrammarSandbox:
    """Helper processes that check constraints before the engine compiles them (module
    docstring). ``init``: a callable returning the ``SandboxInit`` (called once, in a thread,
    when the first helper starts: an engine that never sees a constraint pays nothing)."""

    def __init__(self, init: Any, processes: int = 2) -> None:
        self._init_fn = init
        self._init: SandboxInit | None = None
        self.processes = max(1, processes)
        self._idle: list[_Helper] = []
        self._live: set[_Helper] = set()
        self._gate: asyncio.Semaphore | None = None
        self._closed = False
        self.crashes = 0
        self.timeouts = 0

    async def check(self, kind: str, value: str, timeout: float | None) -> Checked:
        """Convert, compile and exercise one constraint in a helper; raises ``SandboxError``
        (does not compile), ``SandboxCrash`` or ``SandboxTimeout``. ``timeout`` counts from
        when a helper takes the job, not the wait for one. Cancelling kills the job's helper."""
        if self._closed:
            raise SandboxError("the grammar sandbox is closed")
        if self._gate is None:
            self._gate = asyncio.Semaphore(self.processes)
        async with self._gate:
            helper = self._take()
            if helper is None:
                helper = await asyncio.to_thread(self._spawn)
            reply = asyncio.get_running_loop().create_future()
            with helper.lock:  # (its reader thread settles ``reply`` or sees it dead)
                started = not helper.dead
                helper.reply = reply
            ok = False
            try:
                if not started:
                    raise SandboxError("the grammar sandbox process stopped before the job")
                await asyncio.to_thread(self._send, helper, (kind, value))
                try:
                    status, data = await asyncio.wait_for(asyncio.shield(reply), timeout)
                except asyncio.TimeoutError:
                    self.timeouts += 1
                    raise SandboxTimeout(
                        f"compiling it took longer than the budget ({timeout:g} s)"
                    ) from None
                ok = status != "died"
            finally:
                with helper.lock:
                    helper.reply = None
                if ok and not helper.dead:
                    self._idle.append(helper)
                else:  # timed out, cancelled or dead: the job may still run there
                    self._kill(helper)
        if status == "ok":
            return Checked(*data)
        if status == "died":
            self.crashes += 1
            raise SandboxCrash(data)
        raise SandboxError(data)

    def _take(self) -> _Helper | None:
        while self._idle:
            helper = self._idle.pop()
            if not helper.dead:
                return helper
            self._kill(helper)
        return None

    # -- helpers ---------------------------------------------------------------------------------

    def _spawn(self) -> _Helper:
        """Start one helper (blocking: in a worker thread)."""
        if self._init is None:
            self._init = self._init_fn()
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", HELPER_MODULE, "--conn-fd", str(theirs.fileno())]
        env = dict(os.environ)
        # the helper imports loraplex the way this process does (source checkouts, test paths)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if isinstance(p, str) and p)
        # NOTE: its stderr is dropped: a crash report there could quote the hostile input
        process = subprocess.Popen(
            cmd, pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        theirs.close()
        helper = _Helper(process, Connection(ours.detach()))
        self._live.add(helper)
        try:
            helper.conn.send(self._init)
            # the helper builds its token trie, then says it is ready (~0.5 s for 128k tokens)
            if not helper.conn.poll(_START_TIMEOUT_S) or helper.conn.recv() != "ready":
                raise SandboxUnavailable("the grammar sandbox process did not start")
        except (OSError, EOFError) as e:
            self._kill(helper)
            raise SandboxUnavailable(f"the grammar sandbox process did not start: {e}") from None
        except SandboxUnavailable:
            self._kill(helper)
            raise
        threading.Thread(
            target=self._read, args=(helper,), name="loraplex-sandbox-reader", daemon=True
        ).start()
        return helper

    @staticmethod
    def _send(helper: _Helper, msg: tuple) -> None:
        with contextlib.suppress(OSError, ValueError):  # dead: its reader reports it
            helper.conn.send(msg)

    def _read(self, helper: _Helper) -> None:
        """Reader thread of one helper: each reply to its job's future; EOF = it died."""
        while True:
            try:
                msg = helper.conn.recv()
            except Exception:  # noqa: BLE001 - EOF (it died) or a reply past understanding
                break
            self._resolve(helper, msg)
        try:
            code = helper.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            code = None
        self._resolve(helper, ("died", _describe(code)), dead=True)

    @staticmethod
    def _resolve(helper: _Helper, msg: tuple, dead: bool = False) -> None:
        with helper.lock:
            if dead:
                helper.dead = True
            fut = helper.reply
        if fut is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            fut.get_loop().call_soon_threadsafe(_settle, fut, msg)

    def _kill(self, helper: _Helper) -> None:
        helper.dead = True
        self._live.discard(helper)
        with contextlib.suppress(OSError):
            helper.process.kill()
        with contextlib.suppress(OSError, ValueError):
            helper.conn.close()

    @property
    def pids(self) -> list[int]:
        return [h.process.pid for h in self._live if not h.dead]

    def close(self) -> None:
        """Stop every helper (blocking, bounded)."""
        self._closed = True
        helpers = list(self._live)
        self._live.clear()
        self._idle.clear()
        for h in helpers:
            with contextlib.suppress(OSError, ValueError):
                h.conn.close()  # an idle helper exits on EOF
        for h in helpers:
            try:
                h.process.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                h.process.kill()
                # a loaded machine may take seconds to tear the child down after SIGKILL:
                # a slow exit must not fail the engine's close
                with contextlib.suppress(subprocess.TimeoutExpired):
                    h.process.wait(timeout=30.0)


def _settle(fut: asyncio.Future, msg: tuple) -> None:
    if not fut.done():
        fut.set_result(msg)


def _describe(code: int | None) -> str:
    if code is None:
        return "it did not exit"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit code {code}"
