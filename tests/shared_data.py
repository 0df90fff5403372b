"""Where the data that lives beside the repository is found (GSM8K, the pinned KubeRay CRDs).

By default ``../shared/data`` beside the checkout: the layout of the project machines and of CI (``.ci/run``: a clean
clone of main with ``../shared`` beside it). A checkout elsewhere — a clone in a temporary folder, a read-only copy,
a worktree — names the folder in ``$GRPO_CLUSTER_SHARED_DATA`` instead, so its tests find the same data rather than
skipping (or, for the CRDs, failing). The tests' own spec's relative data paths (``tests/tiny_cpu.yaml``:
``../../shared/data/...``) still mean the folder beside the checkout.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["BESIDE", "SHARED_DATA", "SHARED_DATA_ENV", "where"]

SHARED_DATA_ENV = "GRPO_CLUSTER_SHARED_DATA"
#: ``../shared/data`` beside this checkout.
BESIDE = Path(__file__).resolve().parents[2] / "shared" / "data"
#: The shared data folder: ``$GRPO_CLUSTER_SHARED_DATA`` when set, else :data:`BESIDE`.
SHARED_DATA = Path(os.environ.get(SHARED_DATA_ENV) or BESIDE)


def where(part: str) -> str:
    """How a skip or failure message says where ``part`` (e.g. ``gsm8k``) was looked for."""
    return (f"{SHARED_DATA / part} (../shared/data/{part} beside the repository, or ${SHARED_DATA_ENV}/{part} for a "
            f"checkout elsewhere)")
