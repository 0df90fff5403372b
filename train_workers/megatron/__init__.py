"""Megatron-core train backend (issue #15): ``worker.MegatronTrainWorker`` (``train.strategy: megatron``), its
logprob model (``policy``), weight-sync sources (``sync``), checkpoints (``checkpoint``, ``hf_io``), the layout rules
(``config``) and the HF ⇄ Megatron tensor mapping (``convert``).

Nothing is imported here: ``import train_workers`` stays light, and megatron-core (the ``megatron`` extra) is imported
only inside the functions and methods that build Megatron objects.
"""
