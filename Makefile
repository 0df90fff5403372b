# Quick start (fresh machine with Python 3.11):
#   make demo   # set up .venv and run the CPU demo (examples/demo_cpu.yaml: held-out accuracy rises, ~15-20 min)
#   make test   # set up .venv and run the test suite
.PHONY: setup demo test test-fast
setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/grpo-cluster run examples/demo_cpu.yaml

# Two pytest runs, both always: the tiers without Ray or vLLM on two workers (pytest-xdist), then Ray and the vLLM
# engine one test at a time with every other tier (a new tier lands there); the tier guard checks each run's tiers.
# The JUnit reports go to TEST_RESULTS (`make test TEST_RESULTS=/tmp/results` keeps them out of the checkout).
PARALLEL_TIERS = tests/unit tests/distributed tests/in_process
TEST_RESULTS ?= test-results
test: setup
	bash scripts/install_test_tools.sh
	status=0; \
	.venv/bin/python -m pytest $(PARALLEL_TIERS) -q -rs --durations=15 -n 2 \
		--junitxml="$(TEST_RESULTS)/parallel.xml" || status=$$?; \
	.venv/bin/python -m pytest tests -q -rs --durations=15 $(addprefix --ignore=,$(PARALLEL_TIERS)) \
		--junitxml="$(TEST_RESULTS)/serial.xml" || status=$$?; \
	exit $$status

# Every test that starts no vLLM engine (markers: tests/conftest.py).
test-fast: setup
	.venv/bin/python -m pytest tests -q -m "not engine"
