"""``grpo-cluster`` command line.

    grpo-cluster run SPEC.yaml [--set dotted.key=value ...] [--address ray://... | auto] [--import MODULE ...]
        # reward functions the spec names ('file.py:function', 'module:function') are imported from the spec's folder
    grpo-cluster run SPEC.yaml --resume [--resume-past-trip]   # continue; past a reward-hacking guard stop only if told
    grpo-cluster run SPEC.yaml --verbose      # library warnings on the console instead of OUTPUT_DIR/driver.log
    grpo-cluster validate SPEC.yaml [--set k=v ...] [--address HOST:6379 | auto]   # checks only, starts nothing
    grpo-cluster --version
    grpo-cluster eval --spec SPEC [--model MODEL] [--set k=v ...] [--limit N] [--per-problem OUT] [--against BASE]
        # the spec's held-out data, prompt and scorer, as the loop's eval/* (cluster/ops/cli_eval.py)
    grpo-cluster eval --model DIR --data FILE [--limit N] [--per-problem OUT] [--against BASE]   # GSM8K rows
    grpo-cluster plot RUN_DIR [--out FILE]      # PNG of reward, held-out accuracy, length, KL, guard trips vs step
    grpo-cluster report RUN_DIR [--out FILE]    # one HTML page: curves, eval table, sample browser (opens offline)
    grpo-cluster merge CKPT --out DIR [--base MODEL]   # a LoRA checkpoint's adapters merged into an HF folder
    grpo-cluster spec --defaults | --schema     # a complete spec of defaults (YAML), or the spec's JSON Schema

Ray Jobs API (cluster/ops/jobs.py; --address http://HOST:8265, default $RAY_ADDRESS or http://127.0.0.1:8265):

    grpo-cluster submit SPEC.yaml [--set k=v ...] [--pip REQ ...] [--env K=V ...] [--follow]   # prints the job id
    grpo-cluster status JOB | logs JOB [--follow] | stop JOB
    grpo-cluster scale JOB --rollout-replicas N | scale JOB SPEC.yaml [--set k=v ...]

Exit codes: 0 done (``grpo-cluster`` with no command prints this help and exits 0); 2 bad input or cluster or job not
found (nothing submitted, one message on stderr naming the flag or spec field as written); ``logs --follow`` and
``submit --follow`` give 1 when the job ended FAILED or STOPPED; 130 on Ctrl-C; ``run``: 75 after a SIGTERM
(``checkpoint.on_preempt``: the checkpoint written within its deadline, one line saying how to continue).
"""

from __future__ import annotations

import os
import shlex
import sys

from cluster.ops.cli_args import Parser
from cluster.ops.cli_eval import add_eval_command
from cluster.ops.cli_jobs import add_job_commands
from cluster.ops.cli_merge import add_merge_command
from cluster.ops.cli_report import add_report_command
from cluster.ops.cli_spec import add_spec_command
from cluster.ops.cli_validate import add_validate_command
from cluster.ops.prepare import prepare_job


def _cmd_run(args) -> int:
    prepared = prepare_job(args)
    if isinstance(prepared, int):
        return prepared
    job, address, source = prepared
    spec = job.spec
    from cluster.ray_shell.restarts import run_with_restarts
    from contract.errors import StaleSamplesError
    from cluster.ray_shell.pools import InsufficientResources
    from cluster.loop.training import NumericsError
    from cluster.ray_shell.ray_init import AddressError, init_ray

    import ray

    try:
        init_ray(spec, address, source, verbose=args.verbose)
    except AddressError as exc:
        print(f"grpo-cluster: {exc}", file=sys.stderr)
        return 2
    from cluster.loop.preemption import Preempted
    from cluster.loop.scoring import InfraFailureError
    from cluster.ray_shell.pools import EngineFailure, TrainWorkerFailure, WorkerTimeout
    from cluster.ray_shell.sync import SyncMemberError
    from grpo.rewards import RewardError
    from weight_sync.verify import SyncVerificationError

    try:
        job, _ = run_with_restarts(spec, progress=not args.no_progress, resume=args.resume, first_job=job,
                                         imports=tuple(args.imports or ()))
    except InsufficientResources as exc:
        print(f"grpo-cluster: {exc}", file=sys.stderr)
        return 2
    except Preempted as exc:  # the workers are shut down (run_with_restarts) and Ray too (below) before the exit
        print(f"grpo-cluster: {exc}; continue with {_resume_hint(args)}", file=sys.stderr)
        return exc.exit_code
    except (TrainWorkerFailure, EngineFailure, WorkerTimeout, SyncMemberError, NumericsError, StaleSamplesError,
            SyncVerificationError, InfraFailureError, RewardError, ray.exceptions.RayError) as exc:
        print(f"grpo-cluster: job failed: {type(exc).__name__}: {exc}\n"
              f"grpo-cluster: checkpoints written so far are kept; continue with `grpo-cluster run {args.spec} "
              f"--resume`", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    from cluster.loop.summary import summary_text

    print(summary_text(job.summary), file=sys.stderr)  # held-out before/after, time, goodput, warnings, outputs
    return 0


def _resume_hint(args) -> str:
    """How to continue a preempted ``run``: the same command with ``--resume``; for a job sent by ``grpo-cluster
    submit``, submitting its spec again with ``resume=auto``."""
    from cluster.ray_shell.control import JOB_ID_ENV

    if os.environ.get(JOB_ID_ENV):
        return "`grpo-cluster submit SPEC --set resume=auto` (the same spec and --set options)"
    words = ["grpo-cluster", "run", args.spec, *(w for kv in args.set or () for w in ("--set", kv)),
             *(f"--import={m}" for m in args.imports or ())]
    if args.address:
        words += ["--address", args.address]
    return f"`{shlex.join([*words, '--resume'])}`"


def _cmd_plot(args) -> int:
    from cluster.sinks.plot import PlotError, plot_run

    notes: list[str] = []
    try:
        out = plot_run(args.run_dir, args.out, title=args.title, notes=notes)
    except (PlotError, OSError) as exc:
        print(f"grpo-cluster plot: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"grpo-cluster plot: note: {note}", file=sys.stderr)
    print(f"wrote {out}")
    return 0


def _version() -> str:
    """The installed ``grpo-cluster`` distribution's version, from its package metadata."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("grpo-cluster")
    except PackageNotFoundError:
        return "unknown (the grpo-cluster package is not installed: pip install -e .)"


def build_parser() -> Parser:
    parser = Parser(prog="grpo-cluster", description="GRPO training on Ray with vLLM and FSDP2.",
                    epilog="grpo-cluster COMMAND --help describes a command; docs/getting_started.md the rest.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", help="run a job spec on a local Ray cluster (or join --address)")
    run.add_argument("spec", help="job spec YAML")
    run.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a spec field (repeatable)")
    run.add_argument("--address", default=None, help="join this Ray cluster instead of starting a local one")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--verbose", action="store_true", help=(
        "show library log records and warnings (vLLM, Ray, transformers, ...) on the console; by default those below "
        "ERROR go to OUTPUT_DIR/driver.log and each worker's OUTPUT_DIR/logs/<worker>.log"))
    run.add_argument("--resume", action="store_true",
                     help="continue from the latest complete checkpoint (same as spec resume: auto)")
    run.add_argument("--resume-past-trip", action="store_true",
                     help="with --resume: continue a job the reward-hacking guard (monitor section) stopped")
    run.add_argument("--import", dest="imports", action="append", metavar="MODULE",
                     help="import this module before loading the spec, e.g. one that registers reward functions")
    run.set_defaults(func=_cmd_run)
    add_eval_command(sub)
    plot = sub.add_parser("plot", help="PNG of a run's reward, held-out accuracy, length, KL and guard trips")
    plot.add_argument("run_dir", help="the job's output_dir (holds metrics.jsonl)")
    plot.add_argument("--out", default=None, help="PNG path; default RUN_DIR/plot.png")
    plot.add_argument("--title", default=None, help="figure title; default the job's name (RUN_DIR/spec.yaml)")
    plot.set_defaults(func=_cmd_plot)
    add_report_command(sub)
    add_validate_command(sub)
    add_merge_command(sub)
    add_spec_command(sub)
    add_job_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command ``argv`` names (default ``sys.argv[1:]``); returns the exit code (module docstring). No
    command: the help, 0."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version (0) or a bad argument (2, message printed): a code, as commands give
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("grpo-cluster: interrupted; checkpoints already written are kept", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
