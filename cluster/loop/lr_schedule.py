"""The learning-rate schedule (``train.lr_schedule``, ``warmup_steps`` / ``warmup_ratio``, ``min_lr_ratio``): a pure
function of the training step.

The loop sets each step's rate on the trainer before the step trains (``Trainer.set_lr``), so the schedule has no state
of its own: a run resumed after step N trains step N + 1 at exactly the rate an uninterrupted run would, because the
step is part of the checkpoint (``trainer_state.json``) and the rate is recomputed from it. (Schedulers that keep a
counter beside the optimizer are the usual source of the resume bugs reported for other trainers: a counter stepped
twice on resume, or not saved at all.) The optimizer's own step count (AdamW's bias correction) is its state, saved
and restored with the checkpoint's optimizer files.

Definition, for step s = 1 .. T (``total_steps``), base rate η (``train.lr``), W warmup steps, floor m
(``min_lr_ratio``):

- warmup, s <= W: η · s / W (step 1 trains at η / W, step W at η; never at 0);
- after it, with progress p = (s − W − 1) / (T − W) in [0, 1): ``constant`` η; ``linear`` η · (1 − (1 − m) · p);
  ``cosine`` η · (m + (1 − m) · (1 + cos(π p)) / 2) (Loshchilov & Hutter, SGDR, arXiv:1608.03983, without restarts).
  Step W + 1 trains at η; the floor η · m would be reached at step T + 1.

W is ``warmup_steps``, or ``round(warmup_ratio · T)`` when ``warmup_ratio`` is set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LRSchedule"]


@dataclass(frozen=True)
class LRSchedule:
    """The schedule of one job (module docstring).

    Attributes:
        base_lr: η, ``train.lr``. kind: ``constant``, ``linear`` or ``cosine``. warmup_steps: W (resolved from
        ``warmup_ratio`` when that is set). total_steps: T. min_lr_ratio: m.
    """

    base_lr: float
    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1
    min_lr_ratio: float = 0.0

    @classmethod
    def from_spec(cls, train, total_steps: int) -> LRSchedule:
        """The schedule of a spec's ``train`` section and ``total_steps``."""
        warmup = train.warmup_steps if train.warmup_ratio is None else round(train.warmup_ratio * total_steps)
        return cls(base_lr=train.lr, kind=train.lr_schedule, warmup_steps=int(warmup), total_steps=total_steps,
                   min_lr_ratio=train.min_lr_ratio)

    @property
    def varies(self) -> bool:
        """Whether the rate changes over the run (a warmup, or a decaying kind); a constant one is the optimizer's
        own ``train.lr`` and needs no call to the trainer."""
        return self.warmup_steps > 0 or self.kind != "constant"

    def lr(self, step: int) -> float:
        """The learning rate step ``step`` (1-based) trains at.

        Raises:
            ValueError: ``step`` < 1.
        """
        if step < 1:
            raise ValueError(f"steps are counted from 1, got step {step}")
        w, m = self.warmup_steps, self.min_lr_ratio
        if step <= w:
            return self.base_lr * step / w
        if self.kind == "constant":
            return self.base_lr
        progress = min((step - w - 1) / max(self.total_steps - w, 1), 1.0)
        if self.kind == "linear":
            return self.base_lr * (1.0 - (1.0 - m) * progress)
        if self.kind == "cosine":
            return self.base_lr * (m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * progress)))
        raise ValueError(f"train.lr_schedule: expected 'constant', 'linear' or 'cosine', got {self.kind!r}")
