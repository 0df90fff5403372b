"""Rollout engines: the vLLM engine actor (``engine``) that samples groups with behaviour logprobs, and its worker
extension (``vllm_extension``) that receives streamed weights into the running engine.

May import vLLM, torch, Ray, ``weight_sync`` (receiving side) and ``contract.messages``; never ``train_workers`` or
any other part of ``cluster`` (``tests/unit/test_import_layering.py``).
"""
