"""vLLM's own loggers on the quiet console (``contract.console``): INFO and above to the engine worker's log file,
ERROR and above to the terminal without the expected reload notes, in the engine actor and in the engine-core
processes vLLM spawns (they read the configuration from ``VLLM_LOGGING_CONFIG_PATH``). Set before vLLM is imported.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from contract.console import FORMAT, route_worker_logs

__all__ = ["route_vllm_logs", "vllm_logging_config"]


def vllm_logging_config(log_file: str | Path) -> dict:
    """A ``logging.config.dictConfig`` for vLLM's loggers (``VLLM_LOGGING_CONFIG_PATH``): INFO and above to
    ``log_file``, ERROR and above to the terminal (``contract.console.terminal_handler``) without the reload notes
    (``contract.console.ReloadNoteFilter``)."""
    return {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": FORMAT}},
        "filters": {"reload_notes": {"()": "contract.console.ReloadNoteFilter"}},
        "handlers": {
            "file": {"class": "logging.FileHandler", "filename": str(log_file), "level": "INFO", "formatter": "plain"},
            "terminal": {"()": "contract.console.terminal_handler", "level": "ERROR", "formatter": "plain",
                         "filters": ["reload_notes"]},
        },
        "loggers": {"vllm": {"handlers": ["file", "terminal"], "level": "INFO", "propagate": False}},
    }


def route_vllm_logs(worker: str) -> Path | None:
    """:func:`contract.console.route_worker_logs` for ``worker``, then (when it routed anything) write
    :func:`vllm_logging_config` beside its log file and point ``VLLM_LOGGING_CONFIG_PATH`` at it. Call before vLLM is
    imported. Returns the worker's log file, or None when nothing was rerouted (verbose, or outside a job)."""
    log_file = route_worker_logs(worker)
    if log_file is None:
        return None
    config = log_file.parent / f"{worker}.vllm-logging.json"
    config.write_text(json.dumps(vllm_logging_config(log_file)))
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config)
    return log_file
