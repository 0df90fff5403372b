"""Megatron-core train backend (issue #15). Phase 1: model config and HF ⇄ Megatron weight conversion.

Nothing is imported here: ``import train_workers`` stays light, and megatron-core (the ``megatron`` extra) is imported
only by the functions of :mod:`train_workers.megatron.config` that build Megatron objects.
"""
