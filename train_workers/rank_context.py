"""One train rank's settings and the set-up every backend shares: built once from the constructor arguments.

Every backend's constructor takes the arguments of :mod:`contract.train_worker` (``rank, world_size, model_path,
train, algorithm, temperature, max_response_tokens, dtype, seed, sampling_filters, model_source``) and hands them to
:meth:`RankContext.create`, which binds the process to its cores and threads (``train.cpu_affinity``,
``train.num_threads``: :func:`train_workers.cpu_affinity.bind_rank`, before any torch work) and picks the device. The
backend keeps the context (``worker.ctx``) and asks it, in ``init_distributed``, to join the train process group
(:meth:`RankContext.join_train_group`: backend, device, timeout, seed), to build AdamW over the trainable parameters
(:meth:`RankContext.adamw`) and to describe the rank (:meth:`RankContext.rank_info`). What differs by backend (how
the policy is built and sharded) stays in the backend.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from contract.console import route_worker_logs
from contract.messages import TrainRankInfo
from contract.model_source import ModelSource
from train_workers.cpu_affinity import bind_rank
from train_workers.sharding import as_dtype


@dataclass(frozen=True)
class RankContext:
    """The settings of one train rank (:mod:`contract.train_worker` describes each argument).

    Attributes:
        rank, world_size: this rank and the number of train ranks.
        model_path: local HF folder of the initial policy (also the reference policy).
        train: the spec's ``TrainSpec``. algorithm: its ``AlgorithmSpec``.
        temperature: the rollout's sampling temperature (logprobs are recomputed at it).
        max_response_tokens: for the Dr. GRPO ``seq-mean-token-sum-norm`` aggregation.
        dtype: the compute dtype (``model.dtype``): float32, or bfloat16/float16 for mixed precision.
        seed: torch seed base (the rank seeds ``seed + rank``).
        sampling_filters: the rollout's ``{"top_k", "top_p", "min_p"}`` (logprobs are computed under them); {} when
            off.
        source: how the model's files are loaded (``model.revision``, ``model.trust_remote_code``): every
            ``from_pretrained`` of the rank passes ``source.hf_kwargs(path)``.
        device: where this rank computes: ``cuda:<current>`` when CUDA is available and
            ``train.num_gpus_per_worker`` > 0, else the CPU.
    """

    rank: int
    world_size: int
    model_path: str
    train: object
    algorithm: object
    temperature: float
    max_response_tokens: int
    dtype: torch.dtype
    seed: int
    sampling_filters: dict
    source: ModelSource
    device: torch.device

    @classmethod
    def create(cls, rank: int, world_size: int, model_path: str, train, algorithm, temperature: float,
               max_response_tokens: int, dtype: str | torch.dtype = "float32", seed: int = 0,
               sampling_filters: dict | None = None, source: ModelSource | None = None) -> RankContext:
        """The context of the constructor arguments; binds this process to ``train.cpu_affinity`` and sets torch's
        threads (``bind_rank``) before it touches CUDA.

        Raises:
            ValueError: an unknown ``dtype`` name, or a core in ``train.cpu_affinity`` this process may not use
                (naming the field).
        """
        compute_dtype = as_dtype(dtype)
        route_worker_logs(f"train-rank{rank}")  # quiet console under `grpo-cluster run` (contract.console)
        bind_rank(train)  # train.cpu_affinity and train.num_threads, before any torch work
        use_cuda = torch.cuda.is_available() and train.num_gpus_per_worker > 0
        device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        return cls(rank=rank, world_size=world_size, model_path=model_path, train=train, algorithm=algorithm,
                   temperature=temperature, max_response_tokens=max_response_tokens, dtype=compute_dtype, seed=seed,
                   sampling_filters=dict(sampling_filters or {}), source=source or ModelSource(), device=device)

    @property
    def use_cuda(self) -> bool:
        """Whether this rank computes on a GPU."""
        return self.device.type == "cuda"

    def join_train_group(self, master_addr: str, master_port: int) -> str:
        """Join the train process group at ``master_addr:master_port`` (``train.backend``, or NCCL on GPU and gloo on
        CPU for ``auto``; ``train.timeout_s``), then seed torch with ``seed + rank``. A collective.

        Returns:
            the process-group backend name.
        Raises:
            RuntimeError: the group did not form within ``train.timeout_s`` (torch.distributed's error).
        """
        train = self.train
        backend = train.backend if train.backend != "auto" else ("nccl" if self.use_cuda else "gloo")
        if self.use_cuda:
            torch.cuda.set_device(self.device)
        dist.init_process_group(
            backend=backend, init_method=f"tcp://{master_addr}:{master_port}", rank=self.rank,
            world_size=self.world_size, timeout=timedelta(seconds=train.timeout_s),
        )
        torch.manual_seed(self.seed + self.rank)
        return backend

    def adamw(self, policy: torch.nn.Module) -> torch.optim.AdamW:
        """AdamW over ``policy``'s parameters that require grad, with ``train.lr``, ``betas`` and ``weight_decay``."""
        return torch.optim.AdamW(
            [p for p in policy.parameters() if p.requires_grad], lr=self.train.lr,
            betas=tuple(self.train.betas), weight_decay=self.train.weight_decay,
        )

    def rank_info(self, backend: str, num_parameters: int) -> TrainRankInfo:
        """This rank's :class:`TrainRankInfo`: Ray node and GPU ids read from the worker itself when under Ray (where
        the rank really runs), its pid, device, cores and torch threads."""
        import ray

        node_id, gpu_ids = None, []
        if ray.is_initialized():
            node_id = ray.get_runtime_context().get_node_id()
            gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        return TrainRankInfo(rank=self.rank, backend=backend, num_parameters=num_parameters, pid=os.getpid(),
                             device=str(self.device), node_id=node_id, gpu_ids=gpu_ids,
                             cpu_cores=sorted(os.sched_getaffinity(0)), num_threads=torch.get_num_threads())


def node_address() -> tuple[str, int]:
    """(IP of this node, a free port on it): rank 0's answer becomes the rendezvous address (127.0.0.1 outside
    Ray)."""
    import ray

    from weight_sync.group import free_port

    ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    return ip, free_port(ip)


def sync_node_id() -> str | None:
    """This process's Ray node id (``sync.mode: auto`` compares the train rank's with the engines'); None outside
    Ray."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
