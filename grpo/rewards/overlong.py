"""DAPO soft overlong punishment: a length-dependent reward penalty for completions near or over the length cap.

Source: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", eq. (13). With the cap
L_max (``max_response_tokens``) and a buffer of L_cache tokens before it:

    R_length(|y|) =  0                                  if |y| ≤ L_max − L_cache
                     ((L_max − L_cache) − |y|) / L_cache if L_max − L_cache < |y| ≤ L_max
                     −1                                  if |y| > L_max

scaled by a penalty factor (verl's ``overlong_penalty_factor``) and added to the rule-based reward. A completion cut
at the cap (|y| = L_max) gets −factor; the penalty falls linearly to 0 at the start of the buffer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["overlong_penalty"]


def overlong_penalty(
    lengths: Sequence[int] | torch.Tensor, max_response_tokens: int, buffer_tokens: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """R_length per completion (formula: module doc), times ``penalty_factor``.

    Args:
        lengths: [N] response lengths |y| in tokens (ints ≥ 0).
        max_response_tokens: L_max ≥ 1.
        buffer_tokens: L_cache in [1, L_max].
        penalty_factor: finite, ≥ 0.

    Returns:
        [N] float32 penalties in [−penalty_factor, 0].

    Raises:
        ValueError: out-of-range arguments or negative lengths.
    """
    if max_response_tokens < 1:
        raise ValueError(f"max_response_tokens must be >= 1, got {max_response_tokens!r}")
    if not 1 <= buffer_tokens <= max_response_tokens:
        raise ValueError(f"buffer_tokens must be in [1, max_response_tokens={max_response_tokens}], "
                         f"got {buffer_tokens!r}")
    if not (math.isfinite(penalty_factor) and penalty_factor >= 0.0):
        raise ValueError(f"penalty_factor must be finite and >= 0, got {penalty_factor!r}")
    n = torch.as_tensor(lengths, dtype=torch.float64).reshape(-1)
    if (n < 0).any():
        raise ValueError(f"lengths must be >= 0, got min {int(n.min())}")
    start = float(max_response_tokens - buffer_tokens)
    ramp = (start - n) / float(buffer_tokens)
    penalty = torch.where(n <= start, torch.zeros_like(n), torch.where(n <= max_response_tokens, ramp, -1.0))
    return (penalty * penalty_factor).to(torch.float32)
