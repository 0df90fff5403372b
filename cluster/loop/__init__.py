"""The training loop's parts, each owning one phase or one fact, called by ``cluster/driver.py`` (``GRPOJob``).

setup (folders, tokenizer, prompts), requests (group requests and seeds), production (a step's batch: generate →
score → advantages, dynamic sampling, partial rollouts), scoring, sampling, scheduler (rank balance, micro-batch
packing), training (the update, the KL controller, skipped updates, the sync), rollout_modes and overlap (when each
batch is generated), step_metrics, job_checkpoints, checkpoint_state and checkpoints, job_workers (starting and
stopping the collaborators), preemption (SIGTERM), evaluation, guard. Pure:
no Ray, no vLLM, no runtime; the collaborators come in through ``contract.protocols``
(``tests/unit/test_import_layering.py``).
"""
