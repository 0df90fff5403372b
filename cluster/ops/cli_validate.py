"""``grpo-cluster validate SPEC.yaml [--set k=v ...] [--address HOST:6379 | auto]``: every check ``run`` makes before
it starts anything (:func:`cluster.ops.prepare.prepare_job`: dependencies, spec, cluster address, output folders,
model and tokenizer, data, prompt lengths, earlier checkpoints), then — when the job would join a cluster
(``--address``, ``ray.address`` or ``$RAY_ADDRESS``) — whether that cluster has the CPUs, GPUs and custom resources
the pools reserve; for the local cluster ``run`` would start, that no custom resource (``rollout.resources``,
``train.resources``) is reserved, since that cluster has none and ``run`` would stop at once, and that the
``cpu_affinity`` cores are among this machine's (:func:`cluster.ops.prepare.local_cores_problem`).
Prints the resolved spec's summary (with the behaviour correction the train ranks apply in ``rollout.mode``
one_step_off/async; a job that turns it off, ``algorithm.off_policy_correction: none``, is warned about on stderr by
the job's own check). Starts no Ray cluster, engine or worker, and writes nothing.

Exit codes: 0 the job can run as given; 2 a problem (printed on stderr, spec values with file:line).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from cluster.ops.prepare import prepare_job


def _cmd_validate(args) -> int:
    prepared = prepare_job(args, dry_run=True)
    if isinstance(prepared, int):
        return prepared
    job, address, source = prepared
    from cluster.ray_shell.pools import InsufficientResources, check_cluster_resources

    have = None
    if address is None:  # the local cluster `run` starts has CPUs (checked in the spec), its GPUs, no custom resource
        try:
            check_cluster_resources(job.spec, {"CPU": math.inf, "GPU": math.inf})
        except InsufficientResources as exc:
            print(f"grpo-cluster: {exc} (the local Ray cluster `run` starts without --address has no custom "
                  f"resources: pass --address of a cluster whose nodes advertise them, or remove rollout.resources "
                  f"/ train.resources)", file=sys.stderr)
            return 2
    else:
        import ray

        from cluster.ray_shell.ray_init import AddressError, init_ray

        try:
            init_ray(job.spec, address, source, log_to_driver=False)
        except AddressError as exc:
            print(f"grpo-cluster: {exc}", file=sys.stderr)
            return 2
        try:
            have = ray.cluster_resources()
        finally:
            ray.shutdown()
        try:
            check_cluster_resources(job.spec, have)
        except InsufficientResources as exc:
            print(f"grpo-cluster: {exc} ({address}, {source})", file=sys.stderr)
            return 2
    print(summary(job, args.spec, address, source, have))
    return 0


def held_out_summary(data) -> str:
    """How many held-out problems a generated source leaves after dropping those also in training (small task spaces
    repeat problems), or why it has none."""
    from cluster.data import DataError
    from cluster.data.sources import describe_source, load_examples

    try:
        examples, dropped = load_examples(data, "held_out")
    except DataError as exc:
        return f"none: {exc}"
    return (f"{len(examples)} problems from {describe_source(data, 'held_out')} ({dropped} dropped: also training "
            f"problems)")


def reward_summary(spec) -> str:
    """Each weighted reward function with its weight and where it is defined (file:line), e.g.
    ``reward.py:correct x1 (examples/own_task/reward.py:14)``."""
    from grpo.rewards import REWARD_FUNCTIONS
    from grpo.rewards.calling import where_defined

    return ", ".join(f"{name} x{weight:g} ({where_defined(REWARD_FUNCTIONS[name])})"
                     for name, weight in spec.algorithm.rewards.items())


def episode_summary(rollout) -> str:
    """``rollout.multi_turn`` in one line: the environment, its options, the turn and token limits."""
    mt = rollout.multi_turn
    options = f" {dict(mt.options)}" if mt.options else ""
    return (f"multi-turn with environment {mt.environment!r}{options}: at most {mt.max_turns} turns of "
            f"{mt.turn_tokens(rollout.max_response_tokens)} tokens, {mt.max_episode_tokens} tokens per episode "
            f"(observations included)")


def summary(job, spec_path: str, address: str | None, source: str, have: dict | None) -> str:
    """The resolved spec in a few lines: what will run, on what, from which inputs, reserving what."""
    from cluster.data.sources import describe_source
    from cluster.ray_shell.pools import resources_needed
    from cluster.spec.algorithm import describe_off_policy

    s, r, t = job.spec, job.spec.rollout, job.spec.train
    need = resources_needed(s)
    start = (f"resume from {job.resume_from} (step {job.step}, policy version {job.policy_version})"
             if job.resume_from is not None else "from step 0")
    if address is None:
        cluster = f"a local Ray cluster on 127.0.0.1 with {s.ray.num_cpus or 'all'} CPUs, started by `run`"
    else:
        cluster = (f"{address} ({source}): has CPU {have.get('CPU', 0):g}, GPU {have.get('GPU', 0):g} — "
                   f"enough")
    lines = [
        ("spec", f"{Path(spec_path)} — job {s.name!r}, {s.total_steps} steps, {start}, seed {s.seed}"),
        ("model", f"{s.model.path} -> {job.model_path} ({s.model.dtype}); tokenizer loaded"),
        ("data", f"{len(job.prompt_ids)} prompts from {describe_source(s.data)} ({job.bad_rows} bad rows skipped, "
                 f"{job.prompts_filtered} over data.max_prompt_tokens={s.data.max_prompt_tokens} dropped)"),
        *([("held-out", held_out_summary(s.data))] if s.data.source == "reasoning_gym" else []),
        ("rollout", f"{r.replicas} engine(s); {r.prompts_per_step} prompts x G={r.group_size} completions per step, "
                    f"at most {r.max_response_tokens} tokens each"
                    + (f"; on cores {r.cpu_affinity}" if r.cpu_affinity is not None else "")),
        *([("episodes", episode_summary(r))] if r.multi_turn is not None else []),
        ("train", f"{t.world_size} rank(s), backend {t.backend}"
         + (f"; on cores {t.cpu_affinity}" if t.cpu_affinity is not None else "") + (
            f"; LoRA rank {t.lora.rank}, alpha/rank {t.lora.scaling:g}, on {t.lora.target_modules}, sync "
            f"{t.lora.sync}" if t.lora is not None else "")),
        ("rewards", reward_summary(s)),
        ("off-policy", describe_off_policy(s.algorithm, r)),
        ("reserves", ", ".join(f"{res} {amount:g} ({how})" for res, (amount, how) in need.items())),
        ("cluster", cluster),
        ("output_dir", f"{Path(s.output_dir).resolve()} (writable; checkpoints in {job.checkpoint_root()})"),
    ]
    if job.evaluation is not None:
        ev, held = s.eval, job.evaluation.evalset
        when = ", ".join(w for w, on in (("at start", ev.at_start), (f"every {ev.every_steps} steps", ev.every_steps),
                                          ("at end", ev.at_end)) if on)
        lines.insert(5, ("eval", f"{len(held.examples)} held-out prompts x {ev.samples} from {held.path} ("
                                 f"{'greedy' if ev.temperature == 0 else f'temperature {ev.temperature:g}'}, at most "
                                 f"{job.evaluation.requests[0].sampling.max_tokens} tokens), {when}"))
    width = max(len(k) for k, _ in lines) + 2
    return "\n".join(f"{k + ':':<{width}}{v}" for k, v in lines) + "\nvalid: nothing was started or written"


def add_validate_command(sub) -> None:
    """Add ``validate`` to the ``grpo-cluster`` subparsers ``sub``."""
    p = sub.add_parser("validate", help="check a job spec, its inputs and (with an address) the cluster; run nothing")
    p.add_argument("spec", help="job spec YAML")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a spec field (repeatable)")
    p.add_argument("--address", default=None, help=(
        "the Ray cluster `run --address` would join (HOST:6379 or auto): its CPUs and GPUs are checked"))
    p.add_argument("--resume", action="store_true", help="check as for `run --resume`")
    p.add_argument("--resume-past-trip", action="store_true", help="check as for `run --resume-past-trip`")
    p.add_argument("--import", dest="imports", action="append", metavar="MODULE",
                   help="import this module before loading the spec, e.g. one that registers reward functions")
    p.set_defaults(func=_cmd_validate)
