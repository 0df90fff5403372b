"""Padding-free micro-batches: the sequences of one micro-batch concatenated into a single row.

Shapes (one micro-batch): n sequences, L = Σ (P_i + R_i) packed tokens, M = Σ R_i response tokens,
T = max R_i. Position ids restart at 0 for every sequence; transformers turns restarting position ids (with no
attention mask and no KV cache) into a block-diagonal causal mask, so attention never crosses sequences.

Token t of response i sits at packed position ``s_i + P_i + t`` (s_i = start of sequence i) and is predicted by the
logits at position ``s_i + P_i + t − 1``.

With transformers' ``sdpa`` attention the block-diagonal mask is a dense [L, L] mask, so attention costs O(L²) per
packed row whatever its sequences. :data:`VARLEN_SDPA` (``attn_implementation`` of a model loaded after
:func:`register_varlen_sdpa`) instead runs causal SDPA on each sequence's slice of the row: Σ l_i² work, no mask
built — the CPU counterpart of flash-attention's varlen kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
import torch
import torch.nn.functional as F

from contract.batches import PackedMicroBatch

VARLEN_SDPA = "packed_varlen_sdpa"


def pack_microbatch(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    advantages: Sequence[float] | torch.Tensor,
    behaviour_logprobs: Sequence[torch.Tensor],
    seq_indices: Sequence[int],
    valid_lengths: Sequence[int] | None = None,
    group_ids: Sequence[int] | None = None,
    loss_masks: Sequence[Sequence[bool] | None] | None = None,
) -> PackedMicroBatch:
    """Pack n (prompt, response) pairs into one row.

    Args:
        group_ids: per sequence, its group id (``GroupResult.group_id``); None: −1 for every sequence.
        valid_lengths: per sequence, how many leading response tokens count in the loss (``response_mask``): the
            tokens up to the first EOS (``grpo.eos.response_valid_lengths``), or 0 for a truncated completion masked
            out of the loss. Masked tokens are still packed and run forward. None: every response token counts.
        loss_masks: per sequence, None or R_i bools: a multi-turn episode's sampled tokens (True) and observation
            tokens (False, packed and run forward but never in ``response_mask``). ``response_mask`` is then the
            first ``valid_lengths`` tokens AND this mask; None everywhere gives exactly the mask of
            ``valid_lengths`` alone.

    Raises:
        ValueError: mismatched lengths, an empty prompt or response, logprobs or a loss mask not of the response's
            length, or a valid length outside [0, R_i].
    """
    n = len(prompt_ids)
    if not (len(response_ids) == len(advantages) == len(behaviour_logprobs) == len(seq_indices) == n):
        raise ValueError(
            f"pack_microbatch: got {n} prompts, {len(response_ids)} responses, {len(advantages)} advantages, "
            f"{len(behaviour_logprobs)} logprob rows, {len(seq_indices)} indices; all must be equal"
        )
    if n == 0:
        return empty_microbatch()
    if valid_lengths is None:
        valid_lengths = [len(r) for r in response_ids]
    if len(valid_lengths) != n:
        raise ValueError(f"pack_microbatch: got {len(valid_lengths)} valid lengths for {n} sequences")
    if group_ids is not None and len(group_ids) != n:
        raise ValueError(f"pack_microbatch: got {len(group_ids)} group ids for {n} sequences")
    if loss_masks is not None and len(loss_masks) != n:
        raise ValueError(f"pack_microbatch: got {len(loss_masks)} loss masks for {n} sequences")
    ids, pos, logit_pos, targets, tok_seq, tok_pos = [], [], [], [], [], []
    start = 0
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        if len(p) == 0 or len(r) == 0:
            raise ValueError(f"pack_microbatch: sequence {seq_indices[i]} has an empty prompt or response")
        if len(behaviour_logprobs[i]) != len(r):
            raise ValueError(
                f"pack_microbatch: sequence {seq_indices[i]} has {len(r)} response tokens but "
                f"{len(behaviour_logprobs[i])} behaviour logprobs"
            )
        length = len(p) + len(r)
        ids.append(torch.as_tensor(list(p) + list(r), dtype=torch.long))
        pos.append(torch.arange(length, dtype=torch.long))
        logit_pos.append(torch.arange(start + len(p) - 1, start + length - 1, dtype=torch.long))
        targets.append(torch.as_tensor(list(r), dtype=torch.long))
        tok_seq.append(torch.full((len(r),), i, dtype=torch.long))
        tok_pos.append(torch.arange(len(r), dtype=torch.long))
        start += length
    max_r = max(len(r) for r in response_ids)
    mask = torch.zeros(n, max_r, dtype=torch.bool)
    behaviour = torch.zeros(n, max_r, dtype=torch.float32)
    for i, r in enumerate(response_ids):
        if not 0 <= valid_lengths[i] <= len(r):
            raise ValueError(f"pack_microbatch: sequence {seq_indices[i]} has valid length {valid_lengths[i]}, "
                             f"expected 0..{len(r)}")
        mask[i, : valid_lengths[i]] = True
        if loss_masks is not None and loss_masks[i] is not None:
            sampled = torch.as_tensor(list(loss_masks[i]), dtype=torch.bool).reshape(-1)
            if sampled.numel() != len(r):
                raise ValueError(f"pack_microbatch: sequence {seq_indices[i]} has {len(r)} response tokens but a "
                                 f"loss mask of {sampled.numel()}")
            mask[i, : len(r)] &= sampled
        behaviour[i, : len(r)] = torch.as_tensor(behaviour_logprobs[i], dtype=torch.float32)
    return PackedMicroBatch(
        input_ids=torch.cat(ids)[None],
        position_ids=torch.cat(pos)[None],
        logit_positions=torch.cat(logit_pos),
        targets=torch.cat(targets),
        token_seq=torch.cat(tok_seq),
        token_pos=torch.cat(tok_pos),
        response_mask=mask,
        advantages=torch.as_tensor(advantages, dtype=torch.float32).reshape(n),
        behaviour_logprobs=behaviour,
        seq_indices=torch.as_tensor(list(seq_indices), dtype=torch.long),
        group_ids=None if group_ids is None else torch.as_tensor(list(group_ids), dtype=torch.long).reshape(n),
    )


def empty_microbatch() -> PackedMicroBatch:
    """A one-token placeholder with no response tokens: a rank with fewer sequences than the common micro-batch count
    still runs a forward/backward (keeping FSDP collectives in step) that contributes exactly zero loss."""
    z = torch.zeros(0, dtype=torch.long)
    return PackedMicroBatch(
        input_ids=torch.zeros(1, 1, dtype=torch.long), position_ids=torch.zeros(1, 1, dtype=torch.long),
        logit_positions=z, targets=z, token_seq=z, token_pos=z,
        response_mask=torch.zeros(0, 0, dtype=torch.bool), advantages=torch.zeros(0),
        behaviour_logprobs=torch.zeros(0, 0), seq_indices=z,
    )


def pack_rank_microbatches(
    ranks: Sequence[Sequence[Sequence[int]]],
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    advantages: torch.Tensor,
    behaviour_logprobs: Sequence[torch.Tensor],
    valid_lengths: Sequence[int] | None = None,
    group_ids: Sequence[int] | torch.Tensor | None = None,
    loss_masks: Sequence[Sequence[bool]] | None = None,
) -> list[list[PackedMicroBatch]]:
    """Pack a scheduler plan (``ranks[r][m]`` = sequence indices, e.g. ``MicroBatchPlan.ranks``) into per-rank lists
    of packed micro-batches; an empty index list becomes :func:`empty_microbatch` (keeps FSDP collectives in step).

    ``advantages``: [N] float32 over the whole batch; ``group_ids``: [N] int (e.g. ``RolloutBatch.group_ids``) or
    None; ``loss_masks``: N lists of R_i bools (multi-turn episodes: False for observation tokens) or None; the other
    arguments are row-aligned lists over N sequences. Each micro-batch's ``seq_indices``,
    ``advantages`` and ``group_ids`` are those of the rows it holds, whatever order the plan put them in.
    """
    gids = None if group_ids is None else [int(g) for g in group_ids]
    out = []
    for rank in ranks:
        mbs = []
        for idx in rank:
            if not idx:
                mbs.append(empty_microbatch())
                continue
            mbs.append(pack_microbatch(
                [prompt_ids[i] for i in idx], [response_ids[i] for i in idx], advantages[list(idx)],
                [behaviour_logprobs[i] for i in idx], idx,
                valid_lengths=None if valid_lengths is None else [valid_lengths[i] for i in idx],
                group_ids=None if gids is None else [gids[i] for i in idx],
                loss_masks=None if loss_masks is None else [loss_masks[i] for i in idx]))
        out.append(mbs)
    return out


def varlen_sdpa_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence (transformers attention-interface signature).

    query: [1, H, L, D]; key, value: [1, H_kv, L, D] (H a multiple of H_kv, grouped-query attention); the packed
    row's ``position_ids`` [1, L] come in ``kwargs``; a sequence starts wherever its position id is 0. Returns
    ``([1, L, H, D], None)`` like transformers' ``sdpa_attention_forward``. Cost Σ l_i² per head instead of L².

    Raises:
        ValueError: an attention mask, a batch of more than one row, no ``position_ids``, or a KV cache
            (query and key lengths differ): this path only serves padding-free packed rows in training.
    """
    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or query.shape[0] != 1 or position_ids is None or key.shape[2] != query.shape[2]:
        raise ValueError(f"{VARLEN_SDPA}: expected one packed row with position_ids, no attention mask and no KV "
                         f"cache; got query {tuple(query.shape)}, key {tuple(key.shape)}, attention_mask "
                         f"{None if attention_mask is None else tuple(attention_mask.shape)}, position_ids "
                         f"{None if position_ids is None else tuple(position_ids.shape)}")
    length = query.shape[2]
    starts = (position_ids.reshape(-1)[:length] == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0] + starts
    bounds = starts + [length]
    gqa = query.shape[1] != key.shape[1]
    out = torch.cat([
        F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout_p=dropout,
                                       is_causal=b - a > 1, scale=scaling, enable_gqa=gqa)
        for a, b in zip(bounds[:-1], bounds[1:])], dim=2)
    return out.transpose(1, 2).contiguous(), None


def _varlen_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> None:
    """Mask builder for :data:`VARLEN_SDPA`: no mask (sequences come from position ids); refuses padding."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(f"{VARLEN_SDPA}: padded inputs (attention_mask with zeros) are not supported; "
                         f"pack the sequences into one row instead")
    return None


#: Compute dtypes flash-attention's kernels accept (float32 is refused).
FLASH_ATTENTION_DTYPES = (torch.float16, torch.bfloat16)


def packed_attention(cuda: bool, compute_dtype: torch.dtype) -> str:
    """The ``attn_implementation`` for padding-free packed rows.

    flash-attention's varlen kernel (``"flash_attention_2"``; transformers derives the sequence boundaries from the
    restarting position ids) on CUDA when ``flash_attn`` is installed and ``compute_dtype`` is float16/bfloat16;
    otherwise :data:`VARLEN_SDPA` (per-sequence SDPA, registered here), also on CUDA for float32, which
    flash-attention does not support.
    """
    if cuda and compute_dtype in FLASH_ATTENTION_DTYPES:
        import importlib.util

        if importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
    return register_varlen_sdpa()


def register_varlen_sdpa() -> str:
    """Register :data:`VARLEN_SDPA` with transformers (idempotent); returns the name to pass as
    ``attn_implementation`` (or to set as ``model.config._attn_implementation``)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    AttentionMaskInterface.register(VARLEN_SDPA, _varlen_mask)
    return VARLEN_SDPA
