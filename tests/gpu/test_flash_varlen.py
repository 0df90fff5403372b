"""flash-attention's varlen kernel on packed rows equals the per-sequence SDPA path (``train_workers.packing``).

Skipped without CUDA (conftest) or without the ``flash_attn`` package. A tiny random Llama in bfloat16 runs one packed
row of three sequences through transformers' ``flash_attention_2`` (sequence boundaries from the restarting position
ids) and through :data:`VARLEN_SDPA`; logprobs of every token must agree within bfloat16 rounding, and each sequence's
must equal its logprobs computed alone (no attention across sequences).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash_attn is not installed"),
]

LENGTHS = (37, 5, 90)
ATOL = 0.05  # bfloat16 compute, 2 layers: both paths round differently; a leak across sequences moves logprobs ≫ 0.1


def _model(attn: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.tiny_model import TINY_CONFIG

    config = AutoConfig.for_model("llama", vocab_size=512, **TINY_CONFIG)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attn).cuda().eval()


def _logprobs(model, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]


def test_flash_varlen_matches_varlen_sdpa():
    from train_workers.packing import VARLEN_SDPA, packed_attention, register_varlen_sdpa

    assert packed_attention(True, torch.bfloat16) == "flash_attention_2"
    assert packed_attention(True, torch.float32) == VARLEN_SDPA
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 512, (n,), generator=g) for n in LENGTHS]
    ids = torch.cat(seqs)[None].cuda()
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None].cuda()
    flash = _model("flash_attention_2")
    sdpa = _model(register_varlen_sdpa())
    lp_flash, lp_sdpa = _logprobs(flash, ids, pos), _logprobs(sdpa, ids, pos)
    torch.testing.assert_close(lp_flash, lp_sdpa, rtol=0, atol=ATOL)
    start = 0
    for s in seqs:
        alone = _logprobs(flash, s[None].cuda(), torch.arange(len(s))[None].cuda())
        # packed position start + t predicts token start + t + 1 (the last one predicts the next sequence's first)
        torch.testing.assert_close(lp_flash[start : start + len(s) - 1], alone, rtol=0, atol=ATOL)
        start += len(s)
