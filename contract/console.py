"""A quiet console: library log records and Python warnings below ERROR go to a log file, not to the terminal.

``grpo-cluster run`` (without ``--verbose``) calls :func:`route_logs` with ``output_dir/driver.log`` in the driver;
every Ray worker of the job calls :func:`route_worker_logs` when it starts (each rollout engine, each train rank), which
reads where to write from the environment the driver gives the job's workers (:data:`LOG_DIR_ENV`, :data:`VERBOSE_ENV`:
``output_dir/logs/<worker>.log``); the vLLM engine also configures vLLM's own loggers, which reach its engine-core
processes too (``rollout_workers.vllm.console``, with :class:`ReloadNoteFilter` and :func:`terminal_handler` from here);
a worker's own stdout and stderr go to its log file as well (C++ warnings, progress bars and the output of its
subprocesses do not pass through Python's logging). What stays on the terminal: the job's status lines, the step lines,
the progress bar, and records at ERROR or above. The engine's expected reload notes after each weight sync (vLLM's
``Failed to load weights`` for layers that receive no tensors: the rotary embedding, a tied LM head) never reach the
terminal (:class:`ReloadNoteFilter`); they stay in the log files. With ``verbose`` nothing is rerouted.

No project imports: every role may use it.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

__all__ = ["LIBRARY_LOGGERS", "LOG_DIR_ENV", "RELOAD_NOTE", "TERMINAL_ENV", "VERBOSE_ENV", "LogFileHandler",
           "ReloadNoteFilter", "quiet_library_terminals", "route_logs", "route_worker_logs", "terminal_handler",
           "unroute_logs"]

#: Environment variable naming the folder of the workers' log files (set by the driver for the job's workers).
LOG_DIR_ENV = "GRPO_CLUSTER_LOG_DIR"
#: Environment variable: "1" when the job runs with ``--verbose`` (workers then reroute nothing).
VERBOSE_ENV = "GRPO_CLUSTER_VERBOSE"
#: Environment variable a worker sets for the processes it starts: a path that opens the terminal it had before its
#: own output went to its log file (``/proc/<pid>/fd/<n>``; vLLM's engine-core process is a fresh interpreter).
TERMINAL_ENV = "GRPO_CLUSTER_TERMINAL"
#: The message vLLM logs for a layer that received no tensors in a weight reload (expected after every sync).
RELOAD_NOTE = "Failed to load weights"
#: Loggers of the libraries a job uses whose records below ERROR go to the log file only.
LIBRARY_LOGGERS = ("vllm", "ray", "transformers", "torch", "huggingface_hub", "datasets", "urllib3", "filelock",
                   "accelerate", "peft", "megatron", "mlflow", "alembic", "wandb", "trackio", "httpx", "matplotlib",
                   "absl", "tensorboard", "py.warnings")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: The files :func:`route_logs` routes to, and their handlers (a second call for one of them changes nothing).
_routed: dict[str, logging.Handler] = {}
#: In a worker whose own stdout/stderr go to its log file (:func:`route_worker_logs`): the terminal it had before.
_terminal_stream = None
#: In a process such a worker started: the worker's terminal, opened through :data:`TERMINAL_ENV`.
_inherited_terminal = None


class ReloadNoteFilter(logging.Filter):
    """Drops vLLM's expected reload notes (:data:`RELOAD_NOTE`) from a terminal handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        return RELOAD_NOTE not in record.getMessage()


class LogFileHandler(logging.FileHandler):
    """The log file :func:`route_logs` adds: a ``logging.FileHandler`` whose ``emit`` never raises.

    The standard handler reopens its file on the next record after it was closed (``logging.config.dictConfig``,
    which libraries such as vLLM call when they are imported, closes every existing handler), and that reopening is
    outside its own error handling: a folder removed meanwhile made ``logger.warning`` raise ``FileNotFoundError`` in
    whatever thread logged, which stopped a thread whose work came after the record. Here a record that cannot be
    written goes to ``handleError`` (one note on stderr), as any other write error does, and the caller goes on."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            super().emit(record)
        except Exception:  # noqa: BLE001 - a log record must never stop the code that logged it
            self.handleError(record)


def _terminal(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) in (
        sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)


def route_logs(log_file: str | Path, verbose: bool = False) -> logging.Handler | None:
    """Send library records (at each library's own levels) and Python warnings to ``log_file`` (appended; INFO and
    above) and keep only ERROR and above of them on the terminal (module docstring); with ``verbose``, change
    nothing.

    Returns:
        the file handler added to the root logger (None with ``verbose``, which also sets :data:`VERBOSE_ENV` to "1":
        the libraries' own progress bars stay too, ``cluster.in_process.progress``).
    """
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
        return None
    path = Path(log_file)
    if str(path.resolve()) in _routed:
        return _routed[str(path.resolve())]
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = LogFileHandler(path, encoding="utf-8")
    _routed[str(path.resolve())] = handler
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.addHandler(handler)  # the root's level stays: raising a library's verbosity is not this function's job
    _quiet_transformers()
    quiet_library_terminals()
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
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # "Generating train split" bars
    return handler


def unroute_logs(handler: logging.Handler | None) -> None:
    """Undo :func:`route_logs`'s file handler (a run refused after it routed, whose output folder is removed): take
    ``handler`` off the root logger, close it, and forget its file. Does nothing for None. The terminal handlers'
    ERROR level stays (the process is about to exit, or runs another job that routes again)."""
    if handler is None:
        return
    logging.getLogger().removeHandler(handler)
    handler.close()
    for path, routed in list(_routed.items()):
        if routed is handler:
            del _routed[path]


def quiet_library_terminals() -> None:
    """After :func:`route_logs`, hand the records of the libraries' loggers to the root logger (its file, and its
    terminal at ERROR) and silence the terminal handlers the libraries attached themselves; a library that adds
    one when it is imported (Ray does) needs this call again after the import. Does nothing unless routed."""
    if not _routed:
        return
    existing = [name for name in logging.root.manager.loggerDict if name.split(".")[0] in LIBRARY_LOGGERS]
    for name in {*LIBRARY_LOGGERS, *existing}:  # each library keeps its own levels: only where records go changes
        logger = logging.getLogger(name)
        logger.propagate = True  # to the root's file handler
        for h in logger.handlers:
            if _terminal(h):  # its records reach the terminal through the root's handler, once
                h.setLevel(logging.CRITICAL + 1)


def terminal_handler() -> logging.Handler:
    """A handler writing to the terminal this process had before :func:`route_worker_logs` sent its own stdout and
    stderr to its log file; in a process that worker started (vLLM's engine core), the worker's terminal
    (:data:`TERMINAL_ENV`); else ``sys.stderr``. The vLLM engine's logging configuration uses it for ERROR
    records (``rollout_workers.vllm.console``)."""
    global _inherited_terminal
    path = os.environ.get(TERMINAL_ENV)
    if _terminal_stream is None and _inherited_terminal is None and path:
        try:
            _inherited_terminal = open(path, "a", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115
        except OSError:  # the worker is gone, or no /proc here
            pass
    return logging.StreamHandler(_terminal_stream or _inherited_terminal or sys.stderr)


def _capture_process_output(log_file: Path) -> None:
    """Point this process's file descriptors 1 and 2 at ``log_file``, so what libraries write there directly (C++
    warnings, progress bars, warnings in their subprocesses, which inherit the descriptors) goes to the file; the
    terminal handlers keep writing to the terminal the process had (a duplicate of descriptor 2, which processes it
    starts can open through :data:`TERMINAL_ENV`). Done once per process."""
    global _terminal_stream
    if _terminal_stream is not None:
        return
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    _terminal_stream = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    if os.path.isdir(f"/proc/{os.getpid()}/fd"):
        os.environ[TERMINAL_ENV] = f"/proc/{os.getpid()}/fd/{_terminal_stream.fileno()}"
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for h in logging.getLogger().handlers:
        if _terminal(h):
            h.setStream(_terminal_stream)


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


def route_worker_logs(worker: str) -> Path | None:
    """In a Ray worker of the job: :func:`route_logs` to ``$GRPO_CLUSTER_LOG_DIR/<worker>.log`` unless the job is
    verbose or the variable is unset (a worker built outside ``grpo-cluster run``: nothing changes), and send the
    process's own stdout and stderr there too (:func:`_capture_process_output`; Ray forwards a worker's stdout and
    stderr to the driver's terminal, so ERROR records go to the terminal the worker had). An engine whose library
    configures its own loggers in processes of its own routes those itself, to the returned file (the vLLM engine:
    ``rollout_workers.vllm.console``).

    Returns:
        the worker's log file, or None when nothing was rerouted.
    """
    folder = os.environ.get(LOG_DIR_ENV)
    if not folder or os.environ.get(VERBOSE_ENV) == "1":
        return None
    log_file = Path(folder) / f"{worker}.log"
    route_logs(log_file)
    _capture_process_output(log_file)
    return log_file
