"""A Megatron-core ``GPTModel`` that returns per-token logprobs of the response tokens of a packed micro-batch.

Shapes: one packed micro-batch (``train_workers.packing.PackedMicroBatch``) of n sequences, L packed tokens, M
response tokens; S = the longest sequence (prompt + response); V the real vocabulary, Vp the padded one
(``MegatronLayout.padded_vocab_size``), tp the tensor-parallel size.

Padding-free "or the equivalent": megatron-core's local (non-Transformer-Engine) attention, the one that runs without
CUDA, refuses packed sequences (``PackedSeqParams`` need TE's fused attention), and Megatron's RoPE ignores
``position_ids`` (positions are 0..S-1 of each row). So :func:`unpack_right_padded` turns the packed row back into a
right-padded [n, S] batch, each sequence starting at position 0 of its row, and the forward passes an explicit causal
mask [n, 1, S, S] (True = masked, Megatron's convention). Right padding needs nothing beyond the causal mask: a real
token never attends to a later (padding) position, and logits of padding positions are never read. This is the same
math as the packed FSDP2 path (block-diagonal causal attention, per-sequence positions). With Transformer Engine on
GPU the packed path (``PackedSeqParams`` with ``cu_seqlens``) can replace it later. With pipeline parallelism every
micro-batch of a step is padded further, to R rows × S columns common to the step (:meth:`StageBatch.padded`), because
megatron-core's p2p communication receives one fixed [S, R, H] shape; padding rows are all-padding and never read.
With sequence parallelism (``train.sequence_parallel``, pp = 1) S is padded further, to a multiple of tp (the
embedding output is split by sequence over the tp ranks), and the output layer's input is gathered along the sequence
before the response positions are picked (:meth:`MegatronResponseLogprobs._pick_response_positions`).

Logprobs under the rollout's sampling distribution (``grpo.logprobs`` module docstring): z = logits / temperature over
the real vocabulary only — the Vp − V padded columns (zero rows of the output layer, ``convert.pad_vocab``) are
dropped (tp = 1) or set to −inf (tp > 1) before the log-softmax. The output layer runs only on the M positions that
predict response tokens (a forward pre-hook on ``output_layer`` picks their hidden states): [M, Vp/tp] logits, never
[n, S, Vp/tp].

- tp = 1: ``grpo.logprobs.logprobs_from_logits`` on z[:, :V] with the rollout's top-k/top-p/min-p filters, and the
  entropy of the filtered distribution (``filter_logits_`` then ``entropy_from_logits``), as the FSDP2 path computes
  them (``linear_logprobs``).
- tp > 1: each rank holds Vp/tp vocabulary columns (``ColumnParallelLinear`` with ``parallel_output=True``);
  log p(y) = −``vocab_parallel_cross_entropy``(z, y) (``megatron/core/tensor_parallel/cross_entropy.py``: max, Σ exp
  and the target's logit all-reduced over the TP group, gradient softmax − one-hot on each rank's columns); the
  entropy H = log Σ e − Σ e·(z − max) / Σ e with e = exp(z − max), reduced the same way, differentiable
  (:class:`_VocabParallelEntropy`), as ``grpo.logprobs.linear_logprobs`` returns it. The sampling filters need the
  whole distribution per position and are refused at tp > 1 (:class:`MegatronResponseLogprobs` raises).

The entropy carries its gradient (an entropy bonus in the loss trains the policy) when ``entropy_grad`` is set, which
the worker does when ``algorithm.entropy_coef`` > 0; otherwise it is computed without a graph (it is then a metric
only), saving the [M, V] softmax its backward would keep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from grpo.logprobs import entropy_from_logits, filter_logits_, logprobs_from_logits


def unpack_right_padded(input_ids: torch.Tensor, position_ids: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed row → right-padded batch.

    Args:
        input_ids, position_ids: [1, L] int64; a sequence starts where its position id is 0 and its position ids
            count 0, 1, 2, ... (``train_workers.packing.pack_microbatch``).

    Returns:
        (ids [n, S] int64, padded with 0; row [L] int64 and col [L] int64: packed position p is token
        ``ids[row[p], col[p]]``).

    Raises:
        ValueError: not one row, or position ids that do not restart at 0 and count up by one (Megatron's RoPE uses
            the column index as the position, so any other position ids would be silently wrong).
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or position_ids.shape != input_ids.shape:
        raise ValueError(f"expected one packed row: input_ids and position_ids [1, L], got "
                         f"{tuple(input_ids.shape)} and {tuple(position_ids.shape)}")
    pos = position_ids[0]
    length = pos.shape[0]
    starts = (pos == 0).nonzero().flatten()
    if length == 0 or starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError(f"packed position ids must start at 0, got {pos[:8].tolist()}")
    row = torch.cumsum(pos == 0, 0) - 1
    col = torch.arange(length, device=pos.device) - starts[row]
    if not torch.equal(col, pos):
        raise ValueError("packed position ids must count 0, 1, 2, ... within each sequence (Megatron's RoPE uses "
                         "the column of the right-padded batch as the position)")
    lengths = torch.diff(torch.cat([starts, starts.new_tensor([length])]))
    ids = input_ids.new_zeros(starts.numel(), int(lengths.max()))
    ids[row, col] = input_ids[0]
    return ids, row, col


def causal_mask(n: int, s: int, device: torch.device) -> torch.Tensor:
    """[n, 1, S, S] bool, True above the diagonal (masked): Megatron's ``attention_mask`` convention
    (``megatron/core/transformer/utils.py`` ``attention_mask_func`` fills True entries)."""
    return torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), 1)[None, None].expand(n, 1, s, s)


def _vocab_parallel_entropy(z: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(entropy [M], logsumexp [M]) float32, no gradient, of softmax(z) where z [M, Vp/tp] float32 is this rank's share
    of the columns (−inf entries allowed) and ``group`` the tensor-parallel group holding the others."""
    with torch.no_grad():
        zmax = z.max(dim=-1).values
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=group)
        shifted = z - zmax[:, None]
        e = shifted.exp()
        sums = torch.stack([e.sum(-1), torch.where(e > 0, e * shifted, 0.0).sum(-1)])
        dist.all_reduce(sums, group=group)
        return sums[0].log() - sums[1] / sums[0], zmax + sums[0].log()


class _VocabParallelEntropy(torch.autograd.Function):
    """Differentiable :func:`_vocab_parallel_entropy`. d H / d z_j = −p_j (log p_j + H) involves only this rank's
    columns once p (through the global logsumexp) and H are known from the forward's all-reduces, so the backward is
    local; the column-parallel output layer's backward all-reduces its input gradient over the TP group, as for
    ``vocab_parallel_cross_entropy``. −inf columns (padding) get gradient 0 (log p floored at −1e4, where p = 0)."""

    @staticmethod
    def forward(ctx, z, group):
        entropy, lse = _vocab_parallel_entropy(z, group)
        ctx.save_for_backward(z, lse, entropy)
        return entropy

    @staticmethod
    def backward(ctx, grad):
        z, lse, entropy = ctx.saved_tensors
        logp = z - lse[:, None]
        p = logp.exp()
        return -(grad[:, None] * p * (logp.clamp(min=-1e4) + entropy[:, None])), None


def refuse_vocab_parallel_filters(tp: int, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> None:
    """Raise :class:`ValueError` naming ``rollout.<filter>`` when a sampling filter is on (top_k > 0, top_p < 1,
    min_p > 0; vLLM's "off" values 0/−1, 1, 0 pass) with tensor parallel size ``tp`` > 1."""
    if tp <= 1:
        return
    for field, on, off in (("top_k", top_k > 0, 0), ("top_p", top_p < 1.0, 1.0), ("min_p", min_p > 0.0, 0.0)):
        if on:
            value = {"top_k": top_k, "top_p": top_p, "min_p": min_p}[field]
            raise ValueError(f"rollout.{field}={value}: sampling filters are not computed vocab-parallel yet; "
                             f"train.strategy megatron with tensor_parallel_size={tp} needs {field}={off}")


@dataclass
class StageBatch:
    """One packed micro-batch as a Megatron stage runs it: right-padded rows (:func:`unpack_right_padded`).

    ids: [R, S] int64, padded with 0 (R ≥ n rows: pipeline stages pad every micro-batch of a step to one shape, since
    megatron-core's p2p receives a fixed [S, R, H]). rows, cols: [M] int64, the (row, column) of the position whose
    logits predict each response token. targets: [M] int64, the response tokens.
    """

    ids: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    targets: torch.Tensor

    def padded(self, num_rows: int, seq_len: int) -> StageBatch:
        """This batch right-padded with 0 to [num_rows, seq_len].

        Raises:
            ValueError: the batch is larger than [num_rows, seq_len].
        """
        n, s = self.ids.shape
        if n > num_rows or s > seq_len:
            raise ValueError(f"micro-batch [{n}, {s}] does not fit the step's shape [{num_rows}, {seq_len}]")
        ids = self.ids.new_zeros(num_rows, seq_len)
        ids[:n, :s] = self.ids
        return StageBatch(ids, self.rows, self.cols, self.targets)


def stage_batch(input_ids: torch.Tensor, position_ids: torch.Tensor, logit_positions: torch.Tensor,
                targets: torch.Tensor) -> StageBatch:
    """A packed micro-batch's tensors (``ResponseLogprobModel``'s arguments) → :class:`StageBatch` [n, S]."""
    ids, row, col = unpack_right_padded(input_ids, position_ids)
    return StageBatch(ids, row[logit_positions], col[logit_positions], targets)


class MegatronResponseLogprobs(nn.Module):
    """``forward(input_ids [1, L], position_ids [1, L], logit_positions [M], targets [M])`` →
    ``(logprobs [M] float32, entropy [M] float32, or None)``: the signature of
    ``train_workers.policy.ResponseLogprobModel``, so ``train_workers.grpo_step``'s loss code runs unchanged.

    With pipeline parallelism the schedule calls :meth:`stage_forward` on each stage instead of ``forward``.

    Args:
        model: a ``GPTModel`` built with ``parallel_output=True``: the whole decoder (pp = 1) or one pipeline stage.
        vocab_size: V, the real vocabulary (HF ``vocab_size``); columns ≥ V are padding.
        temperature: > 0, the rollout's sampling temperature.
        top_k, top_p, min_p: the rollout's sampling filters (``grpo.logprobs.filter_logits_``), tp = 1 only.
        compute_dtype: None runs the model in its parameters' dtype; bfloat16/float16 runs it on casts of the
            (float32) parameters to that dtype (:meth:`run_model`). Logprobs and entropies are float32 either way.
        entropy_grad: the entropy carries its gradient under autograd (module docstring); False: a metric only.

    Raises:
        ValueError: a sampling filter is set with tensor parallelism (the message names the ``rollout.*`` field).
    """

    def __init__(self, model: nn.Module, vocab_size: int, temperature: float, *, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0, compute_dtype: torch.dtype | None = None, entropy_grad: bool = True):
        super().__init__()
        from megatron.core import parallel_state as ps

        self.model = model
        self.compute_dtype = compute_dtype
        self.entropy_grad = bool(entropy_grad)
        self.vocab_size = int(vocab_size)
        self.temperature = float(temperature)
        self.top_k, self.top_p, self.min_p = int(top_k), float(top_p), float(min_p)
        self._rows = self._cols = None
        if model.post_process:  # the last pipeline stage holds the output layer
            model.output_layer.register_forward_pre_hook(self._pick_response_positions)
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.sequence_parallel = bool(model.config.sequence_parallel)
        if self.tp > 1:
            refuse_vocab_parallel_filters(self.tp, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)

    def _pick_response_positions(self, module, args):
        """``output_layer`` forward pre-hook: keep only the hidden states of the M positions whose logits are read,
        [S, n, H] → [M, 1, H] (set by :meth:`stage_forward`), so the LM head never runs on prompt or padding positions
        (``GPTModel._postprocess`` calls ``output_layer(hidden_states, weight=...)`` after the final norm).

        Sequence parallel: the hook receives this rank's sequence shard [S/tp, n, H] and the output layer
        (``ColumnParallelLinear`` with ``sequence_parallel``) all-gathers its input along dim 0. So the hook
        all-gathers the shards (``gather_from_sequence_parallel_region`` without the reduce-scatter backward: every
        rank gets the whole gradient back from the output layer's backward), picks the M rows, pads them with zero
        rows to Mp = tp·⌈M/tp⌉ and hands the output layer this rank's Mp/tp rows
        (``scatter_to_sequence_parallel_region``; backward all-gather); its logits are [Mp, 1, Vp/tp], of which
        :meth:`stage_forward` reads the first M."""
        if self._rows is None:  # the GPTModel called on its own: all positions
            return None
        hidden = args[0]
        if not self.sequence_parallel:
            return (hidden[self._cols, self._rows][:, None, :],) + tuple(args[1:])
        from megatron.core.tensor_parallel import (gather_from_sequence_parallel_region,
                                                   scatter_to_sequence_parallel_region)

        full = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False, group=self.tp_group)
        picked = full[self._cols, self._rows][:, None, :]
        picked = nn.functional.pad(picked, (0, 0, 0, 0, 0, -picked.shape[0] % self.tp))
        return (scatter_to_sequence_parallel_region(picked, group=self.tp_group),) + tuple(args[1:])

    def run_model(self, **kwargs) -> torch.Tensor:
        """``self.model(**kwargs)``; with ``compute_dtype`` set, run on casts of its parameters to that dtype
        (``torch.func.functional_call``, names and tied weights unchanged). The casts are differentiable, so each
        parameter's ``.grad`` is the low-precision gradient upcast to the parameter's dtype and summed over
        micro-batches in it: the arithmetic of FSDP2's ``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)``
        (``train_workers.sharding``). Returns the model's output (here logits [1, M, Vp/tp] in ``compute_dtype``)."""
        if self.compute_dtype is None:
            return self.model(**kwargs)
        from torch.func import functional_call

        cast = {name: p.to(self.compute_dtype) for name, p in self.model.named_parameters()}
        return functional_call(self.model, cast, (), kwargs)

    def forward(self, input_ids, position_ids, logit_positions, targets, with_entropy: bool = True):
        return self.stage_forward(stage_batch(input_ids, position_ids, logit_positions, targets), with_entropy)

    def stage_forward(self, batch: StageBatch, with_entropy: bool = True):
        """Run this rank's stage of the model on ``batch`` (positions 0..S-1 of each row, causal mask).

        Returns:
            on the last pipeline stage (and at pp = 1), ``(logprobs [M] float32, entropy [M] float32 or None)``; on
            other stages the hidden states [S, R, H] for the next stage (the stage's input comes from
            ``GPTModel.set_input_tensor``, which megatron-core's schedule calls).
        """
        ids = batch.ids
        if self.sequence_parallel:  # the embedding output is split by sequence over the tp ranks: S % tp == 0
            ids = nn.functional.pad(ids, (0, -ids.shape[1] % self.tp))
        n, s = ids.shape
        positions = torch.arange(s, device=ids.device)[None].expand(n, s)
        self._rows, self._cols = batch.rows, batch.cols
        try:
            out = self.run_model(input_ids=ids, position_ids=positions,
                                 attention_mask=causal_mask(n, s, ids.device))
        finally:
            self._rows = self._cols = None
        if not self.model.post_process:
            return out
        m = batch.targets.shape[0]  # with sequence parallelism the output layer ran on Mp >= M rows: keep the first M
        return self._response_logprobs(out[0, :m], batch.targets, with_entropy)  # [M, Vp/tp]

    def _response_logprobs(self, picked: torch.Tensor, targets: torch.Tensor, with_entropy: bool):
        """Logits [M, Vp/tp] of the picked positions → (logprobs [M], entropy [M] or None) (module docstring)."""
        grad = self.entropy_grad and torch.is_grad_enabled()
        if self.tp == 1:
            z = picked[:, : self.vocab_size]
            lp = logprobs_from_logits(z, targets, self.temperature, top_k=self.top_k, top_p=self.top_p,
                                      min_p=self.min_p)
            ent = None
            if with_entropy:  # of the distribution the tokens were sampled from: after the filters, as FSDP2's
                with torch.set_grad_enabled(grad):
                    zs = z.float() / self.temperature
                    with torch.no_grad():
                        removed = torch.isneginf(filter_logits_(zs.detach().clone(), targets, self.top_k,
                                                                self.top_p, self.min_p))
                    ent = entropy_from_logits(zs.masked_fill(removed, float("-inf")))
            return lp, ent
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        part = picked.shape[-1]
        columns = torch.arange(self.tp_rank * part, (self.tp_rank + 1) * part, device=picked.device)
        z = (picked.float() / self.temperature).masked_fill(columns >= self.vocab_size, float("-inf"))
        ent = None
        if with_entropy:
            ent = _VocabParallelEntropy.apply(z, self.tp_group) if grad else \
                _vocab_parallel_entropy(z.detach(), self.tp_group)[0]
        # vocab_parallel_cross_entropy subtracts the max from its input in place: a copy when the entropy saved z
        return -vocab_parallel_cross_entropy(z.clone() if ent is not None and grad else z, targets), ent
