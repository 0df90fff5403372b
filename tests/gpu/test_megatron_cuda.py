"""The Megatron worker on one CUDA GPU (NCCL, fp32, tp=1, no CPU shims): one GRPO step equals the FSDP2 worker's on
the same GPU and batch (tests/distributed/test_megatron_step.py's models and batch). Skipped without CUDA (conftest).

NOT RUN YET (written 2026-12-02; this session had no GPU). Tolerance 1e-4 relative on the metrics (GPU reductions
differ in order from CPU ones).
"""

from __future__ import annotations

import pytest

from tests.distributed.test_megatron_step import METRICS, ONE_RANK, _models, _spawn

pytestmark = pytest.mark.gpu
pytest.importorskip("megatron.core")


def test_megatron_step_on_cuda_matches_fsdp(tmp_path):
    dirs = _models(tmp_path)
    out = _spawn(1, dirs, [{"name": "fsdp_gpu", "backend": "fsdp", "microbatches": ONE_RANK, "gpu": True},
                           {"name": "megatron_gpu", "backend": "megatron", "microbatches": ONE_RANK, "gpu": True}],
                 tmp_path)
    ref, got = out["fsdp_gpu"]["result"], out["megatron_gpu"]["result"]
    assert got["policy_version"] == 1 and not got["skipped"]
    for key in METRICS:
        r, m = ref["metrics"][key], got["metrics"][key]
        assert abs(m - r) <= 1e-4 * max(1.0, abs(r)), (key, m, r)
