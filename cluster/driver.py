"""The GRPO driver loop: generate → score → advantages → train → sync, once per policy version.

    grpo-cluster run examples/gsm8k_smollm2_cpu.yaml

Notation: B prompts per step, G completions per prompt (a group), N = B·G sequences.

With ``algorithm.dynamic_sampling`` the generate → score → advantages stage repeats (``cluster.sampling``) until the
batch holds B groups with a learning signal; G follows ``GroupSizeController``; β follows the KL controller.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections import deque
from pathlib import Path

import torch
from tqdm import tqdm

from cluster.data import DataError, PromptSampler, build_chat_prompt, load_jsonl_examples
from cluster.metrics import MetricsLogger, format_console_line
from cluster.models import ModelError, resolve_model_path
from cluster.pools import RolloutPool, TrainPool, WeightSync, check_cluster_resources
from cluster.sampling import GroupSizeController, RolloutBatch, sample_groups
from cluster.scheduler import plan_microbatches
from cluster.spec import JobSpec, spec_to_yaml
from grpo.advantages import compute_multi_reward_advantages
from grpo.eos import eos_token_ids, response_valid_lengths
from grpo.kl import AdaptiveKLController, FixedKLController
from grpo.rewards import combine_rewards, overlong_penalty
from rollout_workers.engine import GroupRequest, GroupResult
from train_workers.packing import pack_rank_microbatches

#: Key of the DAPO overlong penalty among the reward components (``reward/overlong_penalty``).
OVERLONG = "overlong_penalty"

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")


class SetupError(RuntimeError):
    """The job cannot start here (an output folder that cannot be written, missing cluster resources)."""


class GRPOJob:
    """One GRPO training job on a Ray cluster (``ray.init`` must have been called).

    Args:
        spec: the validated job spec.
        progress: show a progress bar on stderr.
    """

    def __init__(self, spec: JobSpec, progress: bool = True):
        self.spec = spec
        self.progress = progress
        self.output_dir = Path(spec.output_dir)
        _ensure_writable_dir(self.output_dir, "output_dir")
        _ensure_writable_dir(self.checkpoint_root(), "checkpoint.dir")
        self.model_path = resolve_model_path(spec.model.path, spec.model.cache_dir)
        self.tokenizer = _load_tokenizer(self.model_path)
        d = spec.data
        examples, self.bad_rows = load_jsonl_examples(d.train_path, question_field=d.question_field,
                                                      answer_field=d.answer_field, on_bad_row=d.on_bad_row)
        examples, self.prompt_ids, self.prompts_filtered = self._tokenize_prompts(examples)
        self.sampler = PromptSampler(examples, spec.rollout.prompts_per_step, spec.seed, shuffle=d.shuffle)
        (self.output_dir / "spec.yaml").write_text(spec_to_yaml(spec))
        self._status(f"{len(examples)} prompts from {d.train_path} ({self.bad_rows} bad rows skipped, "
                     f"{self.prompts_filtered} over data.max_prompt_tokens={d.max_prompt_tokens} dropped)")
        self._pending: deque = deque()  # prompts drawn from the sampler, not yet sampled
        self._group_counter = 0  # next group id within the step (unique across sampling rounds)
        self.eos_ids = _model_eos_ids(self.model_path, self.tokenizer)
        alg = spec.algorithm
        self.group_size = GroupSizeController(spec.rollout.group_size, alg.group_size_schedule, alg.group_size_max,
                                              alg.group_size_rise_threshold)
        self.kl_controller = (AdaptiveKLController(alg.kl_coef, alg.kl_target, alg.kl_horizon_sequences)
                              if alg.kl_controller == "adaptive" else FixedKLController(alg.kl_coef))
        self.policy_version = 0
        self.step = 0
        self.max_model_len = spec.rollout.max_model_len or d.max_prompt_tokens + spec.rollout.max_response_tokens
        self.metrics = MetricsLogger(self.output_dir, host=spec.metrics.host, port=spec.metrics.port, job=spec.name,
                                     echo=False)
        self.rollout = self.train = self.sync = None

    # ---- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Create the pools and the weight-sync group (engines start from the same weights: policy version 0)."""
        check_cluster_resources(self.spec)
        self._status("starting rollout engines and train workers")
        self.rollout = RolloutPool(self.spec, self.model_path, self.max_model_len)
        self.train = TrainPool(self.spec, self.model_path)
        self.sync = WeightSync(self.spec, self.train, self.rollout)
        self._status(f"ready: {len(self.rollout.engines)} engine(s), {len(self.train.workers)} train rank(s), "
                     f"{self.train.num_parameters / 1e6:.1f}M parameters, {self.sync.num_buckets} sync bucket(s)")

    def run(self) -> list[dict]:
        """Run ``total_steps`` steps; returns every step's metrics."""
        if self.rollout is None:
            self.start()
        history = []
        bar = tqdm(total=self.spec.total_steps, desc="GRPO", unit="step", file=sys.stderr, disable=not self.progress)
        try:
            while self.step < self.spec.total_steps:
                self.step += 1
                metrics = self.run_step(bar)
                history.append(metrics)
                self.metrics.log(self.step, metrics)
                if self.step % self.spec.metrics.log_every_steps == 0 or self.step == self.spec.total_steps:
                    tqdm.write(format_console_line(self.step, metrics), file=sys.stdout)
                bar.update(1)
                if self._checkpoint_due():
                    self.save_checkpoint()
        finally:
            bar.close()
        return history

    def close(self) -> None:
        self.metrics.close()

    # ---- one step -----------------------------------------------------------------------------------------------
    def run_step(self, bar=None) -> dict:
        """generate → score → advantages (repeated by dynamic sampling) → train → sync. Returns the step's metrics."""
        t_step = time.perf_counter()
        phase = (lambda s: bar.set_postfix_str(s)) if bar is not None else (lambda s: None)
        alg = self.spec.algorithm
        group_size = self.group_size.group_size(self.step)
        timings = {"generate_s": 0.0, "score_s": 0.0, "tokens": 0}
        self._group_counter = 0  # group ids restart every step

        def sample_round(num_prompts: int) -> RolloutBatch:
            phase("generate")
            examples, requests = self._next_requests(num_prompts, group_size)
            t0 = time.perf_counter()
            groups, gen_stats = self.rollout.generate(requests)
            timings["generate_s"] += time.perf_counter() - t0
            timings["tokens"] += gen_stats["tokens"]
            phase("score")
            t0 = time.perf_counter()
            batch = self._score(groups, [e.reference for e in examples])
            timings["score_s"] += time.perf_counter() - t0
            return batch

        sampling = sample_groups(sample_round, self.spec.rollout.prompts_per_step, dynamic=alg.dynamic_sampling,
                                 max_rounds=alg.max_sampling_rounds)
        self.group_size.observe(self.step, sampling.all_equal_fraction)
        batch = sampling.batch

        phase("train")
        t0 = time.perf_counter()
        per_rank, plan_stats = self._microbatches(batch)
        num_tokens = sum(batch.valid_lengths)
        num_sequences = sum(v > 0 for v in batch.valid_lengths)
        if alg.kl_controller == "adaptive":
            self.train.all("set_kl_coef", self.kl_controller.value, what="setting kl_coef")
        train_metrics = self.train.train_step(per_rank, num_tokens, num_sequences)
        self.kl_controller.update(train_metrics["actor/kl"], len(batch))
        train_s = time.perf_counter() - t0

        phase("sync")
        t0 = time.perf_counter()
        self.policy_version = int(train_metrics["policy_version"])
        sync_metrics = self.sync.sync(self.policy_version)
        sync_s = time.perf_counter() - t0

        sampled = sampling.sampled
        rewards = sampled.rewards
        valid = rewards[~rewards.isnan()]
        lengths = torch.tensor([len(r) for r in sampled.response_ids], dtype=torch.float32)
        generate_s = timings["generate_s"]
        metrics = {
            "policy_version": self.policy_version,
            "reward/mean": float(valid.mean()) if valid.numel() else float("nan"),
            "reward/std": float(valid.std()) if valid.numel() > 1 else 0.0,
            **{f"reward/{name}": float(v.nanmean()) for name, v in sampled.per_function.items()},
            "reward/failed": sampled.num_failed,
            "reward/none_fraction": float(rewards.isnan().float().mean()),
            "groups/all_equal_fraction": sampling.all_equal_fraction,
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": 1.0 - sum(sampled.terminated) / len(sampled),
            "rollout/group_size": group_size,
            "rollout/sampling_rounds": sampling.rounds,
            "rollout/groups_sampled": sampling.num_groups_sampled,
            "rollout/sequences_trained": len(batch),
            "rollout/sample_policy_version_min": min(sampled.versions),
            **{k: v for k, v in train_metrics.items() if k != "policy_version"},
            **sync_metrics,
            **plan_stats,
            "data/epoch": self.sampler.epoch,
            "data/prompts_filtered": self.prompts_filtered,
            "data/bad_rows_skipped": self.bad_rows,
            "timing/generate_s": generate_s,
            "timing/score_s": timings["score_s"],
            "timing/train_s": train_s,
            "timing/sync_s": sync_s,
            "timing/step_s": time.perf_counter() - t_step,
            "perf/rollout_tokens_per_s": timings["tokens"] / max(generate_s, 1e-9),
            "perf/train_tokens_per_s": train_metrics["perf/train_tokens"] / max(train_s, 1e-9),
        }
        return metrics

    def _score(self, groups: list[GroupResult], references: list[str]) -> RolloutBatch:
        """Rewards (weighted functions + DAPO overlong penalty), EOS and truncation masks, and advantages."""
        alg = self.spec.algorithm
        max_tokens = self.spec.rollout.max_response_tokens
        rows = _flatten(groups, references)
        valid_lengths, terminated = response_valid_lengths(rows["response_ids"], self.eos_ids)
        scored = combine_rewards(rows["texts"], rows["references"], alg.rewards, on_error=alg.reward_on_error)
        per_function, weights, total = dict(scored.per_function), dict(alg.rewards), scored.total
        if alg.overlong_buffer_tokens is not None:
            penalty = overlong_penalty(valid_lengths, max_tokens, alg.overlong_buffer_tokens,
                                       alg.overlong_penalty_factor)
            per_function[OVERLONG], weights[OVERLONG], total = penalty, 1.0, total + penalty
        advantages = compute_multi_reward_advantages(
            per_function, weights, rows["group_ids"], alg.advantage_estimator, combine=alg.reward_combine,
            eps=alg.adv_eps, std=alg.adv_std)
        if alg.mask_truncated:
            valid_lengths = [v if t else 0 for v, t in zip(valid_lengths, terminated)]
        return RolloutBatch(**rows, valid_lengths=valid_lengths, terminated=terminated, rewards=total,
                            per_function=per_function, advantages=advantages,
                            num_failed=sum(scored.num_failed.values()))

    def _tokenize_prompts(self, examples):
        """Chat-template and tokenize every prompt once; drop (and count) those over ``data.max_prompt_tokens``.

        Returns:
            (kept examples, {example.index: prompt token ids}, number dropped).

        Raises:
            DataError: every prompt is too long.
        """
        d = self.spec.data
        texts = [self.tokenizer.apply_chat_template(build_chat_prompt(ex, d.system_prompt, d.prompt_suffix),
                                                    tokenize=False, add_generation_prompt=True) for ex in examples]
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        kept = [(ex, tok) for ex, tok in zip(examples, ids) if len(tok) <= d.max_prompt_tokens]
        if not kept:
            raise DataError(f"{d.train_path}: all {len(examples)} prompts are longer than data.max_prompt_tokens="
                            f"{d.max_prompt_tokens} tokens (the shortest has {min(map(len, ids))}); raise it")
        return [ex for ex, _ in kept], {ex.index: list(tok) for ex, tok in kept}, len(examples) - len(kept)

    def _next_requests(self, num_prompts: int, group_size: int):
        """Draw ``num_prompts`` prompts; group ids continue the step's count so they stay unique across sampling
        rounds."""
        examples, requests = [], []
        while len(requests) < num_prompts:
            if not self._pending:
                self._pending.extend(self.sampler.next_batch())
            ex = self._pending.popleft()
            requests.append(GroupRequest(group_id=self._group_counter, prompt_ids=self.prompt_ids[ex.index],
                                         group_size=group_size))
            self._group_counter += 1
            examples.append(ex)
        return examples, requests

    def _microbatches(self, batch: RolloutBatch):
        """Balance sequences over train ranks and pack each rank's micro-batches under the token budget."""
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        plan = plan_microbatches(lengths, self.spec.train.world_size, self.spec.train.max_tokens_per_microbatch)
        per_rank = pack_rank_microbatches(plan.ranks, batch.prompt_ids, batch.response_ids, batch.advantages,
                                          batch.behaviour_logprobs, batch.valid_lengths)
        return per_rank, plan.stats(lengths)

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    def _checkpoint_due(self) -> bool:
        c = self.spec.checkpoint
        last = self.step == self.spec.total_steps
        return (c.every_steps > 0 and self.step % c.every_steps == 0) or (last and c.save_final)

    def checkpoint_root(self) -> Path:
        return Path(self.spec.checkpoint.dir) if self.spec.checkpoint.dir else self.output_dir / "checkpoints"

    def save_checkpoint(self) -> Path:
        """An HF folder (safetensors, config, tokenizer, generation config) plus optimizer state and driver state."""
        path = self.checkpoint_root() / f"step_{self.step:06d}"
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        self.train.all("save_checkpoint", str(path), what=f"saving checkpoint {path}")
        for name in TOKENIZER_FILES:
            src = Path(self.model_path) / name
            if src.is_file():
                shutil.copy2(src, path / name)
        state = {"step": self.step, "policy_version": self.policy_version, "sampler": self.sampler.state_dict(),
                 "prompts_filtered": self.prompts_filtered, "model_path": self.model_path,
                 "kl_coef": self.kl_controller.value, "group_size": self.group_size.state_dict()}
        (path / "trainer_state.json").write_text(json.dumps(state, indent=2))
        latest = self.checkpoint_root() / "latest"
        tmp = latest.with_suffix(".tmp")
        tmp.write_text(path.name)
        os.replace(tmp, latest)
        self._status(f"checkpoint saved: {path}")
        return path

    def _status(self, message: str) -> None:
        tqdm.write(f"[grpo-cluster] {message}", file=sys.stderr)


def _ensure_writable_dir(path: Path, field: str) -> None:
    """Create ``path`` and prove it is writable now, before any worker starts.

    Raises:
        SetupError: naming the spec field, the path and the OS error.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write_test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise SetupError(f"{field}: cannot write to {path}: {exc.strerror or exc}") from None


def _load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as exc:
        raise ModelError(f"model.path: cannot load a tokenizer from {model_path}: {exc}") from None


def _flatten(groups: list[GroupResult], references: list[str]) -> dict:
    """Groups → row-aligned lists over N = B·G sequences; ``group_ids`` [N] int64 identifies each row's group."""
    out = {k: [] for k in ("prompt_ids", "response_ids", "behaviour_logprobs", "finish_reasons", "texts",
                           "references", "versions")}
    gids = []
    for g, ref in zip(groups, references):
        for ids, lps, reason, text in zip(g.response_ids, g.behaviour_logprobs, g.finish_reasons, g.texts):
            out["prompt_ids"].append(g.prompt_ids)
            out["response_ids"].append(ids if ids else [])
            out["behaviour_logprobs"].append(lps)
            out["finish_reasons"].append(reason)
            out["texts"].append(text)
            out["references"].append(ref)
            out["versions"].append(g.policy_version)
            gids.append(g.group_id)
    out["group_ids"] = torch.tensor(gids, dtype=torch.long)
    return out


def _model_eos_ids(model_path: str, tokenizer) -> frozenset[int]:
    """Every EOS id of the model: ``generation_config.json``'s ``eos_token_id`` (int or list) + the tokenizer's."""
    path = Path(model_path) / "generation_config.json"
    config_eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    return eos_token_ids(config_eos, tokenizer.eos_token_id)
