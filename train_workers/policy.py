"""A causal LM that returns per-token logprobs of the response tokens only.

The LM head (49k × 576 for SmolLM2, a large share of the FLOPs) is applied only at the M positions that predict
response tokens, never to prompt positions, and is fused with the log-softmax (``grpo.logprobs.linear_logprobs``):
at most ``logit_chunk_size`` × V float32 logits exist at once, in the forward and in the backward. Wrapping the HF
model in this module also makes it the FSDP2 root, so one root pre-forward hook unshards the embedding, final norm and
head before ``forward`` runs.
"""

from __future__ import annotations

from torch import nn

from grpo.logprobs import linear_logprobs


class ResponseLogprobModel(nn.Module):
    """``forward(input_ids [1, L], position_ids [1, L], logit_positions [M], targets [M])`` →
    ``(logprobs [M] float32, entropy [M] float32 or None)``, both differentiable, under the rollout's sampling
    distribution (an entropy bonus in the loss trains the policy through the fused head).

    Args:
        model: an HF ``*ForCausalLM`` (``get_decoder()`` backbone + ``get_output_embeddings()`` linear head).
        temperature: logits are divided by it before log-softmax, matching the engine's processed logprobs.
        top_k, top_p, min_p: the rollout's sampling filters (``rollout.top_k/top_p/min_p``): the log-softmax is
            renormalised over the tokens vLLM keeps plus the target (``grpo.logprobs.filter_logits_``), as the
            engine's processed logprobs are. Defaults: off.
        logit_chunk_size: response positions whose logits are materialised at once (memory ≈ chunk × V × 4 bytes,
            ≈ 200 MB at 1024 for a 49k vocabulary). Up to it, one chunk keeps its softmax for the backward; above it
            each chunk's logits are recomputed in the backward (+ 2·M·H·V FLOPs). None: never chunk.
    """

    def __init__(self, model: nn.Module, temperature: float, logit_chunk_size: int | None = 1024, *,
                 top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
        super().__init__()
        self.model = model
        self.temperature = float(temperature)
        self.logit_chunk_size = logit_chunk_size
        self.top_k, self.top_p, self.min_p = int(top_k), float(top_p), float(min_p)

    def forward(self, input_ids, position_ids, logit_positions, targets, with_entropy: bool = True):
        backbone = self.model.get_decoder()
        head = self.model.get_output_embeddings()
        hidden = backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        h = hidden[0, logit_positions]  # [M, H]
        return linear_logprobs(h, head.weight, targets, self.temperature, bias=head.bias,
                               chunk_size=self.logit_chunk_size, with_entropy=with_entropy,
                               top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)
