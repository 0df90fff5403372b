"""The checks every job command makes before it starts or joins a Ray cluster: this interpreter has the driver's
dependencies, ``--import`` modules import, and (``run``, ``validate``) the spec, the cluster address and the job's
inputs are usable.

Imports only the standard library at module level, so a bare interpreter reaches :func:`missing_dependency` and
gets one line saying what is missing.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

DRIVER_MODULES = ("torch", "transformers", "ray", "pydantic", "yaml", "safetensors", "prometheus_client", "tqdm",
                  "filelock", "psutil")
"""Import names of the packages the job's driver process imports (core dependencies in pyproject.toml); vLLM runs in
the engine actors only."""


def missing_dependency() -> str | None:
    """One line naming the first of DRIVER_MODULES this interpreter cannot import (and the interpreter), with what
    to do; None when all are there. Only looks them up (``importlib.util.find_spec``), imports nothing."""
    import importlib.util

    missing = [m for m in DRIVER_MODULES if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    from cluster.ray_shell.control import JOB_ID_ENV

    if os.environ.get(JOB_ID_ENV):  # a job sent by `grpo-cluster submit`
        fix = ("submit with --python PATH (an interpreter on the cluster that has the project's dependencies) or "
               "--pip REQUIREMENT")
    else:
        fix = "install the project's dependencies (scripts/setup.sh) or use the interpreter that has them"
    return f"missing dependency: {', '.join(missing)} (interpreter {sys.executable}); {fix}"


def import_modules(modules) -> str | None:
    """Import ``--import`` modules (e.g. ones registering reward functions); an error message, or None."""
    import importlib

    for name in modules or ():
        if not name.strip():
            return f"--import {name!r}: expected a module name, e.g. my_rewards"
        try:
            importlib.import_module(name)
        except ImportError as exc:
            return f"--import {name}: {exc}"
        except SystemExit as exc:  # the module called sys.exit() while it was imported
            return f"--import {name}: the module exited while it was imported (SystemExit: {exc.code})"
        except Exception as exc:  # noqa: BLE001 - any error the module raises on import is the user's to see
            return f"--import {name}: the module raised while it was imported: {type(exc).__name__}: {exc}"
    return None


def local_cores_problem(spec) -> str | None:
    """Why the local Ray cluster ``run`` starts (every actor on this machine, inheriting this process's CPU
    affinity) could not bind a pool to its ``cpu_affinity`` cores, or None: each core must be one this process may use
    (``os.sched_getaffinity``). On a joined cluster the engine or rank checks its own node when it starts."""
    allowed = os.sched_getaffinity(0)
    for name, pool in (("rollout", spec.rollout), ("train", spec.train)):
        missing = sorted(set(pool.cpu_affinity or ()) - allowed)
        if missing:
            return (f"{name}.cpu_affinity: cores {missing} are not among this machine's usable cores "
                    f"{sorted(allowed)}, where the local Ray cluster `run` starts without --address runs every "
                    f"actor; expected ids among those, got {pool.cpu_affinity}")
    return None


def prepare_job(args, dry_run: bool = False):
    """The checks ``run`` and ``validate`` share, in order, before any Ray cluster is started or joined: this
    interpreter has the dependencies, ``--import`` modules import, the spec (with ``--set``) is valid, the cluster
    address is usable, and the job's inputs are (:func:`cluster.ray_shell.runtime.build_job`: output folders, model,
    tokenizer, data, prompt lengths, earlier checkpoints; with ``dry_run`` nothing is written).

    Returns:
        (job, address or None for a local cluster, where the address came from); or the exit code 2 after the
        problem was printed on stderr.
    """
    problem = missing_dependency()
    if problem:
        print(f"grpo-cluster: {problem}", file=sys.stderr)
        return 2
    from cluster.spec import SpecError, load_spec

    problem = import_modules(args.imports)
    if problem:
        print(f"grpo-cluster: {problem}", file=sys.stderr)
        return 2
    try:
        spec = load_spec(args.spec, args.set or ())
    except SpecError as exc:
        print(f"grpo-cluster: {exc}", file=sys.stderr)  # its own header: file and problem count, or one line
        return 2
    fresh = _absent_folders(spec)  # a refused run removes the folders it created (nothing else)
    routed = None
    if not dry_run:  # run: library notes below ERROR to OUTPUT_DIR/driver.log before anything loads a library
        from contract.console import route_logs

        try:
            routed = route_logs(Path(spec.output_dir) / "driver.log", verbose=getattr(args, "verbose", False))
        except OSError:
            pass  # an output_dir that cannot be written is reported below, naming the field
    prepared = _prepare_spec_job(args, spec, dry_run)
    if isinstance(prepared, int):
        if routed is not None and fresh:  # its file goes with the folder: no handler left pointing into it
            from contract.console import unroute_logs

            unroute_logs(routed)
        for folder in fresh:
            shutil.rmtree(folder, ignore_errors=True)
    return prepared


def _absent_folders(spec) -> list[Path]:
    """``output_dir`` and ``checkpoint.dir`` where they do not exist yet (a refused run leaves no folder behind)."""
    folders = [Path(spec.output_dir)] + ([Path(spec.checkpoint.dir)] if spec.checkpoint.dir else [])
    return [f for f in folders if not f.exists()]


def _prepare_spec_job(args, spec, dry_run: bool):
    """:func:`prepare_job` after the spec is loaded: the job, the cluster address and its source, or exit code 2."""
    from cluster.spec import locate_field_error
    from cluster.data import DataError
    from cluster.data.models import ModelError
    from cluster.ray_shell.runtime import build_job
    from cluster.loop.setup import SetupError
    from cluster.sinks.metrics import MetricsError
    from cluster.ray_shell.ray_init import AddressError, job_address

    try:  # the cluster address is checked before anything heavy is loaded
        address, source = job_address(args.address, spec)
    except AddressError as exc:
        print(f"grpo-cluster: {exc}", file=sys.stderr)
        return 2
    problem = None if address is not None else local_cores_problem(spec)
    if problem:
        print(f"grpo-cluster: {locate_field_error(problem, args.spec, args.set or ())}", file=sys.stderr)
        return 2
    try:  # data, model and output-folder problems surface here, before any cluster starts
        job = build_job(spec, progress=not getattr(args, "no_progress", True), resume=args.resume, dry_run=dry_run,
                        resume_past_trip=getattr(args, "resume_past_trip", False),
                        imports=tuple(args.imports or ()))
    except (DataError, ModelError, MetricsError, SetupError) as exc:
        print(f"grpo-cluster: {locate_field_error(str(exc), args.spec, args.set or ())}", file=sys.stderr)
        return 2
    return job, address, source
