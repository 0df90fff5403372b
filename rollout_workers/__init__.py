"""Rollout engines, each a :class:`contract.rollout_engine.RolloutEngine` picked by ``rollout.engine`` from
``registry``: ``vllm/`` (the vLLM engine, its worker extension that receives streamed weights, its CPU settings: every
vLLM-specific piece of the project) and ``hf/`` (transformers' own model and decode loop, also the in-process
runtime's engine). What they share is engine-neutral: partial-rollout bookkeeping (``partial``), stop strings
(``stops``), the receiving side of the weight sync (``weights``) and the start-up report (``info``).

May import torch, transformers, Ray, ``grpo``, ``weight_sync`` (receiving side) and ``contract``; vLLM only inside
``vllm/``; never ``train_workers`` or any part of ``cluster`` (``tests/unit/test_import_layering.py``).
"""
