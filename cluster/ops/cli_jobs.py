"""``grpo-cluster submit / status / logs / stop / scale``: the Ray Jobs API subcommands (logic in cluster/ops/jobs.py).

Every command takes ``--address http://HOST:8265`` (the dashboard / Jobs API address; default
``$RAY_API_SERVER_ADDRESS``, ``$RAY_ADDRESS`` or ``http://127.0.0.1:8265``). Problems the user can fix (unreachable
address, unknown job id, invalid spec, a spec change that cannot be applied live) print one message on stderr and
exit 2, without a traceback.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime

from cluster.ops.cli_args import seconds, whole_number
from cluster.ops.prepare import import_modules

PREFIX = "grpo-cluster"


def _fail(command: str, message: str) -> int:
    print(f"{PREFIX} {command}: {message}", file=sys.stderr)
    return 2


def _load(command: str, spec_path: str, overrides, imports):
    """The validated spec (the cluster is joined with address auto, so ``ray.address=auto`` is implied); or an exit
    code 2 after printing the problem."""
    from cluster.spec import SpecError, load_spec

    problem = import_modules(imports)
    if problem:
        return _fail(command, problem)
    try:
        return load_spec(spec_path, ["ray.address=auto", *(overrides or ())])
    except SpecError as exc:
        return _fail(command, f"nothing submitted: {exc}")


def _env_pairs(pairs) -> dict[str, str]:
    out = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--env {pair!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _python(args) -> str:
    """``--python``, else :func:`cluster.ops.jobs.default_python` for the address (said on stderr)."""
    from cluster.ops import jobs

    if args.python:
        return args.python
    python, why = jobs.default_python(args.address)
    print(f"{PREFIX}: --python {python} ({why}; pass --python to choose another)", file=sys.stderr)
    return python


def _finished(status: str, job_id: str) -> int:
    print(f"{PREFIX}: job {job_id} {status}", file=sys.stderr)
    return 0 if status == "SUCCEEDED" else 1


def _cmd_submit(args) -> int:
    from cluster.ops import jobs

    spec = _load("submit", args.spec, args.set, args.imports)
    if isinstance(spec, int):
        return spec
    try:
        env = _env_pairs(args.env)
    except ValueError as exc:
        return _fail("submit", str(exc))
    if not spec.output_dir.startswith("/"):
        print(f"{PREFIX} submit: note: output_dir {spec.output_dir!r} is relative, so on the cluster it lands in the "
              f"job's temporary working dir; use an absolute path on shared storage to keep it "
              f"(--set output_dir=/path)", file=sys.stderr)
    try:
        from pathlib import Path

        from cluster.ops.reward_files import reward_files

        root = Path(args.working_dir) if args.working_dir else jobs.project_root()
        shipped = reward_files(spec, Path(args.spec).resolve().parent, root)  # refused here, before connecting
        client = jobs.connect(args.address)  # checks the address before anything is derived from it
        python = _python(args)
        job_id = jobs.submit_spec(client, spec, python=python, imports=args.imports or (), pip=args.pip or (),
                                  env=env, working_dir=args.working_dir, submission_id=args.job_id,
                                  source=args.spec, extra_files=shipped)
    except jobs.JobsError as exc:
        return _fail("submit", str(exc))
    print(job_id)
    sys.stdout.flush()
    if not args.follow:
        return 0
    try:
        return _finished(jobs.follow_logs(client, job_id), job_id)
    except jobs.JobsError as exc:
        return _fail("submit", str(exc))


def _cmd_status(args) -> int:
    from cluster.ops import jobs

    try:
        details = jobs.job_details(jobs.connect(args.address), args.job)
        spec = jobs.submitted_spec(details)
    except jobs.JobsError as exc:
        return _fail("status", str(exc))

    def when(ms):
        return datetime.fromtimestamp(ms / 1000).isoformat(timespec="seconds") if ms else "-"

    print(f"job:        {args.job}\nstatus:     {details.status}\nmessage:    {details.message or '-'}\n"
          f"entrypoint: {details.entrypoint}\nstarted:    {when(details.start_time)}\nended:      "
          f"{when(details.end_time)}")
    if spec is not None:
        host, port = spec["metrics"]["host"], spec["metrics"]["port"]
        metrics = f"http://{host}:{port}/metrics" if port else "no fixed port"
        print(f"spec:       {spec['name']} ({(details.metadata or {}).get('grpo_cluster_spec_source') or '?'}), "
              f"{spec['total_steps']} steps, {spec['rollout']['replicas']} rollout replica(s) at start, output_dir "
              f"{spec['output_dir']}, metrics {metrics} on the driver's node")
    return 0


def _cmd_logs(args) -> int:
    from cluster.ops import jobs

    try:
        client = jobs.connect(args.address)
        if args.follow:
            return _finished(jobs.follow_logs(client, args.job), args.job)
        sys.stdout.write(jobs.job_logs(client, args.job))
    except jobs.JobsError as exc:
        return _fail("logs", str(exc))
    return 0


def _cmd_stop(args) -> int:
    from cluster.ops import jobs

    try:
        client = jobs.connect(args.address)
        was_running = jobs.stop_job(client, args.job)
        if was_running and args.wait_s > 0:
            status = str(jobs.wait_for_job(client, args.job, args.wait_s).status)
        else:
            status = str(jobs.job_details(client, args.job).status)
    except jobs.JobsError as exc:
        return _fail("stop", str(exc))
    print(f"job {args.job}: {'stop requested' if was_running else 'was not running'}; status {status}")
    return 0


def _cmd_scale(args) -> int:
    from cluster.ops import jobs
    from cluster.ray_shell import control

    if (args.rollout_replicas is None) == (args.spec is None):
        return _fail("scale", "give exactly one of --rollout-replicas N or a changed SPEC.yaml")
    if args.set and args.spec is None:
        return _fail("scale", "--set applies to SPEC.yaml; with --rollout-replicas there is no spec")
    try:
        n = args.rollout_replicas
        if n is not None:
            control.check_replicas(n)
        client = jobs.connect(args.address)
        if args.spec is not None:
            old = jobs.submitted_spec(jobs.job_details(client, args.job))
            if old is None:
                return _fail("scale", f"job {args.job!r} was not submitted with `grpo-cluster submit`, so its spec is "
                                      f"not on record; use --rollout-replicas N")
            new = _load("scale", args.spec, args.set, args.imports)
            if isinstance(new, int):
                return new
            _, fixed = jobs.live_spec_changes(old, new)
            if fixed:
                return _fail("scale", f"{args.spec} changes fields that cannot be applied to a running job: "
                                      f"{', '.join(fixed)} (only {', '.join(jobs.LIVE_FIELDS)} can; submit a new "
                                      f"job for the rest)")
            n = new.rollout.replicas
        control.check_replicas(n)
        result = jobs.request_scale(client, args.job, n, python=_python(args), timeout_s=args.timeout_s)
    except (jobs.JobsError, ValueError) as exc:
        return _fail("scale", str(exc))
    status = result.get("status") or {}
    if status:
        engines = status.get("rollout_replicas", status.get("engines", "?"))
        seen = (f"the driver last reported step {status.get('step', '?')}, policy version "
                f"{status.get('policy_version', '?')}, {engines} engine(s) serving "
                f"({result.get('reported_s_ago')} s ago)")
    else:
        seen = "the driver has not reported yet"
    print(f"job {args.job}: rollout replicas {result['previous_desired']} -> {result['desired_rollout_replicas']} "
          f"requested; {seen}. The driver resizes the pool between steps.")
    return 0


def add_job_commands(sub) -> None:
    """Add submit/status/logs/stop/scale to the ``grpo-cluster`` subparsers ``sub``."""

    def with_address(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--address", default=None, help=(
            "Ray dashboard / Jobs API address http://HOST:8265 (default $RAY_ADDRESS or http://127.0.0.1:8265)"))
        return p

    def with_python(p: argparse.ArgumentParser) -> None:
        p.add_argument("--python", default=None, help=(
            "Python interpreter on the cluster nodes that has the project's dependencies (default: this interpreter "
            "when the cluster is on this machine, else python)"))

    submit = with_address(sub.add_parser("submit", help="submit a job spec to a Ray cluster (Ray Jobs API)"))
    submit.add_argument("spec", help="job spec YAML (validated here first)")
    submit.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a spec field (repeatable)")
    submit.add_argument("--import", dest="imports", action="append", metavar="MODULE", help=(
        "module the job imports before loading the spec (custom reward functions); importable here and there"))
    submit.add_argument("--pip", action="append", metavar="REQUIREMENT", help=(
        "pip requirement Ray installs for this job (runtime env); not needed when the cluster's image has the "
        "project's dependencies"))
    submit.add_argument("--env", action="append", metavar="KEY=VALUE", help="environment variable of the job")
    submit.add_argument("--working-dir", default=None, help="folder to upload instead of the project root")
    submit.add_argument("--job-id", default=None, help="submission id to use (default <spec name>-<8 hex>)")
    submit.add_argument("--follow", action="store_true", help="then follow the logs until the job ends")
    with_python(submit)
    submit.set_defaults(func=_cmd_submit)

    status = with_address(sub.add_parser("status", help="status of a submitted job"))
    status.add_argument("job", help="job (submission) id")
    status.set_defaults(func=_cmd_status)

    logs = with_address(sub.add_parser("logs", help="logs of a submitted job"))
    logs.add_argument("job", help="job (submission) id")
    logs.add_argument("--follow", "-f", action="store_true", help="stream until the job ends (exit 0 if SUCCEEDED)")
    logs.set_defaults(func=_cmd_logs)

    stop = with_address(sub.add_parser("stop", help="stop a submitted job"))
    stop.add_argument("job", help="job (submission) id")
    stop.add_argument("--wait-s", type=seconds(0), default=30.0, help="wait this long for it to end (0: do not wait)")
    stop.set_defaults(func=_cmd_stop)

    scale = with_address(sub.add_parser("scale", help="resize a running job's rollout pool"))
    scale.add_argument("job", help="job id (submission id; the spec name for `grpo-cluster run --address`)")
    scale.add_argument("spec", nargs="?", default=None, help="changed job spec: its rollout.replicas is applied")
    scale.add_argument("--rollout-replicas", type=whole_number(1), default=None, metavar="N",
                       help="desired rollout engines")
    scale.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a field of SPEC.yaml")
    scale.add_argument("--import", dest="imports", action="append", metavar="MODULE",
                       help="module to import before loading SPEC.yaml")
    scale.add_argument("--timeout-s", type=seconds(1), default=120.0, help="wait this long for the control job")
    with_python(scale)
    scale.set_defaults(func=_cmd_scale)
