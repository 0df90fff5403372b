"""Sandboxed programs per second (``sandbox.runner``) on this machine, and what limits it.

    flock /tmp/grpo-heavy.lock env PYTHONPATH=$PWD python -m bench.bench_sandbox [--n 200] [--parallel 1 2 4 8]
        [--mode bwrap|rlimits] [--python PATH]

Parts:

1. Start-up costs, one process after another (``--n`` each): the bare interpreter (``python -I -S -c pass``, what the
   sandbox runs; and ``python -I -c pass``, with ``site``), bwrap alone (the sandbox's own command line around
   ``/bin/true``), and one whole sandboxed ``print(1)`` through :func:`run_program`.
2. Throughput: ``--n`` trivial programs (``print(1)``) through :func:`run_programs` at each ``--parallel``:
   programs/s, each program's latency (``SandboxResult.seconds``: p50, p95) and the 1-minute load average before and
   after (other processes on the machine slow every number here).
3. The ``code`` rewards on ``--n`` trivial completions (``def f(x): return x``), one test each, in each test style
   (a call case, a stdin/stdout case, test code with ``code_asserts``), ``parallel`` = the CPU count: completions/s,
   what the test harness and the judge add to a bare program.

The last line is the machine-readable JSON result.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

from bench._common import load_note, print_json, print_table
from sandbox import Program, SandboxConfig, run_program, run_programs
from sandbox.code_reward import code_asserts_reward, code_reward
from sandbox.launch import bwrap_argv, resolve_interpreter, sandbox_env


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _time_commands(make_argv, n: int, pass_fds=()) -> float:
    """Mean wall milliseconds of ``n`` runs of ``make_argv()`` one after another (each must exit 0)."""
    start = time.perf_counter()
    for _ in range(n):
        subprocess.run(make_argv(), check=True, env=sandbox_env(), pass_fds=pass_fds, stdout=subprocess.DEVNULL)
    return (time.perf_counter() - start) / n * 1000


def _bwrap_alone_ms(config: SandboxConfig, n: int) -> float:
    """bwrap with the sandbox's own mounts, namespaces and (as root) uid switch around /bin/true: no interpreter."""
    interpreter = resolve_interpreter(config.python)
    privileged = os.geteuid() == 0
    program_fd = os.memfd_create("bench-program")
    info_r, info_w = os.pipe()
    os.set_blocking(info_r, False)
    try:
        def argv() -> list[str]:
            try:
                os.read(info_r, 1 << 16)  # drain the previous run's info, or bwrap blocks once the pipe is full
            except BlockingIOError:
                pass
            return bwrap_argv(config.bwrap_path, interpreter, privileged=privileged,
                              uid=config.uid_base + config.uid_count - 1, tmpfs_bytes=config.tmpfs_mib << 20,
                              program_fd=program_fd, info_fd=info_w, seccomp_fd=None, command=["/bin/true"])

        ms = _time_commands(argv, n, pass_fds=(program_fd, info_w))
    finally:
        for fd in (program_fd, info_r, info_w):
            os.close(fd)
    return ms


def startup_costs(config: SandboxConfig, n: int) -> dict[str, float]:
    """Part 1: milliseconds per start, one after another."""
    python = resolve_interpreter(config.python).executable
    costs = {
        "python -I -S -c pass": _time_commands(lambda: [python, "-I", "-S", "-c", "pass"], n),
        "python -I -c pass (site)": _time_commands(lambda: [python, "-I", "-c", "pass"], n),
    }
    if config.mode == "bwrap":
        costs["bwrap (+ setpriv as root) + /bin/true"] = _bwrap_alone_ms(config, n)
    start = time.perf_counter()
    for _ in range(n):
        result = run_program("print(1)", config=config)
        assert result.passed, result
    costs[f"run_program print(1) ({config.mode})"] = (time.perf_counter() - start) / n * 1000
    return costs


def throughput(config: SandboxConfig, n: int, parallel: int) -> dict[str, float]:
    """Part 2: ``n`` print(1) programs at ``parallel``."""
    config = SandboxConfig(**{**config.__dict__, "parallel": parallel})
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    results = run_programs([Program("print(1)")] * n, config)
    elapsed = time.perf_counter() - start
    bad = [r for r in results if not r.passed]
    assert not bad, bad[0]
    latencies = [r.seconds * 1000 for r in results]
    return {"parallel": parallel, "programs_per_s": n / elapsed, "p50_ms": statistics.median(latencies),
            "p95_ms": _quantile(latencies, 0.95), "load_before": load_before, "load_after": os.getloadavg()[0]}


def reward_throughput(config: SandboxConfig, n: int) -> list[dict]:
    """Part 3: ``n`` one-test completions per test style through the reward, at the CPU count."""
    completion = "```python\nimport sys\ndef f(x):\n    return x\nprint(sys.stdin.read().strip())\n```"
    styles = {
        "call case (code)": (code_reward, [{"args": [1], "expected": 1}], "f"),
        "stdin/stdout case (code)": (code_reward, [{"input": "1\n", "output": "1\n"}], None),
        "test code (code_asserts)": (code_asserts_reward, "assert f(1) == 1\n", "f"),
    }
    rows = []
    for style, (reward, tests, entry_point) in styles.items():
        start = time.perf_counter()
        scores = reward([completion] * n, [tests] * n, entry_point=[entry_point] * n, sandbox=config)
        elapsed = time.perf_counter() - start
        assert scores == [1.0] * n, (style, scores[:5])
        rows.append({"style": style, "parallel": config.parallel, "completions_per_s": n / elapsed})
    return rows


def main() -> None:
    """Run both parts and print them (see the module doc)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=200, help="programs per measurement")
    parser.add_argument("--parallel", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--mode", choices=["bwrap", "rlimits"], default="bwrap")
    parser.add_argument("--python", default="", help="interpreter for the programs (default: this one's base)")
    args = parser.parse_args()
    config = SandboxConfig(mode=args.mode, python=args.python)
    note = load_note()
    costs = startup_costs(config, max(args.n // 4, 10))
    print_table(["start-up", "ms"], [[k, v] for k, v in costs.items()], title=f"Start-up costs ({note})")
    print()
    rows = [throughput(config, args.n, p) for p in args.parallel]
    print_table(list(rows[0]), [list(r.values()) for r in rows],
                title=f"Throughput: {args.n} x print(1), mode {args.mode}, {time.strftime('%Y-%m-%d')}")
    print()
    rewards = reward_throughput(config, args.n)
    print_table(list(rewards[0]), [list(r.values()) for r in rewards],
                title=f"The code rewards: {args.n} one-test completions per style, mode {args.mode}")
    print_json("sandbox", {**note, "mode": args.mode, "n": args.n, "startup_ms": costs, "throughput": rows,
                           "rewards": rewards})


if __name__ == "__main__":
    main()
