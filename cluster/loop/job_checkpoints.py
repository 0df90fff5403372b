"""The job's checkpoints: where they go, when one is due, the driver state one records, writing it, and restoring the
driver's side of a job from one (:class:`JobCheckpoints`, a collaborator of ``cluster.driver.GRPOJob``).

The folders, their atomic writes and the ``trainer_state.json`` fields are :mod:`cluster.loop.checkpoint_state`'s and
:mod:`cluster.loop.checkpoints`'s; this class binds them to the parts of one job whose state a checkpoint records.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cluster.loop.checkpoint_state import check_policy_kind, driver_state, restore_driver_state, write_checkpoint
from cluster.loop.evaluation import restore_best
from cluster.loop.requests import PromptQueue
from cluster.loop.sampling import GroupSizeController
from cluster.loop.training import SkippedUpdates
from cluster.spec import JobSpec, spec_to_yaml
from contract.protocols import Trainer
from contract.versions import PolicyVersionLedger


def checkpoint_root(spec: JobSpec) -> Path:
    """``checkpoint.dir``, or ``output_dir/checkpoints``."""
    return Path(spec.checkpoint.dir) if spec.checkpoint.dir else Path(spec.output_dir) / "checkpoints"


class JobCheckpoints:
    """The checkpoints of one job, over the parts whose state they record.

    Args:
        spec: the job spec (``checkpoint.*``, ``total_steps``, ``train.lora``; written into each checkpoint).
        model_path: the resolved model folder (tokenizer and generation files are copied from it).
        prompts: the prompt queue (data position, prompts drawn but not yet sampled). prompts_filtered: prompts the
            data's length filter dropped (recorded, checked on restore).
        kl_controller, group_size, skips: the KL controller, the group-size controller, the skipped-update counts.
        versions: the job's policy-version ledger (read when saving, set on restore).
        schedule: the rollout mode (``cluster.loop.rollout_modes``): its in-flight batches and own fields.
        evaluation: the held-out evaluation (``cluster.loop.evaluation``; its best step), or None.
        trainer: the train side, which writes the policy folder and optimizer state (``contract.protocols.Trainer``);
            None only in a dry run, which never saves.
        status: one-line console messages.
    """

    def __init__(self, spec: JobSpec, model_path: str, *, prompts: PromptQueue, prompts_filtered: int,
                 kl_controller, group_size: GroupSizeController, skips: SkippedUpdates,
                 versions: PolicyVersionLedger, schedule, evaluation, trainer: Trainer | None,
                 status: Callable[[str], None]):
        self.spec = spec
        self.model_path = model_path
        self.root = checkpoint_root(spec)
        self.prompts = prompts
        self.prompts_filtered = prompts_filtered
        self.kl_controller = kl_controller
        self.group_size = group_size
        self.skips = skips
        self.versions = versions
        self.schedule = schedule
        self.evaluation = evaluation
        self.trainer = trainer
        self._status = status

    def due(self, step: int) -> bool:
        """Whether finished step ``step`` writes a checkpoint: every ``checkpoint.every_steps``, the last step with
        ``checkpoint.save_final``, or a new best held-out step with ``checkpoint.keep_best``."""
        c = self.spec.checkpoint
        last = step == self.spec.total_steps
        best = self.evaluation is not None and self.evaluation.checkpoint_wanted(step)
        return (c.every_steps > 0 and step % c.every_steps == 0) or (last and c.save_final) or best

    def state(self, step: int, engine_restarts: int) -> dict:
        """The driver state a checkpoint written after step ``step`` records (``trainer_state.json``): step, policy
        version, data position including prompts drawn but not yet sampled, KL and group-size controllers, skipped
        updates, ``engine_restarts``; with eval, the best step; the rollout mode's own fields."""
        state = driver_state(step=step, policy_version=self.versions.current, prompts=self.prompts,
                             prompts_filtered=self.prompts_filtered, model_path=self.model_path,
                             kl_coef=self.kl_controller.value, group_size=self.group_size, skips=self.skips,
                             engine_restarts=engine_restarts, inflight=self.schedule.inflight())
        if self.evaluation is not None:
            state["eval"] = self.evaluation.state_dict()
        state.update(self.schedule.state_dict())
        return state

    def save(self, state: dict) -> Path:
        """Write ``step_NNNNNN`` of ``state`` (:meth:`state`): the policy as an HF folder (with ``train.lora`` a PEFT
        adapter folder, which ``grpo-cluster merge`` merges), the sharded optimizer state, the spec and the driver
        state, then prune to ``checkpoint.keep_last``, sparing the best step's checkpoint with
        ``checkpoint.keep_best``. Atomic: written into ``step_NNNNNN.partial`` and renamed when complete
        (``trainer_state.json`` last), so a crash mid-write leaves the previous checkpoint the latest complete one.
        Returns the folder."""
        path = write_checkpoint(self.root, int(state["step"]), self.trainer, self.model_path, spec_to_yaml(self.spec),
                                state, self.spec.checkpoint.keep_last,
                                protect=self.evaluation.protected_step() if self.evaluation is not None else None)
        self._status(f"checkpoint saved: {path}")
        return path

    def restore(self, path: Path) -> int:
        """Restore the driver's side of checkpoint ``path`` (the collaborators load theirs when they start): the
        rollout mode's batches, the data position, the controllers, the policy version (into the ledger), the best
        held-out step. Returns the checkpoint's step.

        Raises:
            SetupError: the checkpoint's policy is not what the spec trains (LoRA adapters vs full weights, or other
                LoRA rank/alpha), or its driver state does not fit the spec's data.
        """
        check_policy_kind(path, self.spec.train.lora)
        self.schedule.restore(path)  # batches prefetched or carried: their prompts are drawn again from the position
        step, policy_version = restore_driver_state(path, prompts=self.prompts, kl_controller=self.kl_controller,
                                                    group_size=self.group_size, skips=self.skips)
        self.versions.restore(policy_version)
        restore_best(self.evaluation, path)
        if step >= self.spec.total_steps:
            self._status(f"resume: checkpoint {path} is at step {step} >= total_steps={self.spec.total_steps}")
        return step
