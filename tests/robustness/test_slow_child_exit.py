"""A helper process that takes seconds to go after SIGKILL (a loaded machine tearing down a
torch-sized process) must not make the engine's close raise: the loader processes' and the
grammar sandbox's ``close`` wait longer after the kill and never fail on a slow exit."""

from __future__ import annotations

import subprocess

from loraplex.engine.adapters.loader_procs import LoaderProcesses, _Proc
from loraplex.engine.structured.sandbox import GrammarSandbox, _Helper


class _SlowToDie:
    """A child that ignores the polite close and exits only some seconds after SIGKILL: any
    wait shorter than ``exit_after_kill_s`` times out."""

    def __init__(self, exit_after_kill_s: float) -> None:
        self.exit_after_kill_s = exit_after_kill_s
        self.killed = False
        self.pid = 12345

    def wait(self, timeout: float | None = None) -> int:
        if self.killed and (timeout is None or timeout >= self.exit_after_kill_s):
            return -9
        raise subprocess.TimeoutExpired(["helper"], timeout)

    def kill(self) -> None:
        self.killed = True


class _Conn:
    def close(self) -> None:
        pass


def test_loader_processes_close_survives_a_slow_exit_after_kill():
    procs = LoaderProcesses(1, init=None, pool_fd=None)  # type: ignore[arg-type]
    child = _SlowToDie(exit_after_kill_s=5.0)
    procs.procs.append(_Proc(process=child, conn=_Conn()))  # type: ignore[arg-type]
    procs.close()
    assert child.killed and procs.procs == []


def test_loader_processes_close_returns_even_if_the_child_never_goes():
    procs = LoaderProcesses(1, init=None, pool_fd=None)  # type: ignore[arg-type]
    child = _SlowToDie(exit_after_kill_s=float("inf"))
    child.wait = lambda timeout=None: (_ for _ in ()).throw(  # type: ignore[method-assign]
        subprocess.TimeoutExpired(["helper"], timeout)
    )
    procs.procs.append(_Proc(process=child, conn=_Conn()))  # type: ignore[arg-type]
    procs.close()
    assert child.killed


def test_grammar_sandbox_close_survives_a_slow_exit_after_kill():
    sandbox = GrammarSandbox(init=lambda: None, processes=1)
    child = _SlowToDie(exit_after_kill_s=5.0)
    sandbox._live.add(_Helper(process=child, conn=_Conn()))  # type: ignore[arg-type]
    sandbox.close()
    assert child.killed
