"""The contract every role shares: the ground floor of grpo-cluster.

The loop (``cluster/``), the rollout engines (``rollout_workers/``), the train ranks (``train_workers/``) and the
runtimes that host them (the Ray shell ``cluster.ray_shell``, the in-process runtime ``cluster.in_process``) speak
only in these types:

- ``messages``: the typed messages that cross a process boundary (group requests and results, engine and train-rank
  reports, train results); ``sync_reports``: the weight sync's reports (``SendReport``, ``ReceiveReport``,
  ``SyncReport``);
- ``batches``: the scored rollout batch (``RolloutBatch``) and a train rank's packed micro-batch
  (``PackedMicroBatch``);
- ``figures``: the rollout side's per-step figures (``FleetFigures``);
- ``versions``: the policy-version ledger, the one owner of the policy version;
- ``errors``: errors a collaborator raises for the loop to act on;
- ``affinity``: binding a process to CPU cores (``pin_to_cores``), shared by the engines and the train ranks;
- ``registry_entries``: the ``"module:Class"`` entries of the registries keyed by a spec's names (train backends,
  rollout engines, trackers), imported on first use;
- ``rewards``: what the loop and a reward pool exchange (``RewardCall``, ``RewardScores``, ``RewardTicket``);
- ``protocols``: the role protocols: ``TrainWorker`` (one train rank), ``Trainer`` (the train side as the loop sees
  it), ``Fleet`` (the rollout side), ``RewardPool`` (where the reward functions run), ``ControlChannel`` and
  ``MetricSink``.

This package imports no other project package (``tests/unit/test_import_layering.py``), nor Ray, vLLM or pydantic:
torch and the standard library only.
"""
