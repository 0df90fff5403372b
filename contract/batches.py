"""The batches the roles hand each other: the driver's scored rollout batch and a train rank's packed micro-batch.

Both are plain dataclasses of CPU tensors and lists (pickled by Ray as they are). Notation: N sequences in a rollout
batch (B groups of G), R_i response tokens of sequence i; in a micro-batch n sequences, L packed tokens, M response
tokens, T the longest response.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

__all__ = ["PackedMicroBatch", "RolloutBatch"]


@dataclass
class RolloutBatch:
    """N scored sequences (one row each), grouped by ``group_ids``.

    prompt_ids, response_ids: N token-id lists (response without the prompt).
    behaviour_logprobs: N float32 tensors [R_i], the engine's logprobs of the response tokens.
    finish_reasons: N engine finish reasons ("stop" / "length"); ``terminated`` is what counts.
    texts, references: N completions (decoded) and reference answers.
    versions: N policy versions that sampled each row.
    group_ids: [N] int64, the group of each row (unique within a step).
    valid_lengths: N ints, response tokens that count in the loss (up to the first EOS; 0 when masked).
    terminated: N bools, True iff the response contains an EOS id or ended at a stop string (``grpo.eos``).
    rewards: [N] float32 total reward Σ weight·reward (NaN = no valid reward).
    per_function: name → [N] float32 unweighted rewards (NaN = none).
    advantages: [N] float32.
    num_failed: failed reward evaluations (completions × functions that raised with reward_on_error "none").
    num_not_applicable: rows with a total reward that a weighted reward function skipped with None (it does not apply
        to them; TRL's convention), ``reward/not_applicable``.
    token_versions: N lists of R_i ints, the policy version that sampled each response token (partial rollouts: a
        row may span versions; ``versions`` is then its group's oldest); None when not recorded (every token of a
        row is ``versions[i]``'s).
    loss_masks: (multi-turn episodes) N lists of R_i bools, True for tokens the policy sampled, False for observation
        tokens an environment inserted (never in the loss, the KL or the entropy); None: every token was sampled.
    episodes: (multi-turn episodes) N ``contract.messages.EpisodeSummary``; None for single completions.
    episode_ids: (agents) [N] int64, the episode of each row, unique within a step: an episode whose agent rewrote
        its history is several rows (sequences) that share its reward and advantage, computed over the G episodes of
        its group, not over rows (``cluster.loop.scoring``); None: each row is its own episode.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    behaviour_logprobs: list[torch.Tensor]
    finish_reasons: list[str]
    texts: list[str]
    references: list[str]
    versions: list[int]
    group_ids: torch.Tensor
    valid_lengths: list[int]
    terminated: list[bool]
    rewards: torch.Tensor
    per_function: dict[str, torch.Tensor]
    advantages: torch.Tensor
    num_failed: int = 0
    num_not_applicable: int = 0
    token_versions: list[list[int]] | None = None
    loss_masks: list[list[bool]] | None = None
    episodes: list | None = None
    episode_ids: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.response_ids)

    def episode_rows(self) -> list[int]:
        """One row per episode: the last row of each, in row order; every row without ``episode_ids``. Per-episode
        figures (rewards, ``episode/*``) are taken over these rows."""
        if self.episode_ids is None:
            return list(range(len(self)))
        last = {episode: i for i, episode in enumerate(self.episode_ids.tolist())}
        return sorted(last.values())

    def loss_mask(self, i: int) -> torch.Tensor:
        """[R_i] bool: the tokens of row ``i`` that count in the loss: the first ``valid_lengths[i]``, and of those
        only the sampled ones (``loss_masks``)."""
        mask = torch.zeros(len(self.response_ids[i]), dtype=torch.bool)
        mask[:self.valid_lengths[i]] = True
        if self.loss_masks is not None:
            mask &= torch.as_tensor(list(self.loss_masks[i]), dtype=torch.bool).reshape(-1)
        return mask

    def loss_token_counts(self) -> list[int]:
        """N ints: the tokens of each row that count in the loss (``valid_lengths`` without a loss mask)."""
        if self.loss_masks is None:
            return list(self.valid_lengths)
        return [int(self.loss_mask(i).sum()) for i in range(len(self))]

    def sampled_lengths(self) -> list[int]:
        """N ints: the response tokens the policy sampled in each row (observation tokens left out)."""
        if self.loss_masks is None:
            return [len(r) for r in self.response_ids]
        return [sum(bool(b) for b in m) for m in self.loss_masks]

    def num_trained_sequences(self) -> int:
        """Rows with at least one token in the loss (:meth:`loss_token_counts` > 0): a row masked whole (no reward,
        ``mask_truncated``, an empty response) trains nothing and is not counted (``rollout/sequences_trained``)."""
        return sum(1 for count in self.loss_token_counts() if count > 0)

    def num_nonfinite_logprobs(self) -> int:
        """Response tokens that count in the loss (:meth:`loss_mask`) whose engine logprob is NaN or ±inf.
        The trainer gives such a token importance weight 1 and leaves it out of ``rollout/logprob_diff``
        (``grpo.losses.truncated_importance_weights``); the driver reports the count as
        ``rollout/nonfinite_logprobs``."""
        if self.loss_masks is None:
            return sum(int((~torch.isfinite(lps[:n])).sum()) for lps, n in zip(self.behaviour_logprobs,
                                                                                self.valid_lengths))
        return sum(int((~torch.isfinite(lps[self.loss_mask(i)])).sum())
                   for i, lps in enumerate(self.behaviour_logprobs))

    def select(self, rows: Sequence[int]) -> RolloutBatch:
        """The batch restricted to ``rows`` (in that order); ``num_failed`` and ``num_not_applicable`` are kept."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                out[f.name] = value[index]
            elif isinstance(value, dict):
                out[f.name] = {k: v[index] for k, v in value.items()}
            elif isinstance(value, list):
                out[f.name] = [value[i] for i in rows]
            else:
                out[f.name] = value
        return RolloutBatch(**out)

    @classmethod
    def concat(cls, batches: Sequence[RolloutBatch]) -> RolloutBatch:
        """Rows of every batch in order; ``num_failed`` and ``num_not_applicable`` summed; ``token_versions`` None
        unless every batch has them.
        Raises ValueError for no batches or differing reward functions."""
        if not batches:
            raise ValueError("RolloutBatch.concat: expected at least one batch, got none")
        names = set(batches[0].per_function)
        if any(set(b.per_function) != names for b in batches):
            raise ValueError("RolloutBatch.concat: reward functions differ: "
                             f"{[sorted(b.per_function) for b in batches]}")
        out = {}
        for f in fields(cls):
            values = [getattr(b, f.name) for b in batches]
            if any(v is None for v in values):  # an optional field missing from one batch: missing from all
                out[f.name] = None
            elif isinstance(values[0], torch.Tensor):
                out[f.name] = torch.cat(values)
            elif isinstance(values[0], dict):
                out[f.name] = {k: torch.cat([v[k] for v in values]) for k in values[0]}
            elif isinstance(values[0], list):
                out[f.name] = [x for v in values for x in v]
            else:
                out[f.name] = sum(values)
        return cls(**out)


@dataclass
class PackedMicroBatch:
    """One packed row plus the per-response bookkeeping the loss needs.

    input_ids, position_ids: [1, L] int64.
    logit_positions: [M] int64, packed positions whose logits predict each response token.
    targets: [M] int64, the response tokens.
    token_seq, token_pos: [M] int64, (sequence slot in 0..n−1, index in its response) of each response token.
    response_mask: [n, T] bool, True for response tokens that count in the loss, the KL and the entropy: the first
        ``valid_lengths`` tokens of each response and, of a multi-turn episode, only those the policy sampled (its
        observation tokens are False: ``train_workers.packing.pack_microbatch``'s ``loss_masks``).
    advantages: [n] float32.
    behaviour_logprobs: [n, T] float32, the engine's logprobs (0 under the mask's zeros).
    seq_indices: [n] int64, indices of the sequences in the step's rollout batch.
    group_ids: [n] int64, the group (prompt) of each sequence, −1 where the caller gave none. Group identity travels
        with each sequence, so a reordering by the scheduler cannot mix up groups; advantages are computed per group
        before packing and travel the same way.
    traced: [n] bool, the sequences whose per-token trainer logprobs come back in ``TrainResult.token_logprobs``
        (the step's samples, ``samples.jsonl``: ``cluster.loop.samples``); None: none.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    logit_positions: torch.Tensor
    targets: torch.Tensor
    token_seq: torch.Tensor
    token_pos: torch.Tensor
    response_mask: torch.Tensor
    advantages: torch.Tensor
    behaviour_logprobs: torch.Tensor
    seq_indices: torch.Tensor
    group_ids: torch.Tensor | None = None
    traced: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.group_ids is None:
            self.group_ids = torch.full((self.num_sequences,), -1, dtype=torch.long)

    @property
    def num_sequences(self) -> int:
        return int(self.response_mask.shape[0])

    @property
    def num_tokens(self) -> int:
        """Packed tokens L (what the forward pass computes)."""
        return int(self.input_ids.shape[1])

    def to_padded(self, values: torch.Tensor) -> torch.Tensor:
        """Scatter per-response-token ``values`` [M] into [n, T] (0 past each response's end); keeps autograd."""
        out = values.new_zeros(self.response_mask.shape)
        return out.index_put((self.token_seq, self.token_pos), values)
