"""A quiet console: library log records and Python warnings below ERROR go to a log file, not to the terminal.

``grpo-cluster run`` (without ``--verbose``) calls :func:`route_logs` with ``output_dir/driver.log`` in the driver;
every Ray worker of the job calls :func:`route_worker_logs` when it starts (``RolloutEngine``, each train rank), which
reads where to write from the environment the driver gives the job's workers (:data:`LOG_DIR_ENV`,
:data:`VERBOSE_ENV`: ``output_dir/logs/<worker>.log``); a vLLM engine also gets a logging configuration for vLLM's own
loggers (:func:`vllm_logging_config`, through ``VLLM_LOGGING_CONFIG_PATH``), which reaches vLLM's engine-core
processes too. What stays on the terminal: the job's status lines, the step lines, the progress bar, and records at
ERROR or above. The engine's expected reload notes after each weight sync (vLLM's ``Failed to load weights`` for
layers that receive no tensors: the rotary embedding, a tied LM head) never reach the terminal
(:class:`ReloadNoteFilter`); they stay in the log files. With ``verbose`` nothing is rerouted.

No project imports: every role may use it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

__all__ = ["LIBRARY_LOGGERS", "LOG_DIR_ENV", "RELOAD_NOTE", "VERBOSE_ENV", "ReloadNoteFilter", "route_logs",
           "route_worker_logs", "vllm_logging_config"]

#: Environment variable naming the folder of the workers' log files (set by the driver for the job's workers).
LOG_DIR_ENV = "GRPO_CLUSTER_LOG_DIR"
#: Environment variable: "1" when the job runs with ``--verbose`` (workers then reroute nothing).
VERBOSE_ENV = "GRPO_CLUSTER_VERBOSE"
#: The message vLLM logs for a layer that received no tensors in a weight reload (expected after every sync).
RELOAD_NOTE = "Failed to load weights"
#: Loggers of the libraries a job uses whose records below ERROR go to the log file only.
LIBRARY_LOGGERS = ("vllm", "ray", "transformers", "torch", "huggingface_hub", "datasets", "urllib3", "filelock",
                   "accelerate", "peft", "megatron", "mlflow", "alembic", "wandb", "trackio", "httpx", "matplotlib",
                   "absl", "tensorboard", "py.warnings")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class ReloadNoteFilter(logging.Filter):
    """Drops vLLM's expected reload notes (:data:`RELOAD_NOTE`) from a terminal handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        return RELOAD_NOTE not in record.getMessage()


def _terminal(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) in (
        sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)


def route_logs(log_file: str | Path, verbose: bool = False) -> logging.Handler | None:
    """Send library records (at each library's own levels) and Python warnings to ``log_file`` (appended; INFO and
    above) and keep only ERROR and above of them on the terminal (module docstring); with ``verbose``, change
    nothing.

    Returns:
        the file handler added to the root logger (None with ``verbose``).
    """
    if verbose:
        return None
    path = Path(log_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.addHandler(handler)  # the root's level stays: raising a library's verbosity is not this function's job
    _quiet_transformers()
    existing = [name for name in logging.root.manager.loggerDict if name.split(".")[0] in LIBRARY_LOGGERS]
    for name in {*LIBRARY_LOGGERS, *existing}:  # each library keeps its own levels: only where records go changes
        logger = logging.getLogger(name)
        logger.propagate = True  # to the root's file handler
        for h in logger.handlers:
            if _terminal(h):  # its records reach the terminal through the root's handler below, once
                h.setLevel(logging.CRITICAL + 1)
    terminal = [h for h in root.handlers if _terminal(h)]
    if not terminal:
        terminal = [logging.StreamHandler(sys.stderr)]
        terminal[0].setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(terminal[0])
    for h in terminal:
        h.setLevel(max(h.level, logging.ERROR))
        h.addFilter(ReloadNoteFilter())
    logging.captureWarnings(True)  # warnings.warn → logger "py.warnings" → the file
    os.environ.setdefault("WANDB_SILENT", "true")  # wandb prints its notes itself, not through logging
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return handler


def _quiet_transformers() -> None:
    """transformers keeps its own terminal handler and progress bars ("Loading weights"): hand its records to the
    root logger and turn the bars off (when transformers is installed)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()


def vllm_logging_config(log_file: str | Path) -> dict:
    """A ``logging.config.dictConfig`` for vLLM's loggers (``VLLM_LOGGING_CONFIG_PATH``): INFO and above to
    ``log_file``, ERROR and above to stderr without the reload notes."""
    return {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": FORMAT}},
        "filters": {"reload_notes": {"()": f"{__name__}.ReloadNoteFilter"}},
        "handlers": {
            "file": {"class": "logging.FileHandler", "filename": str(log_file), "level": "INFO", "formatter": "plain"},
            "terminal": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "level": "ERROR",
                         "formatter": "plain", "filters": ["reload_notes"]},
        },
        "loggers": {"vllm": {"handlers": ["file", "terminal"], "level": "INFO", "propagate": False}},
    }


def route_worker_logs(worker: str, vllm: bool = False) -> Path | None:
    """In a Ray worker of the job: :func:`route_logs` to ``$GRPO_CLUSTER_LOG_DIR/<worker>.log`` unless the job is
    verbose or the variable is unset (a worker built outside ``grpo-cluster run``: nothing changes). With ``vllm``
    (before vLLM is imported), also write :func:`vllm_logging_config` beside it and point
    ``VLLM_LOGGING_CONFIG_PATH`` at it.

    Returns:
        the worker's log file, or None when nothing was rerouted.
    """
    folder = os.environ.get(LOG_DIR_ENV)
    if not folder or os.environ.get(VERBOSE_ENV) == "1":
        return None
    log_file = Path(folder) / f"{worker}.log"
    route_logs(log_file)
    if vllm:
        config = Path(folder) / f"{worker}.vllm-logging.json"
        config.write_text(json.dumps(vllm_logging_config(log_file)))
        os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config)
    return log_file
