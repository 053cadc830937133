"""The loader helper's own loop (adapters/loader_proc_main.py), without a process: every job it is
sent gets exactly one reply, also one cancelled before its task first ran."""

from __future__ import annotations

import asyncio

from loraplex.engine.adapters.loader_proc_main import _Helper
from loraplex.engine.adapters.loader_procs import LoaderInit
from loraplex.resolvers import ResolverSettings


class _Conn:
    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def send(self, msg: tuple) -> None:
        self.sent.append(msg)


def _helper(tmp_path, delay: float = 0.0) -> tuple[_Helper, _Conn]:
    init = LoaderInit(model_config=None, enabled_plugins=(), settings=ResolverSettings(),
                      cache_dir=str(tmp_path), pool_nbytes=0)  # fmt: skip
    conn = _Conn()
    helper = _Helper(conn, init, pool=None)  # type: ignore[arg-type]
    if delay:  # a stage that takes this long (a fake: nothing is read)

        async def stage(p: dict) -> dict:
            await asyncio.sleep(delay)
            return {}

        helper._stage = stage  # type: ignore[method-assign]
    return helper, conn


def test_a_job_cancelled_before_its_task_ran_is_answered(tmp_path):
    helper, conn = _helper(tmp_path)
    # the job and its cancel reach the helper's loop in one turn (a busy helper): the task
    # is cancelled before it first runs, so _run never starts
    helper._on_message(("stage", 7, {}))
    helper._on_message(("cancel", 7, None))
    helper.loop.run_until_complete(asyncio.sleep(0.01))
    assert conn.sent == [("cancelled", 7, None)]
    assert not helper.tasks
    helper.loop.close()


def test_a_running_job_cancelled_is_answered_once(tmp_path):
    helper, conn = _helper(tmp_path, delay=5.0)  # (the job sleeps first: it is running)
    helper._on_message(("stage", 8, {}))
    helper.loop.run_until_complete(asyncio.sleep(0.01))
    helper._on_message(("cancel", 8, None))
    helper.loop.run_until_complete(asyncio.sleep(0.01))
    assert conn.sent == [("cancelled", 8, None)]
    assert not helper.tasks
    helper.loop.close()
