"""A tiny in-process job that sends itself SIGTERM at one phase of one step, for the preemption tests
(tests/in_process/test_loop_preempt.py): run as ``python -m tests.preempt_job CONFIG_JSON`` in a fresh interpreter,
it ends as ``grpo-cluster run`` does after a SIGTERM: one line on stderr and the job's exit code.

CONFIG_JSON: ``spec`` (overrides of :func:`tests.reference_job.reference_spec`: model, data, output folder, ...),
``phase`` (where the signal is sent, :data:`PHASES`; None: never), ``step`` (the step it is sent in), and for the
bad-input cases ``second_sigterm`` (send another one while the preemption checkpoint is written) and ``hold_save_s``
(hold the preemption checkpoint that long after the train rank wrote its files, with a ``saving`` marker file in the
output folder: the deadline, or the test's SIGKILL, comes first).

The signal is a real one (``os.kill`` of this process), sent from inside a :class:`LocalFleet` / :class:`LocalTrainer`
subclass written here: no flag in production code.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

#: Where the job may be when the signal comes: start-up, generation (the fleet's call), scoring (as the fleet hands the
#: scorer its groups), the update (inside the train rank's step), the weight sync, a periodic checkpoint (after the
#: train rank wrote its files).
PHASES = ("start", "generate", "score", "train", "sync", "checkpoint")


def sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def main(config: dict) -> int:
    import tests.parity_reward  # noqa: F401 - registers the test reward ``parity``
    from cluster.driver import GRPOJob
    from cluster.in_process import LocalFleet, LocalTrainer
    from cluster.loop.preemption import Preempted
    from tests.reference_job import reference_spec

    phase, at_step = config.get("phase"), int(config.get("step", 0))
    spec = reference_spec(config["model"], Path(config["data"]), Path(config["out"]), *config.get("overrides", ()))
    job = None

    def due(where: str) -> bool:
        return phase == where and job is not None and job.step == at_step and not job.preemption.requested

    class Fleet(LocalFleet):
        def generate(self, requests, on_groups=None, record=True, recover=True, interrupt_epoch=None):
            if record and due("generate"):
                sigterm()

            def scored(groups):
                on_groups(groups)
                if due("score"):
                    sigterm()

            return super().generate(requests, scored if on_groups is not None else None, record, recover,
                                    interrupt_epoch)

        def sync_policy(self):
            report = super().sync_policy()
            if due("sync"):
                sigterm()
            return report

    class Trainer(LocalTrainer):
        def start(self, model_path, policy_path=None):
            if phase == "start":
                sigterm()
            super().start(model_path, policy_path)

        def train_step(self, per_rank, num_tokens, num_sequences):
            if due("train"):
                sigterm()  # the update is under way: the step is finished
            return super().train_step(per_rank, num_tokens, num_sequences)

        def save_checkpoint(self, folder, checkpoint=None):
            super().save_checkpoint(folder, checkpoint)
            if due("checkpoint"):
                sigterm()
            elif job.preemption.requested:  # the preemption's own checkpoint
                if config.get("second_sigterm"):
                    sigterm()
                if config.get("hold_save_s"):
                    (Path(config["out"]) / "saving").write_text(folder)
                    time.sleep(float(config["hold_save_s"]))

    job = GRPOJob(spec, fleet=Fleet(spec), trainer=Trainer(spec), progress=False)
    try:
        job.run()
    except Preempted as exc:
        print(f"grpo-cluster: {exc}; continue with --resume", file=sys.stderr)
        return exc.exit_code
    finally:
        job.close()
        job.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
