"""A causal LM that returns per-token logprobs of the response tokens only.

The LM head (49k × 576 for SmolLM2, a large share of the FLOPs) is applied only at the M positions that predict
response tokens, never to prompt positions. Wrapping the HF model in this module also makes it the FSDP2 root, so
one root pre-forward hook unshards the embedding, final norm and head before ``forward`` runs.
"""

from __future__ import annotations

import torch
from torch import nn

from grpo.logprobs import entropy_from_logits, logprobs_from_logits


class ResponseLogprobModel(nn.Module):
    """``forward(input_ids [1, L], position_ids [1, L], logit_positions [M], targets [M])`` →
    ``(logprobs [M] float32, entropy [M] float32 detached)`` at the sampling ``temperature``.

    Args:
        model: an HF ``*ForCausalLM`` (``get_decoder()`` backbone + ``get_output_embeddings()`` head).
        temperature: logits are divided by it before log-softmax, matching the engine's processed logprobs.
    """

    def __init__(self, model: nn.Module, temperature: float, logit_chunk_size: int = 1024):
        super().__init__()
        self.model = model
        self.temperature = float(temperature)
        self.logit_chunk_size = logit_chunk_size

    def forward(self, input_ids, position_ids, logit_positions, targets, with_entropy: bool = True):
        backbone = self.model.get_decoder()
        head = self.model.get_output_embeddings()
        hidden = backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        h = hidden[0, logit_positions]  # [M, H]
        logits = head(h).float()  # [M, V]
        # clone: FSDP2 hooks the root's outputs for backward and warns about returned views
        logprobs = logprobs_from_logits(logits, targets, self.temperature).clone()
        if not with_entropy:
            return logprobs, None
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach(), self.temperature, chunk_size=self.logit_chunk_size)
        return logprobs, entropy
