"""``bash scripts/gpu_check.sh --dry-run``: every section of the device check that can run on CPU runs and passes
(gloo instead of NCCL, the shared-memory transport instead of CUDA IPC, tiny models), the CUDA-only one is skipped
with its reason, and the run reports its total time (about 2 minutes on 2 idle cores; not asserted). Starts
gloo groups of two processes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: ``megatron`` runs where megatron-core is installed (CI: the test extra) and SKIPs otherwise.
HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None
CPU_SECTIONS = ["env", "fused_lm_head", "varlen_attention", "fsdp_step", "mixed_precision", "throughput",
                *(["megatron"] if HAVE_MEGATRON else []), "cuda_ipc", "fsdp_two_ranks", "async_overlap", "recipe_1gpu"]
ALL_SECTIONS = ["env", "fused_lm_head", "varlen_attention", "fsdp_step", "mixed_precision", "throughput", "megatron",
                "cuda_ipc", "fsdp_two_ranks", "async_overlap", "recipe_1gpu", "gpu_tests"]


def test_gpu_check_dry_run_passes_every_cpu_section(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_WHEELS": str(tmp_path / "no_wheels")}
    env.pop("OUT", None)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", "--json-out", str(out),
                           "--log-dir", str(tmp_path / "logs")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert list(sections) == ALL_SECTIONS
    assert {name: sections[name]["status"] for name in CPU_SECTIONS} == dict.fromkeys(CPU_SECTIONS, "PASS"), \
        {name: sections[name]["reason"] for name in CPU_SECTIONS}
    assert sections["gpu_tests"]["status"] == "SKIP", sections["gpu_tests"]
    assert "no tests/gpu test ran here" in sections["gpu_tests"]["reason"]
    assert " skipped" in sections["gpu_tests"]["numbers"]["pytest_summary"]
    # the numbers each section reports are there and within the stated tolerances
    mp = sections["mixed_precision"]["numbers"]
    assert mp["param_and_grad_dtypes"] == ["torch.float32"] and mp["update_kept"] >= 0.95
    assert mp["update_lost_if_params_were_bf16"] > 0.5  # the same update in pure bf16 would mostly round away
    assert sections["fsdp_two_ranks"]["numbers"]["backend"] == "gloo"
    assert sections["cuda_ipc"]["numbers"]["transport"] == "shm"
    assert sections["cuda_ipc"]["numbers"]["crc_checked_tensors"] == sections["cuda_ipc"]["numbers"]["tensors"]
    assert sections["throughput"]["numbers"]["attention=packed_varlen_sdpa"]["tokens_per_s"] > 0
    overlap = sections["async_overlap"]["numbers"]  # real generate + FSDP2 train through the rollout.mode schedules
    assert overlap["mode=one_step_off"]["staleness"] == [0, 1, 1] and overlap["weight_gap_after_sync"] == 0.0
    assert overlap["overlap_ratio"] > 0 and overlap["generate_plus_train_s"] >= overlap["max_generate_train_s"] > 0
    if HAVE_MEGATRON:  # bf16 Megatron vs bf16 FSDP2 on the same weights, first step, within the section's tolerances
        meg = sections["megatron"]["numbers"]
        assert meg["megatron_param_and_grad_dtypes"] == ["torch.float32"]
        assert meg["first_step"]["loss_rel"] <= 2e-2 and meg["megatron"]["tokens_per_s"] > 0
    else:
        assert sections["megatron"]["status"] == "SKIP" and "megatron-core" in sections["megatron"]["reason"]
    recipe = sections["recipe_1gpu"]["numbers"]  # the one-GPU recipe's trainer side at its schedule's rates
    assert recipe["activation_checkpointing"] and [s["lr"] for s in recipe["steps"]] == [
        s["schedule_lr"] for s in recipe["steps"]]
    assert report["total_s"] > 0  # its wall time is printed, not asserted: a busy machine must not fail this test
    counts = f"{len(CPU_SECTIONS)} PASS, 0 FAIL, {2 - HAVE_MEGATRON} SKIP"
    for line in ("[PASS] fsdp_step", "[SKIP] gpu_tests", counts):
        assert line in proc.stdout
