"""Ray Jobs API wrappers behind ``grpo-cluster submit / status / logs / stop / scale``.

    grpo-cluster submit examples/demo_cpu.yaml --set total_steps=4 --address http://HOST:8265
    grpo-cluster logs JOB --follow          # exit 0 when the job SUCCEEDED, 1 when it FAILED or was STOPPED
    grpo-cluster scale JOB --rollout-replicas 2

Everything goes through :class:`ray.job_submission.JobSubmissionClient`, i.e. the dashboard's HTTP address
(``http://HOST:8265``), never the GCS port:

- **submit** validates the spec here (a bad spec is rejected before anything is sent), then uploads a copy of the
  project (without .venv, .git, runs/, outputs/, caches) plus the validated spec as ``grpo_job_spec.yaml`` as the
  job's ``working_dir`` and runs ``PYTHON -m cluster.cli run grpo_job_spec.yaml --address auto`` there
  (PYTHON: ``--python``, default :func:`default_python`). Links in the project folder are followed as Ray follows
  them, and the size limit counts what they point to (:func:`upload_files`). The spec is
  sent with its paths resolved as on this machine, so data and model paths must exist on the cluster nodes too
  (absolute paths on shared storage, or the same layout). The submission id is also put in the runtime env as
  ``GRPO_CLUSTER_JOB_ID`` (the control actor's name) and the validated spec in the job metadata (``scale JOB
  SPEC.yaml`` compares against it).
- **scale** submits a tiny job, ``python -m cluster.ray_shell.control set JOB N`` (working dir:
  ``cluster/ray_shell/control.py`` alone), that joins the cluster with ``address=auto`` and calls the job's control
  actor; it waits for that job to finish and prints what the actor answered. This needs only the dashboard address
  (the GCS address cannot in general be derived from it) and costs a few seconds per request.

Errors meant for the user (unreachable address, unknown job id, a spec change that cannot be applied live) are
raised as :class:`JobsError`; the CLI prints them and exits 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TextIO
from urllib.parse import urlparse

from cluster.ops.upload import (MAX_UPLOAD_BYTES, UPLOAD_EXCLUDES, JobsError, project_root, stage_working_dir,
                                upload_files)
from cluster.ray_shell import control
from cluster.ray_shell.ray_init import use_token_if_available

__all__ = [
    "DEFAULT_ADDRESS", "SPEC_FILE", "UPLOAD_EXCLUDES", "JobsError", "connect", "default_address", "default_python",
    "follow_logs",
    "job_details", "job_logs", "live_spec_changes", "request_scale", "stage_working_dir", "stop_job", "submit_spec",
    "submitted_spec", "upload_files", "wait_for_job",
]

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
SPEC_FILE = "grpo_job_spec.yaml"
"""Name of the validated spec at the root of a submitted job's working dir."""
METADATA_SPEC = "grpo_cluster_spec"
"""Job metadata key holding the submitted spec as JSON (``JobSpec.model_dump_json``)."""
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
LIVE_FIELDS = ("rollout.replicas",)
"""Spec fields ``scale JOB SPEC.yaml`` may change in a running job."""


def default_address() -> str:
    """``$RAY_API_SERVER_ADDRESS`` (as Ray's own ``ray job`` CLI), else ``$RAY_ADDRESS``, else DEFAULT_ADDRESS."""
    return os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS


def connect(address: str | None, timeout_s: float = 5.0):
    """A JobSubmissionClient for the dashboard at ``address`` (``http://HOST:8265``; no scheme means http).

    A TCP connection to HOST:PORT must open within ``timeout_s`` first, so a wrong address fails in seconds.
    Token authentication: as ``ray start`` and ``ray.init(address="auto")`` do, when ``$RAY_AUTH_MODE`` is unset and
    a Ray token is available (``~/.ray/auth_token``, ``$RAY_AUTH_TOKEN``, ``$RAY_AUTH_TOKEN_PATH``) it is sent.
    Raises JobsError when the address cannot be reached, refuses the token, or does not serve the Jobs API.
    """
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    address = address or default_address()
    url = address if "://" in address else f"http://{address}"
    try:
        parsed = urlparse(url)
        port = parsed.port  # raises ValueError for a port out of range or not a number
    except ValueError as exc:
        raise JobsError(f"malformed address {address}: {exc}; expected http://HOST:8265") from None
    if parsed.scheme in ("http", "https") and parsed.hostname:
        port = port or (443 if parsed.scheme == "https" else 80)
        try:
            socket.create_connection((parsed.hostname, port), timeout=timeout_s).close()
        except OSError as exc:
            raise JobsError(f"cannot reach the Ray dashboard at {address} ({exc}); expected the Jobs API address "
                            f"http://HOST:8265 of a running cluster (--address or $RAY_ADDRESS)") from None
    use_token_if_available()
    try:
        return JobSubmissionClient(url)
    except AuthenticationError as exc:
        raise JobsError(f"the Ray cluster at {address} requires token authentication: {exc}") from None
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise JobsError(f"no Ray Jobs API at {address}: {exc}") from None


# ----------------------------------------------------------------------------------------------------- submit
def default_python(address: str | None) -> tuple[str, str]:
    """The interpreter a job's entrypoint runs with when ``--python`` is not given, and why.

    A cluster whose dashboard is on this machine (a loopback address or one of this machine's interface addresses)
    gets this interpreter, ``sys.executable``: the one running grpo-cluster, so it has the project — the plain
    ``python`` on the head's PATH may be another one (a head started as ``.venv/bin/ray start --head`` without
    activating the venv runs its jobs' ``python`` from the system). Any other cluster gets ``python``; a missing
    dependency there is reported by the job in one line (``grpo-cluster run``'s dependency check).

    Returns:
        (interpreter, reason shown to the user).
    """
    host = urlparse(address if address and "://" in address else f"http://{address or default_address()}").hostname
    if host and _is_this_machine(host):
        return sys.executable, f"the cluster at {host} is on this machine: the job runs with this interpreter"
    return "python", f"the cluster at {host} is another machine: the job runs with the `python` on its PATH"


def _is_this_machine(host: str) -> bool:
    import ipaddress

    import psutil

    try:
        ips = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    local = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    return any(ipaddress.ip_address(ip.split("%")[0]).is_loopback or ip in local for ip in ips)


@contextlib.contextmanager
def _quiet_upload():
    """Ray logs every working-dir upload step at INFO on stderr; keep warnings and errors only."""
    names = ("ray._private.runtime_env.packaging", "ray.dashboard.modules.dashboard_sdk",
             "ray.dashboard.modules.job.sdk")
    loggers = [logging.getLogger(n) for n in names]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def _job_id_for(name: str) -> str:
    """``<spec name>-<8 hex>``; characters other than letters, digits, ``_.-`` become ``-``."""
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '-', name)[:40]}-{secrets.token_hex(4)}"


def stop_wait_env(spec) -> dict[str, str]:
    """``RAY_JOB_STOP_WAIT_TIME_S`` of a job's runtime env: ``ray job stop`` (``grpo-cluster stop``, a RayJob
    deleted) sends the driver SIGTERM and SIGKILL that many seconds later (Ray's default: 3), so it is set to
    ``checkpoint.on_preempt.deadline_s`` plus a margin (:func:`cluster.loop.preemption.kill_after_s`) for the
    preemption checkpoint; {} when ``checkpoint.on_preempt.enabled`` is false."""
    from cluster.loop.preemption import RAY_STOP_WAIT_ENV, kill_after_s

    on_preempt = spec.checkpoint.on_preempt
    return {RAY_STOP_WAIT_ENV: str(kill_after_s(on_preempt))} if on_preempt.enabled else {}


def submit_spec(client, spec, *, python: str = "python", imports: Sequence[str] = (), pip: Sequence[str] = (),
                env: Mapping[str, str] = {}, working_dir: str | Path | None = None,
                submission_id: str | None = None, source: str = "", extra_files: Mapping[str, str] = {}) -> str:
    """Submit a validated JobSpec as a Ray job; returns the submission id.

    Args:
        client: a JobSubmissionClient (:func:`connect`).
        spec: the validated ``cluster.spec.JobSpec``.
        python: interpreter on the cluster nodes that has the project's dependencies (the CLI's default:
            :func:`default_python`); one without them fails the job with one ``missing dependency`` line.
        imports: modules the job imports before loading the spec (``run --import``), e.g. custom reward functions;
            they must be importable there (inside the working dir or installed).
        pip: requirements Ray installs into a job-specific virtualenv (runtime env ``pip``); empty when the cluster's
            image or environment already has them.
        env: extra environment variables of the job (they win over :func:`stop_wait_env`'s).
        working_dir: folder to upload instead of the project root.
        submission_id: the job id to use (default ``<spec name>-<8 hex>``).
        source: where the spec came from (stored in the metadata, shown by ``status``).
        extra_files: files added to the working dir (relative path → text): the spec's reward files
            (:func:`cluster.ops.reward_files.reward_files`).
    Raises JobsError when the upload is too big or the server refuses the job (e.g. a duplicate id).
    """
    from cluster.spec import spec_to_yaml

    submission_id = submission_id or _job_id_for(spec.name)
    root = Path(working_dir).resolve() if working_dir else project_root()
    entrypoint = " ".join([shlex.quote(python), "-m", "cluster.cli", "run", SPEC_FILE, "--address", "auto",
                           "--no-progress", *(f"--import={shlex.quote(m)}" for m in imports)])
    runtime_env: dict = {"env_vars": {**stop_wait_env(spec), **env, control.JOB_ID_ENV: submission_id}}
    if pip:
        runtime_env["pip"] = list(pip)
    metadata = {"job_name": spec.name, METADATA_SPEC: spec.model_dump_json(), "grpo_cluster_spec_source": source}
    with tempfile.TemporaryDirectory(prefix="grpo-submit-") as tmp:
        files = {**extra_files, SPEC_FILE: spec_to_yaml(spec)}
        runtime_env["working_dir"] = str(stage_working_dir(root, Path(tmp) / "job", files))
        try:
            with _quiet_upload():
                return client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env, metadata=metadata,
                                         submission_id=submission_id)
        except (RuntimeError, ConnectionError) as exc:
            raise JobsError(f"the cluster refused the job: {exc}") from None


# ------------------------------------------------------------------------------------------ status, logs, stop
def job_details(client, job_id: str):
    """The job's ``JobDetails``; raises JobsError naming the id when the cluster has no such job."""
    try:
        return client.get_job_info(job_id)
    except RuntimeError as exc:
        if "404" in str(exc) or "does not exist" in str(exc):
            raise JobsError(f"no job {job_id!r} on this cluster (`ray job list` or the dashboard lists them)") from None
        raise JobsError(f"cannot get job {job_id!r}: {exc}") from None


def submitted_spec(details) -> dict | None:
    """The spec a job was submitted with by :func:`submit_spec`, as the plain dict of ``JobSpec.model_dump(mode=
    "json")``, or None for a job submitted otherwise. Not validated again: it may name reward functions that only
    the job's ``--import`` modules register."""
    text = (details.metadata or {}).get(METADATA_SPEC)
    return json.loads(text) if text else None


def job_logs(client, job_id: str) -> str:
    """Everything the job's entrypoint printed so far; raises JobsError for an unknown id."""
    job_details(client, job_id)
    return client.get_job_logs(job_id)


def follow_logs(client, job_id: str, out: TextIO = sys.stdout) -> str:
    """Write the job's logs to ``out`` as they come until the job ends; returns its final status string.

    Raises JobsError for an unknown id or when the log stream breaks before the job ended.
    """
    job_details(client, job_id)

    async def tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            out.write(chunk)
            out.flush()

    try:
        asyncio.run(tail())
    except RuntimeError as exc:
        raise JobsError(f"log stream of job {job_id!r} broke: {exc}") from None
    status = str(wait_for_job(client, job_id, timeout_s=30).status)
    return status


def wait_for_job(client, job_id: str, timeout_s: float, poll_s: float = 0.5):
    """Poll until the job is SUCCEEDED, FAILED or STOPPED; returns its JobDetails (the last seen on timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        details = job_details(client, job_id)
        if str(details.status) in TERMINAL or time.monotonic() >= deadline:
            return details
        time.sleep(poll_s)


def stop_job(client, job_id: str) -> bool:
    """Ask Ray to stop the job (SIGTERM, then SIGKILL); True if it was running. JobsError for an unknown id."""
    job_details(client, job_id)
    try:
        return client.stop_job(job_id)
    except RuntimeError as exc:
        raise JobsError(f"cannot stop job {job_id!r}: {exc}") from None


# ------------------------------------------------------------------------------------------------------ scale
def live_spec_changes(old, new) -> tuple[list[str], list[str]]:
    """Compare two specs (JobSpecs or their ``model_dump(mode="json")`` dicts) field by field (dotted names);
    returns (changed live fields, changed other fields).

    Only LIVE_FIELDS can be applied to a running job; the ``ray`` section (how to reach the cluster) is ignored.
    """
    def flat(d: Mapping, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            key = f"{prefix}{k}"
            out.update(flat(v, key + ".") if isinstance(v, Mapping) and v else {key: v})
        return out

    a, b = (flat(x if isinstance(x, Mapping) else x.model_dump(mode="json")) for x in (old, new))
    changed = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and not k.startswith("ray."))
    return [k for k in changed if k in LIVE_FIELDS], [k for k in changed if k not in LIVE_FIELDS]


def request_scale(client, job_id: str, rollout_replicas: int, *, python: str = "python",
                  timeout_s: float = 120) -> dict:
    """Set the job's desired rollout replicas through its control actor (via a tiny control job).

    Returns the actor's answer: ``{"job_id", "desired_rollout_replicas", "previous_desired", "status": {the
    driver's last report: step, policy_version, engines, ...}, "reported_s_ago"}``. Raises JobsError when the job
    has ended, has no control actor, or the request is refused (out of bounds).
    """
    control.check_replicas(rollout_replicas)
    try:
        state = str(client.get_job_status(job_id))
    except RuntimeError:
        state = None  # not a submitted job: maybe a `grpo-cluster run` driver named by its spec
    if state in TERMINAL:
        raise JobsError(f"job {job_id!r} is {state}: nothing to scale")
    return _control_call(client, ["set", job_id, str(rollout_replicas)], python=python, timeout_s=timeout_s)


def _control_call(client, args: Iterable[str], *, python: str, timeout_s: float) -> dict:
    """Run ``python -m cluster.ray_shell.control ARGS`` as a Ray job whose working dir holds only
    cluster/ray_shell/control.py (and the two package markers); returns the parsed RESULT line, raises JobsError with
    the ERROR line (or the log tail) otherwise."""
    args = list(args)
    here = Path(control.__file__).resolve().parent
    entrypoint = " ".join([shlex.quote(python), "-m", "cluster.ray_shell.control", *map(shlex.quote, args)])
    with tempfile.TemporaryDirectory(prefix="grpo-control-") as tmp:
        pkg = Path(tmp) / "cluster" / "ray_shell"
        pkg.mkdir(parents=True)
        (pkg.parent / "__init__.py").write_text("")
        (pkg / "__init__.py").write_text("")
        shutil.copy2(here / "control.py", pkg / "control.py")
        try:
            with _quiet_upload():
                control_id = client.submit_job(
                    entrypoint=entrypoint, runtime_env={"working_dir": tmp},
                    submission_id=f"grpo-control-{re.sub(r'[^A-Za-z0-9_-]', '_', args[1])[:60]}-{args[0]}-"
                                  f"{secrets.token_hex(3)}",  # the raw id may hold '/' or '..' (log file names)
                    metadata={"job_name": f"grpo-cluster-control {' '.join(args)}"})
        except (RuntimeError, ConnectionError) as exc:
            raise JobsError(f"cannot submit the control job: {exc}") from None
    details = wait_for_job(client, control_id, timeout_s)
    logs = client.get_job_logs(control_id)
    if str(details.status) in TERMINAL:
        with contextlib.suppress(RuntimeError):
            client.delete_job(control_id)  # keep `ray job list` to the real jobs
    for line in reversed(logs.splitlines()):
        if line.startswith(control.RESULT_MARKER):
            return json.loads(line[len(control.RESULT_MARKER):])
        if line.startswith(control.ERROR_MARKER):
            raise JobsError(line[len(control.ERROR_MARKER):].strip())
    if str(details.status) not in TERMINAL:
        client.stop_job(control_id)
        raise JobsError(f"the control job {control_id} did not finish in {timeout_s:.0f} s")
    tail = "\n".join(logs.splitlines()[-20:])
    hint = (f"\n(the interpreter {python!r} on the cluster has no Ray: pass --python with the cluster's Python)"
            if "No module named 'ray'" in logs else "")
    raise JobsError(f"the control job {control_id} ended {details.status} without an answer "
                    f"({details.message}); its last log lines:\n{tail}{hint}")
