"""Train backends by name: the spec's ``train.strategy`` picks the class ``TrainPool`` starts on every rank.

Entries are classes implementing :class:`contract.train_worker.TrainWorker`, or ``"module:Class"`` strings imported on
first use, so the control plane imports no backend (nor its torch/transformers dependencies) until a pool is built.
This module is the one owner of the backend names: the spec validates ``train.strategy`` against
:data:`TRAIN_BACKENDS` and the model-parallel fields (``train.tensor_parallel_size``, ``pipeline_parallel_size``,
``sequence_parallel``) against :data:`MODEL_PARALLEL_BACKENDS`, importing only this module.

    >>> train_backend("fsdp").__name__
    'FSDPTrainWorker'
"""

from __future__ import annotations

from contract.registry_entries import add_entry, resolve_entry

#: ``train.strategy`` → backend class, or ``"module:Class"`` resolved by :func:`train_backend`.
TRAIN_BACKENDS: dict[str, type | str] = {
    "fsdp": "train_workers.fsdp_worker:FSDPTrainWorker",
    "megatron": "train_workers.megatron.worker:MegatronTrainWorker",
}

#: Names in :data:`TRAIN_BACKENDS` whose backend shards a model replica by tensor and pipeline parallelism (and
#: sequence parallelism), so the spec lets ``train.tensor_parallel_size`` etc. differ from 1 with them; every other
#: backend shards only by data parallelism.
MODEL_PARALLEL_BACKENDS: set[str] = {"megatron"}


def register_train_backend(name: str, backend: type | str, *, model_parallel: bool = False) -> None:
    """Add a train backend under ``name`` (a ``train.strategy`` value). Register it in a module imported before the
    spec is validated (``grpo-cluster run --import MODULE``).

    Args:
        backend: a class implementing :class:`contract.train_worker.TrainWorker`, or ``"module:Class"``.
        model_parallel: the backend honours ``train.tensor_parallel_size``, ``pipeline_parallel_size`` and
            ``sequence_parallel`` (added to :data:`MODEL_PARALLEL_BACKENDS`); False: the spec refuses them != 1.

    Raises:
        ValueError: ``name`` is registered already, or a string ``backend`` is not ``"module:Class"``.
    """
    add_entry(TRAIN_BACKENDS, "train backend", name, backend)
    if model_parallel:
        MODEL_PARALLEL_BACKENDS.add(name)
    else:
        MODEL_PARALLEL_BACKENDS.discard(name)  # a name registered again after its entry was removed


def train_backend(name: str) -> type:
    """The backend class for ``train.strategy`` = ``name``; a ``"module:Class"`` entry is imported now.

    Raises:
        ValueError: no backend is registered under ``name`` (the message names ``train.strategy`` and the known
            names).
        ImportError, AttributeError: a string entry names a module or class that does not exist.
    """
    if name not in TRAIN_BACKENDS:
        raise ValueError(f"train.strategy {name!r} has no train backend; known: {sorted(TRAIN_BACKENDS)}")
    return resolve_entry(TRAIN_BACKENDS[name])
