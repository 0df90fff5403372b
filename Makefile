# Quick start (fresh machine with Python 3.11):
#   make demo   # set up .venv and run the CPU GSM8K demo (examples/gsm8k_smollm2_cpu.yaml)
#   make test   # set up .venv and run the test suite
.PHONY: setup demo test test-fast
setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/grpo-cluster run examples/gsm8k_smollm2_cpu.yaml

test: setup
	bash scripts/install_test_tools.sh
	.venv/bin/python -m pytest tests -q -rs --durations=15

# Every test that starts no vLLM engine (markers: tests/conftest.py).
test-fast: setup
	.venv/bin/python -m pytest tests -q -m "not engine"
