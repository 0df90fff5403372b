"""Checkpoints from the driver's side: which checkpoint to resume, writing ``step_NNNNNN`` atomically with the driver
state, restoring that state, pruning, and the per-step logs a resume truncates.

A checkpoint folder holds the policy as an HF folder (safetensors, config, tokenizer files, generation config; with
``train.lora`` a PEFT adapter folder instead, the base being the job's model), the sharded optimizer state (both
written by the train ranks), ``spec.yaml`` and ``trainer_state.json`` (the driver
state: step, policy version, data position including prompts drawn but not yet sampled, KL and group-size
controllers, skipped-update counts), which is written last (:data:`cluster.loop.checkpoints.TRAINER_STATE`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from cluster.loop.checkpoints import (TRAINER_STATE, complete_checkpoints, latest_checkpoint, remove_checkpoint,
                                     remove_leftovers, set_aside, truncate_jsonl, write_atomic)
from contract.protocols import Trainer
from cluster.loop.requests import PromptQueue
from cluster.loop.sampling import GroupSizeController
from cluster.loop.setup import SetupError
from cluster.loop.training import SkippedUpdates, save_train_state

#: Tokenizer and generation files copied from the model folder into every checkpoint (when the model has them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")

#: The driver's append-only per-step logs under ``output_dir``.
STEP_LOGS = ("metrics.jsonl", "trained_prompts.jsonl", "workers.jsonl", "samples.jsonl")


def resume_point(root: Path, resuming: bool, status: Callable[[str], None]) -> Path | None:
    """The checkpoint to continue from: the latest complete one under ``root`` when ``resuming``, else None.

    Raises:
        SetupError: ``root`` holds checkpoints of an earlier run and the job is not resuming (nothing is deleted).
    """
    existing = latest_checkpoint(root)
    if existing is not None and not resuming:
        raise SetupError(
            f"checkpoint.dir: {root} already holds checkpoints of an earlier run (latest "
            f"{existing.name}); continue it with `grpo-cluster run --resume` (or resume: auto), or choose another "
            f"output_dir / checkpoint.dir — nothing was deleted")
    if existing is None and resuming:
        status(f"resume: no complete checkpoint under {root}; starting from step 0")
    return existing if resuming else None


def open_step_logs(output_dir: Path, resumed_step: int | None) -> None:
    """Prepare the per-step logs: on a resume (``resumed_step``) rows past that step are dropped, to be redone; a
    fresh start keeps an earlier run's files aside instead of appending to or deleting them."""
    for name in STEP_LOGS:
        if resumed_step is not None:
            truncate_jsonl(output_dir / name, resumed_step)
        else:
            set_aside(output_dir / name)


def driver_state(*, step: int, policy_version: int, prompts: PromptQueue, prompts_filtered: int, model_path: str,
                 kl_coef: float, group_size: GroupSizeController, skips: SkippedUpdates,
                 engine_restarts: int, inflight: dict | None = None) -> dict:
    """The driver's side of a checkpoint, as written to ``trainer_state.json``.

    ``inflight`` (``rollout.mode`` one_step_off, async): ``{"position": StepBatch.position, "groups": n}``: the
    position of the oldest batch generated ahead and not trained, and the groups of every such batch. The data
    position and group-size state recorded are then the ones from before that batch was drawn, so a resumed job
    draws its prompts again (none lost, none trained twice), and ``inflight_groups`` = n is recorded (0 when nothing
    was in flight); None (``sync``): the current ones, no key.
    """
    if inflight is not None:
        position, sizes = inflight["position"]["prompts"], inflight["position"]["group_size"]
    else:
        position, sizes = prompts.state_dict(), group_size.state_dict()
    skipped = skips.state_dict()
    state = {"step": step, "policy_version": policy_version, "sampler": position["sampler"],
             "pending_prompts": position["pending_prompts"], "prompts_filtered": prompts_filtered,
             "model_path": model_path, "kl_coef": kl_coef, "group_size": sizes,
             "skipped_updates": skipped["skipped_updates"], "skipped_updates_total": skipped["skipped_updates_total"],
             "engine_restarts": engine_restarts}
    if inflight is not None:
        state["inflight_groups"] = int(inflight["groups"])
    return state


def inflight_groups(path: Path) -> int:
    """Groups generated ahead and not trained when checkpoint ``path`` was written (``rollout.mode`` one_step_off,
    async; 0 for a ``sync`` checkpoint or an unreadable state): their prompts are drawn again after a resume.
    (:func:`restore_driver_state` raises for a state that cannot be read.)"""
    return _saved_count(path, "inflight_groups")


def stale_dropped_total(path: Path) -> int:
    """Groups dropped for staleness (``rollout.mode: async``) up to checkpoint ``path``; 0 when it has no such count
    (another mode, or an unreadable state)."""
    return _saved_count(path, "stale_dropped_total")


def _saved_count(path: Path, key: str) -> int:
    try:
        return int(json.loads((path / TRAINER_STATE).read_text()).get(key, 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def check_policy_kind(path: Path, lora) -> None:
    """Check that checkpoint ``path`` holds the kind of policy this spec trains, before any worker starts: a PEFT
    adapter folder (``adapter_config.json``) of ``lora``'s rank and alpha when ``lora`` (the spec's ``train.lora``)
    is set, an HF model folder otherwise. (The target modules are compared by the train ranks when they load it.)

    Raises:
        SetupError: naming ``train.lora``, the checkpoint and what differs.
    """
    adapter = path / "adapter_config.json"
    if lora is None:
        if adapter.is_file():
            raise SetupError(f"train.lora: {path} is a LoRA checkpoint (adapters only) but this spec has no "
                             f"train.lora; resume with the train.lora it was trained with, or start a new run from "
                             f"the merged model (grpo-cluster merge {path} --out DIR)")
        return
    if not adapter.is_file():
        raise SetupError(f"train.lora: {path} is a full fine-tuning checkpoint, not LoRA adapters; remove train.lora "
                         f"to resume it, or start a new run with model.path: {path}")
    try:
        saved = json.loads(adapter.read_text())
        rank, alpha = int(saved["r"]), float(saved["lora_alpha"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SetupError(f"train.lora: cannot read {adapter}: {type(exc).__name__}: {exc}") from None
    want = float(lora.alpha if lora.alpha is not None else lora.rank)
    if (rank, alpha) != (lora.rank, want):
        raise SetupError(f"train.lora: {path} holds adapters of rank {rank}, alpha {alpha:g}; this spec asks for rank "
                         f"{lora.rank}, alpha {want:g}; resume with the checkpoint's values")


def restore_driver_state(path: Path, *, prompts: PromptQueue, kl_controller, group_size: GroupSizeController,
                         skips: SkippedUpdates) -> tuple[int, int]:
    """Restore the driver's side of checkpoint ``path`` into its owners (the workers load theirs when they start).

    Returns:
        (step, policy version) of the checkpoint.

    Raises:
        SetupError: the checkpoint's state does not fit this spec's data (naming the file and the error).
    """
    state_file = path / TRAINER_STATE
    try:
        state = json.loads(state_file.read_text())
        step, policy_version = int(state["step"]), int(state["policy_version"])
        prompts.load_state_dict(state)
        kl_controller.load_state_dict({"kl_coef": state["kl_coef"]})
        group_size.load_state_dict(state["group_size"])
        skips.load_state_dict(state)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SetupError(f"resume: {state_file}: cannot restore the driver state: {type(exc).__name__}: {exc}") \
            from None
    return step, policy_version


def write_checkpoint(root: Path, step: int, train: Trainer, model_path: str, spec_yaml: str, state: dict,
                     keep_last: int | None, protect: int | None = None) -> Path:
    """Write ``root/step_NNNNNN`` (the train ranks' policy and optimizer, the model's tokenizer files, the spec and
    the driver ``state``), then keep only the newest ``keep_last`` complete checkpoints (all when None) and the one
    of step ``protect`` (``checkpoint.keep_best``).

    Atomic: everything is written into ``step_NNNNNN.partial`` and renamed when complete (``trainer_state.json``
    last), so a crash mid-write leaves the previous checkpoint the latest complete one; a checkpoint replaced or
    pruned is renamed aside before it is deleted (:func:`cluster.loop.checkpoints.remove_checkpoint`).

    Returns the checkpoint folder.
    """
    path = root / f"step_{step:06d}"
    tmp = root / f"step_{step:06d}.partial"
    for stale in (tmp, path):
        if stale.exists():
            remove_checkpoint(stale)
    tmp.mkdir(parents=True)
    remove_leftovers(root)
    save_train_state(train, str(tmp), str(path))
    for name in TOKENIZER_FILES:
        src = Path(model_path) / name
        if src.is_file():
            shutil.copy2(src, tmp / name)
    (tmp / "spec.yaml").write_text(spec_yaml)
    write_atomic(tmp / TRAINER_STATE, json.dumps(state, indent=2))
    os.replace(tmp, path)
    write_atomic(root / "latest", path.name)
    prune_checkpoints(root, keep_last, protect)
    return path


def prune_checkpoints(root: Path, keep_last: int | None, protect: int | None = None) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints under ``root`` (none when None), sparing the one
    of step ``protect`` (kept besides the newest ``keep_last``)."""
    if keep_last is None:
        return
    for old in complete_checkpoints(root)[:-keep_last]:
        if protect is None or old.name != f"step_{protect:06d}":
            try:
                remove_checkpoint(old)
            except OSError:
                pass  # a checkpoint that cannot be deleted stays (as before: pruning never fails the job)
