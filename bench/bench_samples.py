"""What the step's samples (``metrics.samples_per_step``, ``samples.jsonl``) add to a training step, against a step's
wall time: every piece of work the samples cost, timed on a batch shaped like the CPU demo's.

The batch (``examples/demo_cpu.yaml``): B = 4 prompts x G = 8 completions of up to 128 tokens, with real text — GSM8K
questions in the chat template and their worked answers as completions (``../shared/data/gsm8k``, else generated
sums), tokenized with SmolLM2-135M-Instruct's tokenizer; rewards mixed in some groups. Timed per step:

1. train phase, driver: choosing the sample's rows (``sample_rows``) and marking the packed micro-batches
   (``microbatches(..., traced)`` minus ``microbatches(...)``);
2. train rank: keeping the traced rows' logprobs (``GRPOStep._trace`` over the rank's micro-batches) and pickling
   ``TrainResult.token_logprobs`` (what Ray sends back);
3. driver, after the step: the records (``SampleRecorder.train_records``: per-token texts, gaps, turns), the
   ``samples.jsonl`` line (``SampleLog.log_samples``) and, with ``--trackers``, each tracker's table.

The held-out evaluation's records (once per evaluation, outside the steps' timings) are reported apart.

Usage (from the repo root)::

    .venv/bin/python -m bench.bench_samples                    # 30 timed steps, samples_per_step 2
    .venv/bin/python -m bench.bench_samples --trackers wandb mlflow tensorboard trackio --step-s 50
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from bench._common import DEFAULT_MODEL, SHARED_GSM8K, load_note, print_json, print_table, resolve_model

B, G, MAX_TOKENS, EVAL_PROBLEMS = 4, 8, 128, 205


def _texts(count: int) -> list[tuple[str, str]]:
    """(question, worked answer) pairs: GSM8K's when the shared data is there, else generated sums."""
    path = SHARED_GSM8K / "train.jsonl"
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines()[:count]]
        return [(r["question"], r["answer"]) for r in rows]
    return [(f"What is {i} + {2 * i}?", f"{i} + {2 * i} = {3 * i}. So the answer is {3 * i}.\n#### {3 * i}")
            for i in range(count)]


def _batch(tokenizer, step: int):
    """A scored batch of the demo's shape (module docstring)."""
    import torch

    from contract.batches import RolloutBatch

    pairs = _texts(B * G + B)
    prompts, responses = [], []
    for b in range(B):
        chat = [{"role": "user", "content": pairs[b][0]}]
        prompt = tokenizer.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                                  add_special_tokens=False)
        for g in range(G):
            prompts.append(list(prompt))
            responses.append(tokenizer.encode(pairs[B + b * G + g][1], add_special_tokens=False)[:MAX_TOKENS])
    rewards = torch.tensor([float((i + step) % 3 == 0) if i < 2 * G else 0.0 for i in range(B * G)])
    groups = torch.arange(B).repeat_interleave(G)
    means = torch.stack([rewards[groups == b].mean() for b in range(B)])[groups]
    return RolloutBatch(
        prompt_ids=prompts, response_ids=responses,
        behaviour_logprobs=[-torch.rand(len(r)) for r in responses], finish_reasons=["stop"] * (B * G),
        texts=[tokenizer.decode(r, skip_special_tokens=True) for r in responses], references=["42"] * (B * G),
        versions=[step - 1] * (B * G), group_ids=groups, valid_lengths=[len(r) for r in responses],
        terminated=[True] * (B * G), rewards=rewards, per_function={"reasoning_gym": rewards},
        advantages=rewards - means)


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps after one warm-up step")
    parser.add_argument("--samples-per-step", type=int, default=2)
    parser.add_argument("--step-s", type=float, default=50.0, help="a step's wall seconds to compare with")
    parser.add_argument("--trackers", nargs="*", default=[], help="trackers whose sample tables are timed too")
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from cluster.loop.samples import SampleRecorder, sample_rows
    from cluster.loop.training import microbatches
    from cluster.sinks.samples import SampleLog
    from cluster.sinks.trackers import build_trackers
    from cluster.spec import load_spec_text
    from contract.messages import GroupResult, TrainResult
    from train_workers.grpo_step import GRPOStep

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL))
    train = SimpleNamespace(world_size=2, max_tokens_per_microbatch=1024, oversize_sequences="own")
    parts: dict[str, list[float]] = {"train phase (driver)": [], "train rank": [], "records": [],
                                     "samples.jsonl": []}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("TRACKIO_DIR", f"{tmp}/trackio")
        spec = load_spec_text(f"name: bench_samples\noutput_dir: {tmp}\ntotal_steps: {args.steps + 1}\n"
                              f"data: {{train_path: {tmp}/unused.jsonl}}\n"
                              f"metrics: {{port: null, trackers: {json.dumps(args.trackers)}}}\n")
        sinks = build_trackers(spec, tmp)
        parts.update({f"table: {sink.name}": [] for sink in sinks})
        log = SampleLog(tmp)
        recorder = SampleRecorder(tokenizer, args.samples_per_step, 512)
        for step in range(1, args.steps + 2):
            batch = _batch(tokenizer, step)
            t_plain, _ = _timed(microbatches, batch, train, 2)
            t_rows, traced = _timed(lambda: set(sample_rows(batch, args.samples_per_step)))
            t_marked, (per_rank, _) = _timed(microbatches, batch, train, 2, traced)
            rank = SimpleNamespace(traced={})
            t_rank = 0.0
            for mbs in per_rank:
                for mb in mbs:
                    if mb.num_sequences:
                        old = -torch.rand(mb.response_mask.shape)
                        t_rank += _timed(GRPOStep._trace, rank, mb, old)[0]
            result = TrainResult(step, False, "", {}, token_logprobs=rank.traced)
            t_rank += _timed(pickle.dumps, result)[0]
            t_records, _ = _timed(recorder.train_records, step, batch, result, step - 1, step)
            records = recorder.take()
            t_log, _ = _timed(log.log_samples, step, records)
            t_tables = {sink.name: _timed(sink.log_samples, step, records)[0] for sink in sinks}
            if step == 1:
                continue  # warm-up
            parts["train phase (driver)"].append(max(t_marked - t_plain, 0.0) + t_rows)
            parts["train rank"].append(t_rank)
            parts["records"].append(t_records)
            parts["samples.jsonl"].append(t_log)
            for name, seconds in t_tables.items():
                parts[f"table: {name}"].append(seconds)
        size = log.path.stat().st_size / (args.steps + 1)
        pairs = _texts(EVAL_PROBLEMS)
        groups = [GroupResult(i, tokenizer.encode(q), [tokenizer.encode(a)[:MAX_TOKENS]], [torch.zeros(1)], ["stop"],
                              [a], 0) for i, (q, a) in enumerate(pairs)]
        t_eval, _ = _timed(recorder.eval_records, 0, groups, ["42"] * len(groups), [[0.0]] * len(groups), None)
        t_eval_log, _ = _timed(log.log_samples, 0, recorder.take())
        for sink in sinks:
            sink.close()
    totals = [sum(values) for values in zip(*parts.values())]
    rows = [[name, 1000 * statistics.mean(v), 1000 * sorted(v)[int(0.9 * (len(v) - 1))],
             100 * statistics.mean(v) / args.step_s] for name, v in parts.items()]
    rows.append(["all", 1000 * statistics.mean(totals), 1000 * sorted(totals)[int(0.9 * (len(totals) - 1))],
                 100 * statistics.mean(totals) / args.step_s])
    note = load_note()
    print(f"batch B={B} x G={G}, <= {MAX_TOKENS} tokens, samples_per_step {args.samples_per_step}, "
          f"{args.steps} timed steps; trackers {args.trackers or 'none'}; samples.jsonl {size / 1024:.1f} KiB/step")
    print_table(["part", "ms/step (mean)", "p90", f"% of a {args.step_s:.0f} s step"], rows)
    print(f"once per evaluation ({EVAL_PROBLEMS} problems): records {t_eval:.3f} s, samples.jsonl {t_eval_log:.3f} s; "
          f"machine {note['cpus']} CPUs, load average {note['loadavg_1m']}")
    print_json("samples", {"steps": args.steps, "samples_per_step": args.samples_per_step, "step_s": args.step_s,
                           "trackers": args.trackers, "mean_ms": {r[0]: r[1] for r in rows},
                           "p90_ms": {r[0]: r[2] for r in rows}, "percent_of_step": {r[0]: r[3] for r in rows},
                           "bytes_per_step": size, "eval_records_s": t_eval, "eval_log_s": t_eval_log,
                           "machine": note})


if __name__ == "__main__":
    main()
