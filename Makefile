# Quick start (fresh machine with Python 3.11):
#   make demo   # set up .venv and run the CPU demo (examples/demo_cpu.yaml: held-out accuracy rises, ~15-20 min)
#   make test   # set up .venv and run the test suite
.PHONY: setup demo test test-fast
setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/grpo-cluster run examples/demo_cpu.yaml

test: setup
	bash scripts/install_test_tools.sh
	.venv/bin/python -m pytest tests -q -rs --durations=15

test-fast: setup
	.venv/bin/python -m pytest tests -q -m "not slow"
