"""A log record that cannot be written never stops the code that logged it.

Found in CI: a closed ``logging.FileHandler`` (``logging.config.dictConfig`` closes every existing handler; vLLM calls
it when imported) reopens its file on the next record, outside its own error handling; a run that had routed its
logs into a folder it then removed (a refused run) left such a handler on the root logger, and the agent pool's
watchdog, logging a lost worker, died with ``FileNotFoundError`` before it resolved the lost episodes' futures or
replaced the worker: the episodes never ended."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from concurrent.futures import Future

import pytest

from cluster.agents.pool import AgentWorkerPool
from contract.agents import EpisodeTicket
from contract.console import LogFileHandler


def test_the_routed_log_file_handler_survives_its_folder_being_removed(tmp_path, capsys):
    folder = tmp_path / "out"
    folder.mkdir()
    handler = LogFileHandler(folder / "driver.log", encoding="utf-8")
    log = logging.getLogger("grpo_test.log_file_gone")
    log.propagate = False
    log.addHandler(handler)
    try:
        log.warning("written")
        handler.close()  # what dictConfig does to every handler it finds
        shutil.rmtree(folder)
        log.warning("the folder is gone")  # the standard FileHandler raises FileNotFoundError here
    finally:
        log.removeHandler(handler)
        handler.close()
    assert "FileNotFoundError" in capsys.readouterr().err  # reported once, as any write error is


class _RaisingHandler(logging.Handler):
    """A handler whose every record raises (a user's broken handler, or the standard one above)."""

    def emit(self, record):
        raise FileNotFoundError("the log file's folder is gone")

    def handle(self, record):
        self.emit(record)  # not through handleError: raises out of logger.warning, as the standard reopen does


class _StandInWorker:
    """A worker whose episodes never end (a blocked event loop), or that dies at once."""

    made = 0

    def __init__(self, dies: bool):
        self.dies = dies
        self.closed = False
        type(self).made += 1

    def run(self, ticket):
        future = Future()
        if self.dies:
            threading.Timer(0.05, future.set_exception, args=(RuntimeError("worker process exited"),)).start()
        return future

    def close(self):
        self.closed = True


@pytest.mark.parametrize("dies", [False, True], ids=["hangs", "dies"])
def test_agent_pool_settles_lost_episodes_and_replaces_the_worker_when_logging_raises(dies):
    _StandInWorker.made = 0
    pool = AgentWorkerPool(lambda index: _StandInWorker(dies), workers=1, episodes_per_worker=4, timeout_s=0.2,
                           kind="stand-ins", grace_s=0.2)
    log = logging.getLogger("cluster.agents.pool")
    broken = _RaisingHandler()
    log.addHandler(broken)
    pool.start()
    try:
        futures = [pool.submit(EpisodeTicket(f"e{i}", "http://127.0.0.1:1/v1", {"prompt": "p"})) for i in range(2)]
        outcomes = [f.result(timeout=30) for f in futures]
        deadline = time.monotonic() + 30
        while pool.metrics()["agent_pool/worker_restarts"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        log.removeHandler(broken)
        pool.shutdown()
    assert [(o.reward, o.failure) for o in outcomes] == [(None, "infra")] * 2
    assert pool.metrics()["agent_pool/lost_episodes"] == 2 and pool.metrics()["agent_pool/worker_restarts"] >= 1
    assert _StandInWorker.made >= 2
