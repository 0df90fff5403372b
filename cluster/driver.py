"""The GRPO driver loop: generate → score → advantages → train → sync, once per policy version.

    grpo-cluster run examples/gsm8k_smollm2_cpu.yaml

Notation: B prompts per step, G completions per prompt (a group), N = B·G sequences.

With ``algorithm.dynamic_sampling`` the generate → score → advantages stage repeats (``cluster.loop.sampling``) until the
batch holds B groups with a learning signal; G follows ``GroupSizeController``; β follows the KL controller.

Reliability: every group is sampled with its own seed (spec seed, step, group id), so a group sampled again — after
an engine died, or after a resume — comes out the same. Checkpoints are written to a temporary folder and renamed
(a crash mid-write leaves the previous one usable); ``resume: auto`` / ``--resume`` continue from the latest complete
one with the same prompts, policy version and per-step results. Dead engines are replaced and synced before they
serve; a failed train rank stops the job naming the rank (``restart_on_failure`` resumes it automatically); updates
with NaN/Inf are skipped and counted.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import zlib
from collections import deque
from pathlib import Path

import ray
import torch
from tqdm import tqdm

from cluster.loop.checkpoints import (  # noqa: F401 - TRAINER_STATE, latest_checkpoint are re-exported
    TRAINER_STATE, complete_checkpoints, latest_checkpoint, set_aside, truncate_jsonl, write_atomic,
)
from cluster.data import DataError, PromptSampler, chat_prompt_ids, load_jsonl_examples
from cluster.ops.metrics import MetricsLogger, format_console_line
from cluster.data.models import ModelError, resolve_model_path
from cluster.loop.pools import (EngineFailure, RolloutPool, TrainPool, TrainWorkerFailure, WeightSync, WorkerTimeout,
                           check_cluster_resources)
from cluster.loop.sampling import GroupSizeController, RolloutBatch, sample_groups
from cluster.loop.scheduler import plan_microbatches
from cluster.spec import JobSpec, spec_to_yaml
from weight_sync.coordinator import SyncMemberError
from grpo.advantages import compute_multi_reward_advantages
from grpo.eos import eos_token_ids, response_valid_lengths
from grpo.kl import AdaptiveKLController, FixedKLController
from grpo.rewards import OVERLONG_PENALTY_KEY, CombinedRewards, combine_rewards, overlong_penalty, reward_metrics
from cluster.messages import GroupRequest, GroupResult
from train_workers.packing import pack_rank_microbatches

#: Key of the DAPO overlong penalty among the reward components (``reward/overlong_penalty``).
OVERLONG = OVERLONG_PENALTY_KEY

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")


class SetupError(RuntimeError):
    """The job cannot start here (an output folder that cannot be written, missing cluster resources)."""


class NumericsError(RuntimeError):
    """``train.max_skipped_updates`` updates in a row had a NaN/Inf loss or gradient."""


class StaleSamplesError(RuntimeError):
    """Engines kept returning samples older than ``rollout.max_staleness`` after being synced again."""


def request_seed(seed: int, step: int, group_id: int) -> int:
    """The sampling seed of one group: a CRC-32 mix of (spec seed, step, group id), in [0, 2**31).

    Each group's completions then depend only on the policy weights, its prompt and this seed — not on the engine,
    the batch it shares, or what ran before — so re-sampled groups (engine replaced, job resumed) are identical."""
    return zlib.crc32(f"{seed}:{step}:{group_id}".encode()) & 0x7FFFFFFF


class GRPOJob:
    """One GRPO training job on a Ray cluster (``ray.init`` must have been called).

    Args:
        spec: the validated job spec.
        progress: show a progress bar on stderr.
        resume: continue from the latest complete checkpoint.
        dry_run: run every set-up check (output folders writable, model and tokenizer, data, prompt lengths, earlier
            checkpoints) and write nothing: no folder, no spec.yaml, no metrics endpoint (``grpo-cluster validate``).
            Such a job cannot :meth:`start`.
    Raises:
        SetupError, ModelError, DataError, MetricsError: naming the spec field and what is wrong.
    """

    def __init__(self, spec: JobSpec, progress: bool = True, resume: bool = False, dry_run: bool = False):
        self.spec = spec
        self.progress = progress
        self.dry_run = dry_run
        self.output_dir = Path(spec.output_dir)
        _ensure_writable_dir(self.output_dir, "output_dir", create=not dry_run)
        _ensure_writable_dir(self.checkpoint_root(), "checkpoint.dir", create=not dry_run)
        self.model_path = resolve_model_path(spec.model.path, spec.model.cache_dir)
        self.tokenizer = _load_tokenizer(self.model_path)
        d = spec.data
        try:
            examples, self.bad_rows = load_jsonl_examples(d.train_path, question_field=d.question_field,
                                                          answer_field=d.answer_field, on_bad_row=d.on_bad_row)
        except DataError as exc:
            raise DataError(f"data.train_path: {exc}") from None
        examples, self.prompt_ids, self.prompts_filtered = self._tokenize_prompts(examples)
        self.sampler = PromptSampler(examples, spec.rollout.prompts_per_step, spec.seed, shuffle=d.shuffle)
        if not dry_run:
            (self.output_dir / "spec.yaml").write_text(spec_to_yaml(spec))
        self._status(f"{len(examples)} prompts from {d.train_path} ({self.bad_rows} bad rows skipped, "
                     f"{self.prompts_filtered} over data.max_prompt_tokens={d.max_prompt_tokens} dropped)")
        self._pending: deque = deque()  # prompts drawn from the sampler, not yet sampled
        self._group_counter = 0  # next group id within the step (unique across sampling rounds)
        self._step_prompts: dict[int, int] = {}  # group id -> example index, this step
        self._per_engine: dict[int, dict] = {}  # engine index -> groups, tokens, busy seconds, KV use, this step
        self._logged_engines = 0  # engines with Prometheus series
        self.stale_refused = 0
        self.eos_ids = _model_eos_ids(self.model_path, self.tokenizer)
        alg = spec.algorithm
        self.group_size = GroupSizeController(spec.rollout.group_size, alg.group_size_schedule, alg.group_size_max,
                                              alg.group_size_rise_threshold)
        self.kl_controller = (AdaptiveKLController(alg.kl_coef, alg.kl_target, alg.kl_horizon_sequences)
                              if alg.kl_controller == "adaptive" else FixedKLController(alg.kl_coef))
        self.policy_version = 0
        self.step = 0
        self.skipped_updates = 0  # in a row
        self.skipped_updates_total = 0
        self.completed: dict[int, dict] = {}  # step -> metrics, of the steps this job object ran
        self.max_model_len = spec.rollout.max_model_len or d.max_prompt_tokens + spec.rollout.max_response_tokens
        resuming = resume or spec.resume == "auto"
        existing = latest_checkpoint(self.checkpoint_root())
        self.resume_from = existing if resuming else None
        if existing is not None and not resuming:
            raise SetupError(
                f"checkpoint.dir: {self.checkpoint_root()} already holds checkpoints of an earlier run (latest "
                f"{existing.name}); continue it with `grpo-cluster run --resume` (or resume: auto), or choose another "
                f"output_dir / checkpoint.dir — nothing was deleted")
        if self.resume_from is not None:
            self._load_driver_state(self.resume_from)
        elif resuming:
            self._status(f"resume: no complete checkpoint under {self.checkpoint_root()}; starting from step 0")
        self.rollout = self.train = self.sync = self.control = self.metrics = None
        if dry_run:
            return
        for name in ("metrics.jsonl", "trained_prompts.jsonl", "workers.jsonl"):
            if self.resume_from is not None:  # rows past the resumed step are redone
                truncate_jsonl(self.output_dir / name, self.step)
            else:  # a fresh start keeps an earlier run's rows aside instead of appending to or deleting them
                set_aside(self.output_dir / name)
        self.metrics = MetricsLogger(self.output_dir, host=spec.metrics.host, port=spec.metrics.port, job=spec.name,
                                     echo=False)

    # ---- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Create the pools and the weight-sync group (engines start from the same weights: policy version 0)."""
        if self.dry_run:
            raise SetupError("a job built with dry_run=True only checks its inputs; build it again to run it")
        check_cluster_resources(self.spec)
        self._status("starting rollout engines and train workers")
        ckpt = str(self.resume_from) if self.resume_from is not None else None
        try:
            self.rollout = RolloutPool(self.spec, ckpt or self.model_path, self.max_model_len, self.policy_version)
            self.train = TrainPool(self.spec, self.model_path, policy_path=ckpt)
            if ckpt is not None:
                changed = self.train.all("load_checkpoint", ckpt, self.policy_version,
                                         what=f"loading checkpoint {ckpt}")[0]
                if changed:  # the spec's values are in use (what actor/lr etc. report), not the checkpoint's
                    self._status("optimizer fields changed from the checkpoint (saved -> in use): " + ", ".join(
                        f"{field} {saved!r} -> {used!r}" for field, (saved, used) in changed.items()))
            self.sync = WeightSync(self.spec, self.train, self.rollout)
        except BaseException:
            self.shutdown()
            raise
        from cluster.ops.control import current_job_id, start_control

        self.control = start_control(current_job_id(self.spec.name), len(self.rollout.engines))
        where = f" from {ckpt} (step {self.step}, policy version {self.policy_version})" if ckpt else ""
        self._status(f"ready{where}: {len(self.rollout.engines)} engine(s), {len(self.train.workers)} train rank(s), "
                     f"{self.train.num_parameters / 1e6:.1f}M parameters, {self.sync.num_buckets} sync bucket(s)")

    def run(self) -> list[dict]:
        """Run ``total_steps`` steps; returns every step's metrics (none when a resumed job is already done)."""
        if self.step >= self.spec.total_steps:
            self._status(f"nothing to do: step {self.step} of total_steps={self.spec.total_steps} is done")
            return []
        if self.rollout is None:
            self.start()
        history = []
        bar = tqdm(total=self.spec.total_steps, desc="GRPO", unit="step", file=sys.stderr, disable=not self.progress)
        try:
            bar.update(self.step)
            while self.step < self.spec.total_steps:
                self._apply_control()
                self.step += 1
                metrics = self.run_step(bar)
                history.append(metrics)
                self.completed[self.step] = metrics
                self.metrics.log(self.step, metrics)
                self._log_workers()
                if self.step % self.spec.metrics.log_every_steps == 0 or self.step == self.spec.total_steps:
                    tqdm.write(format_console_line(self.step, metrics), file=sys.stdout)
                bar.update(1)
                if self._checkpoint_due():
                    self.save_checkpoint()
        finally:
            bar.close()
        return history

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()

    def shutdown(self) -> None:
        """Stop every engine and train rank this job started (and free their placement groups)."""
        if self.control is not None:
            self.control.close()
            self.control = None
        for pool in (self.rollout, self.train):
            if pool is not None:
                pool.shutdown()
        self.rollout = self.train = self.sync = None

    # ---- membership ---------------------------------------------------------------------------------------------
    def scale_rollout(self, replicas: int) -> None:
        """Resize the rollout pool to ``replicas`` engines between steps.

        New engines join the weight-sync group and receive the current policy before they serve; removed engines
        hold no in-flight groups (steps are synchronous), so no prompt is lost.
        """
        if replicas < 1:
            raise ValueError(f"rollout replicas must be >= 1, got {replicas}")
        have = len(self.rollout.engines)
        if replicas == have:
            return
        if replicas > have:
            self.rollout.add(replicas - have, self.policy_version)
        else:
            self.rollout.remove(have - replicas)
        self._resync_engines(f"rollout pool scaled {have} -> {replicas}")
        self._status(f"rollout pool scaled from {have} to {replicas} engine(s) at policy version "
                     f"{self.policy_version}")

    def _resync_engines(self, why: str) -> None:
        """Rebuild the sync group over the current engines and bring all of them to the current policy."""
        self.sync.rebuild(self.rollout.engines)
        report = self.sync.sync(self.policy_version)
        if self.spec.sync.verify and not report.get("sync/verified", False):
            raise RuntimeError(f"weight sync after {why} was not verified")

    def _sync(self) -> dict:
        """Sync the current policy to every engine; an engine that dies or stalls during the sync (an error within
        ``sync.timeout_s``) is replaced, and the new group is synced before anything is sampled.

        Raises:
            EngineFailure: more engine deaths than ``rollout.max_engine_restarts``.
            SyncVerificationError: an engine's weights differ from the trainer's (not retried: names the tensor).
        """
        try:
            return self.sync.sync(self.policy_version)
        except (ray.exceptions.RayError, WorkerTimeout, SyncMemberError) as exc:
            dead = self.rollout.dead_engines()
            if not dead:
                raise
            cause = f"{type(exc).__name__} during weight sync: {_first_line(exc)}"
            self._status(f"rollout engine(s) {dead} failed ({cause}; {self.rollout.where(dead)}); replacing them")
            self.rollout.replace(dead, self.policy_version, cause)
            self.sync.rebuild(self.rollout.engines)
            return self.sync.sync(self.policy_version)

    def _apply_control(self) -> None:
        """Apply a replica count set by ``grpo-cluster scale`` and publish the job's state."""
        if self.control is None:
            return
        desired = self.control.desired_rollout_replicas()
        if desired is not None and desired != len(self.rollout.engines):
            self.scale_rollout(int(desired))
        self.control.report({"step": self.step, "policy_version": self.policy_version,
                             "rollout_replicas": len(self.rollout.engines), "total_steps": self.spec.total_steps,
                             "engine_restarts": self.rollout.restarts})

    def _generate(self, requests: list[GroupRequest], on_groups=None):
        """Generate, replacing dead engines and re-sampling (same seeds → same groups) until every group comes from
        an engine at a version within ``rollout.max_staleness`` of the trainer's.

        Raises:
            EngineFailure: more engine deaths than ``rollout.max_engine_restarts``.
            StaleSamplesError: engines stay stale after being synced again.
        """
        r = self.spec.rollout
        for attempt in range(r.max_engine_restarts + 3):
            try:
                groups, stats = self.rollout.generate(requests, on_groups)
            except (ray.exceptions.RayError, WorkerTimeout, SyncMemberError) as exc:
                dead = self.rollout.dead_engines()
                if not dead and self.sync.stale_engines(self.policy_version):
                    # alive, but holding no complete policy (a sync failed part-way): sync again, then re-sample
                    self._status(f"engine(s) {self.sync.stale_engines(self.policy_version)} hold no complete policy "
                                 f"({type(exc).__name__}); syncing them and re-sampling")
                    self.sync.ensure_current(self.policy_version)
                    continue
                if not dead:
                    raise
                cause = f"{type(exc).__name__}: {_first_line(exc)}"
                self._status(f"rollout engine(s) {dead} failed ({cause}; {self.rollout.where(dead)}); replacing and "
                             f"re-sampling {len(requests)} group(s)")
                self.rollout.replace(dead, self.policy_version, cause)
                self._resync_engines(f"replacing engine(s) {dead}")
                continue
            stale = [g for g in groups if self.policy_version - g.policy_version > r.max_staleness]
            if not stale:
                return groups, stats
            self._status(f"{len(stale)} group(s) sampled at policy version {min(g.policy_version for g in stale)} "
                         f"(trainer {self.policy_version}, rollout.max_staleness={r.max_staleness}); re-syncing "
                         f"and sampling again")
            self.stale_refused += len(stale)
            self._resync_engines("stale samples")
        raise StaleSamplesError(f"engines still returned stale or failed samples after {attempt + 1} attempts")

    # ---- one step -----------------------------------------------------------------------------------------------
    def run_step(self, bar=None) -> dict:
        """generate → score → advantages (repeated by dynamic sampling) → train → sync. Returns the step's metrics."""
        t_step = time.perf_counter()
        phase = (lambda s: bar.set_postfix_str(s)) if bar is not None else (lambda s: None)
        alg = self.spec.algorithm
        group_size = self.group_size.group_size(self.step)
        timings = {"generate_s": 0.0, "score_s": 0.0, "tokens": 0, "engine_idle": [], "per_engine": {}}
        self._per_engine = timings["per_engine"]
        self._group_counter = 0  # group ids restart every step
        self._step_prompts: dict[int, int] = {}  # group id -> example index, this step
        self.stale_refused = 0

        def sample_round(num_prompts: int) -> RolloutBatch:
            phase("generate")
            examples, requests = self._next_requests(num_prompts, group_size)
            t0 = time.perf_counter()
            by_group = {q.group_id: ex.reference for q, ex in zip(requests, examples)}
            early: dict[int, CombinedRewards] = {}

            def score_finished(results: list[GroupResult]) -> None:
                """Score each engine's groups as soon as that engine finishes, while the others still sample."""
                t = time.perf_counter()
                for g in results:
                    early[g.group_id] = combine_rewards(g.texts, [by_group[g.group_id]] * len(g.texts), alg.rewards,
                                                        on_error=alg.reward_on_error)
                timings["score_s"] += time.perf_counter() - t

            groups, gen_stats = self._generate(requests, score_finished)
            timings["engine_idle"].append(gen_stats.get("engine_idle_fraction", 0.0))
            for k, e in enumerate(gen_stats.get("per_engine", [])):
                acc = timings["per_engine"].setdefault(k, {"groups": 0, "tokens": 0, "seconds": 0.0})
                acc.update(groups=acc["groups"] + e["groups"], tokens=acc["tokens"] + e["tokens"],
                           seconds=acc["seconds"] + e["seconds"],
                           kv_cache_usage=max(acc.get("kv_cache_usage") or 0.0, e.get("kv_cache_usage") or 0.0))
            timings["generate_s"] += time.perf_counter() - t0
            timings["tokens"] += gen_stats["tokens"]
            phase("score")
            t0 = time.perf_counter()
            batch = self._score(groups, [e.reference for e in examples], [early[g.group_id] for g in groups])
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
        version_at_train = self.policy_version
        train_metrics = self.train.train_step(per_rank, num_tokens, num_sequences)
        train_s = time.perf_counter() - t0
        skipped = bool(train_metrics.get("actor/update_skipped", 0.0))
        if skipped:
            self._note_skipped_update(train_metrics)
        else:
            self.skipped_updates = 0
            self.kl_controller.update(train_metrics["actor/kl"], len(batch))

        phase("sync")
        t0 = time.perf_counter()
        new_version = int(train_metrics["policy_version"])
        sync_metrics = {"sync/skipped": 1.0}
        if new_version != self.policy_version:  # a skipped update changes no weights: nothing to send
            self.policy_version = new_version
            sync_metrics = {**self._sync(), "sync/skipped": 0.0}
        sync_s = time.perf_counter() - t0
        self._record_prompts(batch)

        sampled = sampling.sampled
        rewards = sampled.rewards
        lengths = torch.tensor([len(r) for r in sampled.response_ids], dtype=torch.float32)
        staleness = torch.tensor([version_at_train - v for v in batch.versions], dtype=torch.float32)
        generate_s = timings["generate_s"]
        metrics = {
            "policy_version": self.policy_version,
            **reward_metrics(rewards, sampled.per_function, sampled.num_failed),
            "groups/all_equal_fraction": sampling.all_equal_fraction,
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": 1.0 - sum(sampled.terminated) / len(sampled),
            "rollout/group_size": group_size,
            "rollout/sampling_rounds": sampling.rounds,
            "rollout/groups_sampled": sampling.num_groups_sampled,
            "rollout/sequences_trained": len(batch),
            "rollout/sample_policy_version_min": min(sampled.versions),
            "rollout/staleness_max": float(staleness.max()),
            "rollout/staleness_mean": float(staleness.mean()),
            "rollout/stale_groups_refused": self.stale_refused,
            "rollout/nonfinite_logprobs": batch.num_nonfinite_logprobs(),
            "rollout/engines": len(self.rollout.engines),
            "rollout/engine_idle_fraction": (sum(timings["engine_idle"]) / len(timings["engine_idle"])
                                             if timings["engine_idle"] else 0.0),
            "workers/restarts": self.rollout.restarts,
            "actor/update_skipped": float(skipped),
            "actor/updates_skipped_total": self.skipped_updates_total,
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

    def _score(self, groups: list[GroupResult], references: list[str],
               scored_groups: list[CombinedRewards] | None = None) -> RolloutBatch:
        """Rewards (weighted functions + DAPO overlong penalty), EOS and truncation masks, and advantages.

        ``scored_groups`` are the groups' reward-function results when they were already computed as the groups
        arrived (one per group, in ``groups`` order); rewards are per completion, so joining them is exact."""
        alg = self.spec.algorithm
        max_tokens = self.spec.rollout.max_response_tokens
        rows = _flatten(groups, references)
        valid_lengths, terminated = response_valid_lengths(rows["response_ids"], self.eos_ids)
        if scored_groups is None:
            scored = combine_rewards(rows["texts"], rows["references"], alg.rewards, on_error=alg.reward_on_error)
        else:
            scored = CombinedRewards(
                torch.cat([c.total for c in scored_groups]),
                {k: torch.cat([c.per_function[k] for c in scored_groups]) for k in scored_groups[0].per_function},
                {k: sum(c.num_failed[k] for c in scored_groups) for k in scored_groups[0].num_failed})
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
        ids = chat_prompt_ids(self.tokenizer, examples, d.system_prompt, d.prompt_suffix)
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
            gid = self._group_counter
            requests.append(GroupRequest(group_id=gid, prompt_ids=self.prompt_ids[ex.index], group_size=group_size,
                                         seed=request_seed(self.spec.seed, self.step, gid)))
            self._step_prompts[gid] = ex.index
            self._group_counter += 1
            examples.append(ex)
        return examples, requests

    def _microbatches(self, batch: RolloutBatch):
        """Balance sequences over train ranks and pack each rank's micro-batches under the token budget."""
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        t = self.spec.train
        plan = plan_microbatches(lengths, t.world_size, t.max_tokens_per_microbatch, oversize=t.oversize_sequences)
        per_rank = pack_rank_microbatches(plan.ranks, batch.prompt_ids, batch.response_ids, batch.advantages,
                                          batch.behaviour_logprobs, batch.valid_lengths, group_ids=batch.group_ids)
        return per_rank, plan.stats(lengths)

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    def _checkpoint_due(self) -> bool:
        c = self.spec.checkpoint
        last = self.step == self.spec.total_steps
        return (c.every_steps > 0 and self.step % c.every_steps == 0) or (last and c.save_final)

    def checkpoint_root(self) -> Path:
        return Path(self.spec.checkpoint.dir) if self.spec.checkpoint.dir else self.output_dir / "checkpoints"

    def save_checkpoint(self) -> Path:
        """Write ``step_NNNNNN``: the policy as an HF folder (safetensors, config, tokenizer, generation config), the
        sharded optimizer state, the spec and the driver state (step, policy version, data position including prompts
        drawn but not yet sampled, KL and group-size controllers), then prune to ``checkpoint.keep_last``.

        Atomic: everything is written into ``step_NNNNNN.partial`` and renamed when complete (``trainer_state.json``
        last), so a crash mid-write leaves the previous checkpoint the latest complete one.
        """
        root = self.checkpoint_root()
        path = root / f"step_{self.step:06d}"
        tmp = root / f"step_{self.step:06d}.partial"
        for stale in (tmp, path):
            if stale.exists():
                shutil.rmtree(stale)
        tmp.mkdir(parents=True)
        self.train.all("save_checkpoint", str(tmp), what=f"saving checkpoint {path}")
        for name in TOKENIZER_FILES:
            src = Path(self.model_path) / name
            if src.is_file():
                shutil.copy2(src, tmp / name)
        (tmp / "spec.yaml").write_text(spec_to_yaml(self.spec))
        state = {"step": self.step, "policy_version": self.policy_version, "sampler": self.sampler.state_dict(),
                 "pending_prompts": [ex.index for ex in self._pending], "prompts_filtered": self.prompts_filtered,
                 "model_path": self.model_path, "kl_coef": self.kl_controller.value,
                 "group_size": self.group_size.state_dict(), "skipped_updates": self.skipped_updates,
                 "skipped_updates_total": self.skipped_updates_total,
                 "engine_restarts": self.rollout.restarts if self.rollout is not None else 0}
        write_atomic(tmp / TRAINER_STATE, json.dumps(state, indent=2))
        os.replace(tmp, path)
        write_atomic(root / "latest", path.name)
        self._prune_checkpoints(root)
        self._status(f"checkpoint saved: {path}")
        return path

    def _prune_checkpoints(self, root: Path) -> None:
        keep = self.spec.checkpoint.keep_last
        if keep is None:
            return
        for old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    def _load_driver_state(self, path: Path) -> None:
        """Restore the driver's side of a checkpoint (the workers load theirs in :meth:`start`).

        Raises:
            SetupError: the checkpoint's state does not fit this spec's data (naming the file and the field).
        """
        state_file = path / TRAINER_STATE
        try:
            state = json.loads(state_file.read_text())
            self.step = int(state["step"])
            self.policy_version = int(state["policy_version"])
            self.sampler.load_state_dict(state["sampler"])
            by_index = {ex.index: ex for ex in self.sampler.examples}
            self._pending = deque(by_index[i] for i in state.get("pending_prompts", []))
            self.kl_controller.load_state_dict({"kl_coef": state["kl_coef"]})
            self.group_size.load_state_dict(state["group_size"])
            self.skipped_updates = int(state.get("skipped_updates", 0))
            self.skipped_updates_total = int(state.get("skipped_updates_total", 0))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SetupError(f"resume: {state_file}: cannot restore the driver state: {type(exc).__name__}: {exc}") \
                from None
        if self.step >= self.spec.total_steps:
            self._status(f"resume: checkpoint {path} is at step {self.step} >= total_steps={self.spec.total_steps}")

    def _note_skipped_update(self, train_metrics: dict) -> None:
        """Count an update skipped for NaN/Inf; too many in a row stop the job naming the step and the metric."""
        self.skipped_updates += 1
        self.skipped_updates_total += 1
        metric = train_metrics.get("actor/update_skipped_reason") or "loss or grad_norm"
        limit = self.spec.train.max_skipped_updates
        self._status(f"step {self.step}: non-finite {metric}; update skipped, weights not broadcast "
                     f"({self.skipped_updates} in a row, limit {limit})")
        if self.skipped_updates >= limit:
            raise NumericsError(f"step {self.step}: {self.skipped_updates} updates in a row skipped for a non-finite "
                                f"{metric} (train.max_skipped_updates={limit}); last good policy version "
                                f"{self.policy_version}")

    def _record_prompts(self, batch: RolloutBatch) -> None:
        """Append the step's trained prompts (example indices, one per group) to ``trained_prompts.jsonl``."""
        seen, prompts = set(), []
        for gid in batch.group_ids.tolist():
            if gid not in seen:
                seen.add(gid)
                prompts.append(self._step_prompts[gid])
        row = {"step": self.step, "policy_version": self.policy_version, "prompts": prompts,
               "engines": len(self.rollout.engines)}
        with open(self.output_dir / "trained_prompts.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    def _log_workers(self) -> None:
        """Per-engine figures of the step for Prometheus (worker label) and ``workers.jsonl``; series of engines
        removed by a scale-down are dropped."""
        idle = {"groups": 0, "tokens": 0, "seconds": 0.0}
        for i in range(len(self.rollout.infos)):
            e = self._per_engine.get(i, idle)
            self.metrics.log_worker(self.step, "rollout", f"engine-{i}", {
                "policy_version": float(self.policy_version),
                "perf/rollout_tokens_per_s": e["tokens"] / e["seconds"] if e["seconds"] > 0 else 0.0,
                "rollout/queue_depth": float(e["groups"]),  # groups dispatched to this engine this step
                "rollout/engine_busy_s": e["seconds"],
                "rollout/kv_cache_usage": float(e.get("kv_cache_usage") or 0.0),  # estimated peak this step
                "workers/restarts": float(self.rollout.restarts),
            })
        for i in range(len(self.rollout.infos), self._logged_engines):
            self.metrics.remove_worker("rollout", f"engine-{i}")
        self._logged_engines = len(self.rollout.infos)

    def _status(self, message: str) -> None:
        tqdm.write(f"[grpo-cluster] {message}", file=sys.stderr)


def _ensure_writable_dir(path: Path, field: str, create: bool = True) -> None:
    """Create ``path`` and prove it is writable now, before any worker starts; with ``create=False``, only check
    that it could be: the deepest folder of ``path`` that exists is a folder this process may write into.

    Raises:
        SetupError: naming the spec field, the path and the OS error.
    """
    if not create:
        existing = next(p for p in (path, *path.parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            what = "not a folder" if not existing.is_dir() else "not writable"
            raise SetupError(f"{field}: cannot write to {path}: {existing} is {what}")
        return
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


def run_with_restarts(spec: JobSpec, progress: bool = True, resume: bool = False,
                      first_job: GRPOJob | None = None) -> tuple[GRPOJob, list[dict]]:
    """Run a job; when a worker fails, resume from the latest checkpoint up to ``spec.restart_on_failure`` times.

    ``first_job`` is an already constructed (not started) job for the first attempt (the CLI builds one before Ray
    starts, so bad data or model paths fail early).

    Returns (the last job, every completed step's metrics in step order).

    Raises:
        TrainWorkerFailure | EngineFailure | WorkerTimeout | NumericsError: the failure, once restarts are used up
            (``NumericsError`` is never retried: the same data would give the same NaN).
    """
    history: dict[int, dict] = {}
    attempt = 0
    while True:
        job = first_job if attempt == 0 and first_job is not None else GRPOJob(
            spec, progress=progress, resume=resume or attempt > 0)
        try:
            job.run()
            history.update(job.completed)
            return job, [history[k] for k in sorted(history)]
        except (TrainWorkerFailure, EngineFailure, WorkerTimeout, SyncMemberError, ray.exceptions.RayError) as exc:
            history.update(job.completed)
            if attempt >= spec.restart_on_failure:
                raise
            attempt += 1
            job._status(f"failure: {type(exc).__name__}: {exc}; restarting from the latest checkpoint "
                        f"({attempt}/{spec.restart_on_failure})")
        finally:
            job.close()
            job.shutdown()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
