"""``grpo-cluster validate SPEC.yaml [--set k=v ...] [--address HOST:6379 | auto]``: every check ``run`` makes before
it starts anything (:func:`cluster.ops.prepare.prepare_job`: dependencies, spec, cluster address, output folders,
model and tokenizer, data, prompt lengths, earlier checkpoints), then — when the job would join a cluster
(``--address``, ``ray.address`` or ``$RAY_ADDRESS``) — whether that cluster has the CPUs, GPUs and custom resources
the pools reserve; for the local cluster ``run`` would start, the same check against what that cluster would have
(:func:`cluster.ray_shell.ray_init.local_cluster_resources`: this machine's CPUs, or ``ray.num_cpus``, and GPUs as
Ray counts them; no custom resource), and that the ``cpu_affinity`` cores are among this machine's
(:func:`cluster.ops.prepare.local_cores_problem`).
Prints the resolved spec's summary: what runs, on what (pools, strategy, torch.distributed backend), how (learning
rate and its schedule, the objective, the rewards and their weights), from which inputs, reserving what; the
``variants`` line gives each registry-selected choice with the values in force of the settings that belong with it,
and the ``implied`` line the settings a choice implied because the spec left them out (``cluster.spec.implied``:
GSPO's clip range for ``policy_loss: gspo``, ...), each with why. Starts no
Ray cluster, engine or worker, and leaves nothing behind (the output folder is proven writable by creating and
removing a file). The ``off-policy`` line names the behaviour correction the train ranks apply in ``rollout.mode``
one_step_off/async; a job that turns it off (``algorithm.off_policy_correction: none``) is warned about on stderr.

Exit codes: 0 the job can run as given; 2 a problem (printed on stderr, spec values with file:line).
"""

from __future__ import annotations

import sys
from pathlib import Path

from cluster.ops.prepare import prepare_job


def _cmd_validate(args) -> int:
    prepared = prepare_job(args, dry_run=True)
    if isinstance(prepared, int):
        return prepared
    job, address, source = prepared
    from cluster.ray_shell.pools import InsufficientResources, check_cluster_resources

    if address is None:  # the local cluster `run` starts: this machine's CPUs and GPUs as Ray counts them, no custom
        from cluster.ray_shell.ray_init import local_cluster_resources

        have = local_cluster_resources(job.spec)
        where = (f"the local Ray cluster `run` starts without --address: CPU {have['CPU']:g}, GPU {have['GPU']:g}, "
                 f"no custom resources; pass --address of a cluster that has them, or change the pools")
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
        where = f"{address}, {source}"
    try:
        check_cluster_resources(job.spec, have)
    except InsufficientResources as exc:
        print(f"grpo-cluster: {exc} ({where})", file=sys.stderr)
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

    if spec.rollout.agent is not None:
        from cluster.agents.kinds import ecosystem_key

        if ecosystem_key(spec.rollout.agent) is not None:
            return "the environment's own reward (reward/agent)"
        return "the agent's return (reward/agent; a dict's parts as reward/<name>)"
    return ", ".join(f"{name} x{weight:g} ({where_defined(REWARD_FUNCTIONS[name])})"
                     for name, weight in spec.algorithm.rewards.items())


def agent_summary(rollout) -> str:
    """The agent (``rollout.agent``, with where it is defined or the ecosystem library and its version, or
    multi_turn's environment on the agent pool) and its pool in one line."""
    from importlib.metadata import version

    from cluster.agents.kinds import ecosystem_key
    from cluster.agents.loading import load_agent
    from cluster.agents.plan import agent_base_dir
    from grpo.rewards.calling import where_defined

    pool = rollout.agent_pool
    workers = (f"{pool.workers} worker(s) x {pool.episodes_per_worker} episodes at once, "
               f"{pool.num_cpus_per_worker:g} CPU each, {pool.timeout_s:g} s per episode")
    if rollout.agent is None:
        return f"the {rollout.multi_turn.environment!r} environment on the agent pool: {workers}"
    options = f" with {dict(rollout.agent_options)}" if rollout.agent_options else ""
    found = ecosystem_key(rollout.agent)
    if found is not None:
        kind = found[0]
        return (f"{rollout.agent}{options} (a {kind.name} environment, {kind.distribution} "
                f"{version(kind.distribution)}); {workers}; at most {pool.max_episode_tokens} tokens of context per "
                f"episode; its reward is the environment's")
    where = where_defined(load_agent(rollout.agent, agent_base_dir(rollout.agent)))
    return (f"{rollout.agent}{options} ({where}); {workers}; at most {pool.max_episode_tokens} tokens of context per "
            f"episode; its return is the reward")


def episode_summary(rollout) -> str:
    """``rollout.multi_turn`` in one line: the environment, its options, the turn and token limits."""
    mt = rollout.multi_turn
    options = f" {dict(mt.options)}" if mt.options else ""
    return (f"multi-turn with environment {mt.environment!r}{options}: at most {mt.max_turns} turns of "
            f"{mt.turn_tokens(rollout.max_response_tokens)} tokens, {mt.max_episode_tokens} tokens per episode "
            f"(observations included)")


def train_summary(t) -> str:
    """The train pool: ranks, strategy (and its layout), the torch.distributed backend, cores, LoRA."""
    backend = t.backend if t.backend != "auto" else ("nccl" if t.num_gpus_per_worker > 0 else "gloo")
    layout = (f" (tensor parallel {t.tensor_parallel_size} x pipeline parallel {t.pipeline_parallel_size}"
              f"{', sequence parallel' if t.sequence_parallel else ''})"
              if (t.tensor_parallel_size, t.pipeline_parallel_size) != (1, 1) else "")
    return (f"{t.world_size} rank(s), strategy {t.strategy}{layout}, torch.distributed backend {backend}"
            + (" (auto)" if t.backend == "auto" else "")
            + (f"; on cores {t.cpu_affinity}" if t.cpu_affinity is not None else "")
            + (f"; LoRA rank {t.lora.rank}, alpha/rank {t.lora.scaling:g}, on {t.lora.target_modules}, sync "
               f"{t.lora.sync}" if t.lora is not None else "; full fine-tuning"))


def optimizer_summary(t, total_steps: int) -> str:
    """AdamW's learning rate and its schedule over the run (``train.lr_schedule`` and its warmup, when the spec has
    them), weight decay and the gradient clip."""
    schedule = getattr(t, "lr_schedule", "constant")
    warmup = getattr(t, "warmup_steps", 0)
    ratio = getattr(t, "warmup_ratio", None)
    if ratio is not None:
        warmup = round(ratio * total_steps)
    shape = f"{schedule} over {total_steps} steps" + (f" after {warmup} warmup steps" if warmup else "")
    if schedule != "constant":
        shape += f", down to {getattr(t, 'min_lr_ratio', 0.0):g} x lr"
    return (f"AdamW lr {t.lr:g} ({shape}), weight decay {t.weight_decay:g}, betas {tuple(t.betas)}, gradient "
            f"norm clipped at {t.max_grad_norm:g}")


def algorithm_summary(a) -> str:
    """The GRPO objective in one line: advantages, loss aggregation, clip range, KL."""
    kl = (f"KL {a.kl_estimator} to the reference policy, beta {a.kl_coef:g} ({a.kl_controller}"
          f"{', in the reward' if a.kl_in_reward else ''})" if a.kl_coef > 0 else "no KL term (kl_coef 0)")
    return (f"advantages {a.advantage_estimator}, loss {a.loss_agg}, ratio clipped to [{1 - a.clip_eps_low:g}, "
            f"{1 + a.clip_eps_high:g}] (policy loss {a.policy_loss}), {a.num_iterations} update(s) per batch; {kl}")


def _yaml_value(value) -> str:
    """A setting's value as a spec would write it: 3e-04 as 0.0003, None as null, booleans lower case."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def variants_summary(spec, implied: set[str]) -> str:
    """Each registry-selected field's choice (``cluster.spec.variants.SELECTORS``) with the values in force of the
    settings that belong with it, those a choice implied marked ``(implied)``, e.g. ``policy_loss gspo
    (clip_eps_low 0.0003 (implied), clip_eps_high 0.0004 (implied), dual_clip_c null)``."""
    from cluster.spec.variants import SELECTORS

    parts = []
    for selector in SELECTORS:
        section = spec
        for name in selector.field.split(".")[:-1]:
            section = getattr(section, name) if section is not None else None
        if section is None or not isinstance(getattr(section, selector.name), str):  # left out (algorithm.mis), or
            continue                                                                 # a list (metrics.trackers)
        prefix = selector.field.rsplit(".", 1)[0]
        companions = [f"{c} {_yaml_value(getattr(section, c))}" + (" (implied)" if f"{prefix}.{c}" in implied else "")
                      for c in selector.companions]
        choice = f"{selector.field.removeprefix('algorithm.')} {getattr(section, selector.name)}"
        parts.append(choice + (f" ({', '.join(companions)})" if companions else ""))
    return "; ".join(parts)


def implied_summary(implied) -> str:
    """The settings in force because a choice implied them (``cluster.spec.implied.implied_settings``), each with
    its value and why, or that there are none."""
    if not implied:
        return "none: every setting in force is given by the spec or is its field's default"
    return "; ".join(f"{i.field} {_yaml_value(i.value)} ({i.why})" for i in implied)


def metrics_summary(s) -> str:
    """Where a run's metrics go: metrics.jsonl, the console, Prometheus, and each tracker with its location."""
    from cluster.sinks.trackers import tracker_class

    m, out = s.metrics, Path(s.output_dir).resolve()
    prometheus = ("no Prometheus endpoint (metrics.port null)" if m.port is None else
                  f"Prometheus on {m.host}:{m.port}" if m.port else f"Prometheus on a free port of {m.host}")
    trackers = [f"{name} ({tracker_class(name)(s, out).location()})" for name in m.trackers]
    return (f"{out / 'metrics.jsonl'}, a console line every {m.log_every_steps} step(s), {prometheus}; trackers: "
            + (", ".join(trackers) if trackers else "none (metrics.trackers)"))


def summary(job, spec_path: str, address: str | None, source: str, have: dict | None) -> str:
    """The resolved spec in a few lines: what will run, on what, from which inputs, reserving what."""
    from cluster.data.sources import describe_source
    from cluster.ray_shell.pools import resources_needed
    from cluster.spec.algorithm import describe_off_policy
    from cluster.spec.implied import implied_settings

    s, r, t = job.spec, job.spec.rollout, job.spec.train
    implied = implied_settings(s)
    need = resources_needed(s)
    start = (f"resume from {job.resume_from} (step {job.step}, policy version {job.policy_version})"
             if job.resume_from is not None else "from step 0")
    has = f"CPU {have.get('CPU', 0):g}, GPU {have.get('GPU', 0):g}: enough"
    cluster = (f"a local Ray cluster on 127.0.0.1, started by `run`; has {has}" if address is None else
               f"{address} ({source}); has {has}")
    lines = [
        ("spec", f"{Path(spec_path)} — job {s.name!r}, {s.total_steps} steps, {start}, seed {s.seed}"),
        ("model", f"{s.model.path} -> {job.model_path} ({s.model.dtype}); tokenizer loaded"),
        ("data", f"{len(job.prompt_ids)} prompts from {describe_source(s.data)} ({job.bad_rows} bad rows skipped, "
                 f"{job.prompts_filtered} over data.max_prompt_tokens={s.data.max_prompt_tokens} dropped)"),
        *([("held-out", held_out_summary(s.data))] if s.data.source == "reasoning_gym" else []),
        ("rollout", f"{r.replicas} engine(s); {r.prompts_per_step} prompts x G={r.group_size} completions per step, "
                    f"at most {r.max_response_tokens} tokens each, temperature {r.temperature:g}; mode {r.mode}"
                    + (f" (max_staleness {r.max_staleness})" if r.mode != "sync" else "")
                    + (f"; on cores {r.cpu_affinity}" if r.cpu_affinity is not None else "")),
        *([("episodes", episode_summary(r))] if r.multi_turn is not None else []),
        *([("agent", agent_summary(r))] if r.agent is not None or (
            r.multi_turn is not None and r.multi_turn.runner == "agent_pool") else []),
        ("train", train_summary(t)),
        ("optimizer", optimizer_summary(t, s.total_steps)),
        ("algorithm", algorithm_summary(s.algorithm)),
        ("variants", variants_summary(s, {i.field for i in implied})),
        ("implied", implied_summary(implied)),
        ("rewards", reward_summary(s)),
        ("off-policy", describe_off_policy(s.algorithm, r)),
        ("reserves", ", ".join(f"{res} {amount:g} ({how})" for res, (amount, how) in need.items())),
        ("cluster", cluster),
        ("output_dir", f"{Path(s.output_dir).resolve()} (writable; checkpoints in {job.checkpoint_root()})"),
        ("metrics", metrics_summary(s)),
    ]
    if job.evaluation is not None:
        ev, held = s.eval, job.evaluation.evalset
        when = ", ".join(w for w, on in (("at start", ev.at_start), (f"every {ev.every_steps} steps", ev.every_steps),
                                          ("at end", ev.at_end)) if on)
        how = ("scored by the agent's own reward" if r.agent is not None
               else f"at most {job.evaluation.requests[0].sampling.max_tokens} tokens")
        lines.insert(5, ("eval", f"{len(held.examples)} held-out prompts x {ev.samples} from {held.path} ("
                                 f"{'greedy' if ev.temperature == 0 else f'temperature {ev.temperature:g}'}, {how}), "
                                 f"{when}"))
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
