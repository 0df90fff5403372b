"""Train backends by name: the spec's ``train.strategy`` picks the class ``TrainPool`` starts on every rank.

Entries are classes implementing :class:`contract.train_worker.TrainWorker`, or ``"module:Class"`` strings imported on
first use, so the control plane imports no backend (nor its torch/transformers dependencies) until a pool is built.

    >>> train_backend("fsdp").__name__
    'FSDPTrainWorker'
"""

from __future__ import annotations

import importlib

#: ``train.strategy`` → backend class, or ``"module:Class"`` resolved by :func:`train_backend`.
TRAIN_BACKENDS: dict[str, type | str] = {
    "fsdp": "train_workers.fsdp_worker:FSDPTrainWorker",
    "megatron": "train_workers.megatron.worker:MegatronTrainWorker",
}


def register_train_backend(name: str, backend: type | str) -> None:
    """Add a train backend under ``name`` (a ``train.strategy`` value).

    Args:
        backend: a class implementing :class:`contract.train_worker.TrainWorker`, or ``"module:Class"``.

    Raises:
        ValueError: ``name`` is registered already, or a string ``backend`` is not ``"module:Class"``.
    """
    if name in TRAIN_BACKENDS:
        raise ValueError(f"train backend {name!r} is registered already ({TRAIN_BACKENDS[name]!r})")
    if isinstance(backend, str) and not _split(backend):
        raise ValueError(f"train backend {name!r}: expected 'module:Class', got {backend!r}")
    TRAIN_BACKENDS[name] = backend


def train_backend(name: str) -> type:
    """The backend class for ``train.strategy`` = ``name``; a ``"module:Class"`` entry is imported now.

    Raises:
        ValueError: no backend is registered under ``name`` (the message names ``train.strategy`` and the known
            names).
        ImportError, AttributeError: a string entry names a module or class that does not exist.
    """
    if name not in TRAIN_BACKENDS:
        raise ValueError(f"train.strategy {name!r} has no train backend; known: {sorted(TRAIN_BACKENDS)}")
    entry = TRAIN_BACKENDS[name]
    if not isinstance(entry, str):
        return entry
    module, cls = _split(entry)
    return getattr(importlib.import_module(module), cls)


def _split(path: str) -> tuple[str, str] | None:
    """``"pkg.mod:Class"`` → ``("pkg.mod", "Class")``; None when either part is missing."""
    module, _, cls = path.partition(":")
    return (module, cls) if module and cls else None
