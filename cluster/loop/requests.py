"""The step's group requests: prompts drawn from the sampler, each with a group id and its own sampling seed
(:func:`request_seed`).

The queue owns the data position: the sampler's state plus the prompts drawn but not yet sampled (a checkpoint keeps
both, so a resumed job samples the same prompts in the same order).
"""

from __future__ import annotations

import zlib
from collections import deque

import torch

from cluster.data import Example, PromptSampler
from contract.messages import GroupRequest


def request_seed(seed: int, step: int, group_id: int) -> int:
    """The sampling seed of one group: a CRC-32 mix of (spec seed, step, group id), in [0, 2**31).

    Each group's completions then depend only on the policy weights, its prompt and this seed — not on the engine,
    the batch it shares, or what ran before — so re-sampled groups (engine replaced, job resumed) are identical."""
    return zlib.crc32(f"{seed}:{step}:{group_id}".encode()) & 0x7FFFFFFF


class PromptQueue:
    """Turns the sampler's prompts into :class:`GroupRequest` s, step by step.

    Args:
        sampler: the prompt sampler (epochs, shuffling).
        prompt_ids: example index → prompt token ids.
        seed: the spec's seed (mixed into every group's sampling seed).
    """

    def __init__(self, sampler: PromptSampler, prompt_ids: dict[int, list[int]], seed: int):
        self.sampler, self.prompt_ids, self.seed = sampler, prompt_ids, seed
        self.pending: deque[Example] = deque()  # prompts drawn from the sampler, not yet sampled
        self.step = 0
        self._group_counter = 0  # next group id within the step (unique across sampling rounds)
        self._step_prompts: dict[int, int] = {}  # group id -> example index, this step

    def begin_step(self, step: int) -> None:
        """Start step ``step``: group ids restart at 0."""
        self.step, self._group_counter, self._step_prompts = step, 0, {}

    def draw(self, num_prompts: int, group_size: int) -> tuple[list[Example], list[GroupRequest]]:
        """Draw ``num_prompts`` prompts; group ids continue the step's count so they stay unique across sampling
        rounds. Returns (the examples, one request of ``group_size`` completions each, in the same order)."""
        examples, requests = [], []
        while len(requests) < num_prompts:
            if not self.pending:
                self.pending.extend(self.sampler.next_batch())
            ex = self.pending.popleft()
            gid = self._group_counter
            requests.append(GroupRequest(group_id=gid, prompt_ids=self.prompt_ids[ex.index], group_size=group_size,
                                         seed=request_seed(self.seed, self.step, gid)))
            self._step_prompts[gid] = ex.index
            self._group_counter += 1
            examples.append(ex)
        return examples, requests

    def redraw(self, examples: list[Example], requests: list[GroupRequest]) -> None:
        """Register, in the step begun last, prompts drawn by an earlier call of the same step that was interrupted
        (partial rollouts: its round is carried over): their group ids keep their examples and later draws continue
        the count after them. Nothing is drawn from the sampler."""
        for ex, q in zip(examples, requests):
            self._step_prompts[q.group_id] = ex.index
            self._group_counter = max(self._group_counter, q.group_id + 1)

    def trained_prompts(self, group_ids: torch.Tensor) -> list[int]:
        """Example indices of the groups in ``group_ids`` ([N] int64, rows of one group adjacent), one per group,
        in first-seen order."""
        seen, prompts = set(), []
        for gid in group_ids.tolist():
            if gid not in seen:
                seen.add(gid)
                prompts.append(self._step_prompts[gid])
        return prompts

    def state_dict(self) -> dict:
        """``{"sampler": the sampler's state, "pending_prompts": example indices drawn but not yet sampled}``."""
        return {"sampler": self.sampler.state_dict(), "pending_prompts": [ex.index for ex in self.pending]}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (``pending_prompts`` may be absent: none pending).

        Raises:
            KeyError: a pending index names no example of this data; the sampler's own errors for its state.
        """
        self.sampler.load_state_dict(state["sampler"])
        by_index = {ex.index: ex for ex in self.sampler.examples}
        self.pending = deque(by_index[i] for i in state.get("pending_prompts", []))
