"""A quiet console (``contract.console``, ``grpo-cluster run`` without ``--verbose``): library notes and warnings below
ERROR go to ``output_dir/driver.log``; the status and step lines stay on the terminal; ``--verbose`` leaves them on the
terminal. Each case runs in a fresh interpreter, so its stderr is exactly what a user would see.

1. The routing rules, on records a library would emit: a FutureWarning, a transformers warning, vLLM's reload note
   after a sync (never on the terminal, kept in the file), an error (still on the terminal); and in a worker, vLLM's
   own logger configured through ``VLLM_LOGGING_CONFIG_PATH`` (the worker's log file, errors on the terminal), and
   what the worker writes outside logging (to its file descriptors, by print, a subprocess, logging's last resort);
   a fresh interpreter it starts (vLLM's engine core) logs vLLM's errors to the worker's terminal, once.
2. A real run on the in-process runtime (tiny model, one step): quiet, stderr holds only the job's own lines, not
   transformers' "Loading weights" bars or a warning, and driver.log exists; verbose, the library output is back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]

RECORDS = """
import logging, sys, warnings
from contract.console import route_logs
route_logs(sys.argv[1], verbose=sys.argv[2] == "1")
warnings.warn("torch.foo is deprecated", FutureWarning)
logging.getLogger("transformers.modeling_utils").warning("some weights were not initialised")
logging.getLogger("vllm.model_executor").warning("RotaryEmbedding: Failed to load weights")
logging.getLogger("ray.worker").error("an engine died")
"""

VLLM_WORKER = """
import logging, os, sys
from rollout_workers.vllm.console import route_vllm_logs
route_vllm_logs("engine-0")  # as the vLLM engine does, before vLLM is imported
from vllm.logger import init_logger
log = init_logger("vllm.model_executor.model_loader.reload")
log.warning("RotaryEmbedding: Failed to load weights")
log.info("engine note")
log.error("engine error")
import subprocess, warnings
os.write(2, b"raw descriptor note\\n")  # as a C++ warning or a progress bar writes
print("printed note", flush=True)
warnings.warn("a library warning", FutureWarning)
orphan = logging.getLogger("orphan")  # no handler anywhere: logging's last resort writes to stderr
orphan.propagate = False
orphan.warning("last resort note")
subprocess.run([sys.executable, "-c", "import sys; print('child note', file=sys.stderr)"], check=True)
# vLLM's engine core: a fresh interpreter (spawned) that configures vLLM's logging from VLLM_LOGGING_CONFIG_PATH
core = ("import json, logging, logging.config, os; "
        "logging.config.dictConfig(json.load(open(os.environ['VLLM_LOGGING_CONFIG_PATH']))); "
        "logging.getLogger('vllm.v1.engine.core').error('core error'); "
        "logging.getLogger('vllm.v1.engine.core').warning('core note')")
subprocess.run([sys.executable, "-c", core], check=True)
logging.getLogger("train").error("rank error")
"""

ROUTED_TWICE = """
import logging, os
from contract.console import route_worker_logs, terminal_handler
route_worker_logs("train-rank0")
route_worker_logs("train-rank0")  # a second worker built in the same process
logging.getLogger("vllm").addHandler(terminal_handler())
logging.getLogger("vllm").propagate = False
logging.getLogger("vllm").error("engine error")
logging.getLogger("train").error("rank error")
logging.getLogger("transformers").warning("library note")
print(len(os.listdir("/proc/self/fd")), flush=True)
"""

IN_PROCESS_RUN = """
import sys
from contract.console import route_logs
from cluster.spec import JobSpec
spec = JobSpec.model_validate_json(open(sys.argv[1]).read())
route_logs(spec.output_dir + "/driver.log", verbose=sys.argv[2] == "1")
from cluster.in_process import local_job
job = local_job(spec, progress=False)
try:
    job.run()
finally:
    job.close()
    job.shutdown()
"""


def _python(code: str, *args: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    for name in ("WANDB_SILENT", "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY", "PYTHONWARNINGS",
                 "VLLM_LOGGING_CONFIG_PATH", "VLLM_CONFIGURE_LOGGING"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


def test_library_records_below_error_go_to_the_file_and_reload_notes_never_to_the_terminal(tmp_path):
    log = tmp_path / "driver.log"
    quiet = _python(RECORDS, str(log), "0")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr.strip().splitlines() == ["ERROR ray.worker: an engine died"]
    for line in ("deprecated", "not initialised", "Failed to load weights"):
        assert line not in quiet.stderr
    text = log.read_text()
    for line in ("FutureWarning: torch.foo is deprecated", "some weights were not initialised",
                 "Failed to load weights", "an engine died"):
        assert line in text, (line, text)
    verbose = _python(RECORDS, str(tmp_path / "verbose.log"), "1")
    assert "torch.foo is deprecated" in verbose.stderr and "some weights were not initialised" in verbose.stderr
    assert not (tmp_path / "verbose.log").exists()


def test_vllm_worker_logs_to_its_file_and_only_errors_reach_the_terminal(tmp_path):
    env = {"GRPO_CLUSTER_LOG_DIR": str(tmp_path / "logs"), "GRPO_CLUSTER_VERBOSE": "0"}
    done = _python(VLLM_WORKER, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "engine error" in done.stderr and "Failed to load weights" not in done.stderr
    assert "rank error" in done.stderr
    assert done.stderr.count("core error") == 1 and "core note" not in done.stderr, done.stderr
    text = (tmp_path / "logs" / "engine-0.log").read_text()
    assert "WARNING" in text and "Failed to load weights" in text and "engine error" in text
    # what a worker writes outside Python's logging (C++ warnings, progress bars, prints, its subprocesses'
    # output) goes to its log file, not to the terminal Ray forwards to the driver
    notes = ("engine note", "raw descriptor note", "printed note", "a library warning", "last resort note",
             "child note")
    for note in notes:
        assert note not in done.stderr and note not in done.stdout, (note, done.stderr, done.stdout)
        assert note in text or note == "engine note", (note, text)
    assert text.count("core error") == 1 and text.count("core note") == 1, text
    verbose = _python(VLLM_WORKER, env={**env, "GRPO_CLUSTER_VERBOSE": "1"})
    assert "Failed to load weights" in verbose.stderr or "Failed to load weights" in verbose.stdout


def test_routing_a_worker_twice_changes_nothing(tmp_path):
    """A second worker built in the same process (route_worker_logs called again) neither takes the log file for the
    terminal nor writes each record twice, nor opens more files."""
    env = {"GRPO_CLUSTER_LOG_DIR": str(tmp_path / "logs"), "GRPO_CLUSTER_VERBOSE": "0"}
    done = _python(ROUTED_TWICE, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("engine error") == 1 and done.stderr.count("rank error") == 1, done.stderr
    text = (tmp_path / "logs" / "train-rank0.log").read_text()
    assert text.count("rank error") == 1 and text.count("library note") == 1, text
    once = _python(ROUTED_TWICE.replace('route_worker_logs("train-rank0")  #', "#"), env=env)
    assert once.returncode == 0 and once.stdout == "" and done.stdout == ""  # stdout goes to the log file too
    counts = [int(line) for line in (tmp_path / "logs" / "train-rank0.log").read_text().split() if line.isdigit()]
    assert len(counts) == 2 and counts[0] == counts[1], counts  # the second call opened no file


def test_run_has_a_verbose_flag():
    assert build_parser().parse_args(["run", "spec.yaml", "--verbose"]).verbose is True
    assert build_parser().parse_args(["run", "spec.yaml"]).verbose is False


@pytest.fixture(scope="module")
def in_process_runs(tiny_model_dir, tmp_path_factory):
    from tests.local_runtime import local_spec

    out = {}
    for mode, flag in (("quiet", "0"), ("verbose", "1")):
        folder = tmp_path_factory.mktemp(mode)
        (folder / "train.jsonl").write_text("".join(
            json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(4)))
        spec = local_spec(tiny_model_dir, str(folder / "out"), total_steps=1,
                          data={"train_path": str(folder / "train.jsonl"), "max_prompt_tokens": 256},
                          metrics={"port": None}, checkpoint={"every_steps": 0, "save_final": False})
        (folder / "spec.json").write_text(spec.model_dump_json())
        out[mode] = (_python(IN_PROCESS_RUN, str(folder / "spec.json"), flag, timeout=600), folder / "out")
    return out


def test_in_process_run_quiet_console_and_driver_log(in_process_runs):
    done, out = in_process_runs["quiet"]
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 1 |" in done.stdout
    library = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("[grpo-cluster]")]
    assert library == [], library
    assert (out / "driver.log").is_file()


def test_in_process_run_verbose_shows_library_output(in_process_runs):
    done, out = in_process_runs["verbose"]
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 1 |" in done.stdout
    assert "Loading weights" in done.stderr  # transformers' progress bars are the library's own output
    assert not (out / "driver.log").exists()
