"""sandbox.runner: the escape table (each attempt contained, reported as the program's failure, the host
unharmed), the limits, the statuses, infrastructure failures, concurrency and the weaker rlimits mode.

Needs bwrap (Debian package ``bubblewrap``; ``scripts/install_test_tools.sh`` installs it): without it the bwrap tests
skip. Where bwrap is installed but cannot build a sandbox, they fail (``check_sandbox``'s reason). ~20 s here.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from sandbox import Program, SandboxConfig, check_sandbox, run_program, run_programs
from sandbox.launch import resolve_interpreter

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap is not installed (Debian package "
                                 "bubblewrap; scripts/install_test_tools.sh installs it)")
ROOT = os.geteuid() == 0
#: A uid range of these tests' own (privileged path), so a bench running beside them never shares a uid.
UID_BASE = 61000
FAST = SandboxConfig(cpu_time_s=2, wall_time_s=5, uid_base=UID_BASE, uid_count=64)


def _live_processes(uids: range) -> list[str]:
    """Host processes (not zombies) owned by a uid of ``uids``: "pid state cmdline"."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid not in uids:
                continue
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state not in ("Z", "X"):
            found.append(f"{name} {state} {cmdline[:100]}")
    return found


def _processes_with(marker: str) -> list[str]:
    """Host processes (not zombies) whose command line contains ``marker``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state not in ("Z", "X"):
            found.append(f"{name} {state} {cmdline[:100]}")
    return found


@pytest.fixture(scope="module")
def sandbox_ok():
    """The bwrap sandbox runs here (else fail with check_sandbox's reason: bwrap is installed but refused)."""
    reason = check_sandbox(FAST)
    assert reason is None, reason


def _run(source: str, config: SandboxConfig = FAST, stdin: str | None = None):
    result = run_program(source, stdin=stdin, config=config)
    assert result.status != "infra_error", result.detail
    return result


def _assert_host_clean():
    """Nothing of a sandbox outlives its call (privileged path: no live process of the tests' uids)."""
    if ROOT:
        assert _live_processes(range(UID_BASE, UID_BASE + 64)) == []


# ---------------------------------------------------------------- the escape table

@needs_bwrap
def test_sandbox_socket_to_host_loopback_refused(sandbox_ok):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        result = _run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('in')")
        assert result.status == "failed" and "ConnectionRefusedError" in result.stderr
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody came


@needs_bwrap
def test_sandbox_socket_to_outside_unreachable(sandbox_ok):
    result = _run("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)")
    assert result.status == "failed" and "Network is unreachable" in result.stderr
    result = _run("import socket\nsocket.getaddrinfo('example.com', 80)")
    assert result.status == "failed" and "gaierror" in result.stderr


@needs_bwrap
def test_sandbox_host_file_invisible(sandbox_ok, tmp_path):
    secrets = [tmp_path / "secret.txt"]
    home_secret = Path.home() / f".grpo_sandbox_test_{os.getpid()}"
    try:
        home_secret.write_text("host secret")
        secrets.append(home_secret)
    except OSError:
        pass
    secrets[0].write_text("host secret")
    try:
        for path in secrets:
            result = _run(f"print(open({str(path)!r}).read())")
            assert result.status == "failed" and "FileNotFoundError" in result.stderr, path
            assert "host secret" not in result.stdout
    finally:
        home_secret.unlink(missing_ok=True)


@needs_bwrap
def test_sandbox_etc_shadow_unreadable(sandbox_ok):
    result = _run("print(open('/etc/shadow').read())")
    assert result.status == "failed"
    assert "FileNotFoundError" in result.stderr or "PermissionError" in result.stderr


@needs_bwrap
def test_sandbox_environment_not_inherited(sandbox_ok, monkeypatch):
    monkeypatch.setenv("GRPO_SANDBOX_FAKE_TOKEN", "hf_fake_secret_123")
    source = ("import os, glob\n"
              "blobs = [open(p, 'rb').read() for p in glob.glob('/proc/[0-9]*/environ') if os.access(p, os.R_OK)]\n"
              "assert os.environ.get('GRPO_SANDBOX_FAKE_TOKEN') or any(b'hf_fake' in b for b in blobs)\n")
    result = _run(source)
    assert result.status == "failed" and "AssertionError" in result.stderr
    env = _run("import os\nprint(sorted(os.environ))").stdout
    assert env.strip() == str(sorted(["HOME", "LANG", "PATH", "PWD", "TMPDIR"]))


@needs_bwrap
def test_sandbox_write_outside_work_folder(sandbox_ok, tmp_path):
    target = tmp_path / "escaped.txt"
    result = _run(f"open({str(target)!r}, 'w').write('x')")
    assert result.status == "failed" and not target.exists()
    for path in ("/usr/escaped.txt", "/escaped.txt", "/sandbox/main.py"):
        result = _run(f"open({path!r}, 'w').write('x')")
        assert result.status == "failed", path
    assert _run("open('/tmp/ok.txt', 'w').write('x')\nprint(open('/tmp/ok.txt').read())").stdout == "x\n"


@needs_bwrap
def test_sandbox_fork_bomb_contained(sandbox_ok):
    config = SandboxConfig(cpu_time_s=2, wall_time_s=2, max_processes=16, uid_base=UID_BASE, uid_count=64)
    source = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = _run(source, config)
    assert result.status in ("timeout", "cpu_limit")
    _assert_host_clean()
    assert subprocess.run(["true"]).returncode == 0  # the host can still fork
    counted = _run("import os\nn = 0\ntry:\n    while n < 100:\n        if os.fork() == 0:\n            import time\n"
                   "            time.sleep(5)\n        n += 1\nexcept OSError:\n    print(n)\n", config)
    # RLIMIT_NPROC applies to the program: 15 children besides itself at most
    assert counted.status == "passed" and 0 < int(counted.stdout) < 16, counted.stderr


@needs_bwrap
def test_sandbox_memory_10gib(sandbox_ok):
    result = _run("x = bytearray(10 * 2**30)")
    assert result.status == "memory" and result.exit_code == 1


@needs_bwrap
def test_sandbox_cpu_loop_forever(sandbox_ok):
    result = _run("while True:\n    pass\n", SandboxConfig(cpu_time_s=1, wall_time_s=10, uid_base=UID_BASE))
    assert result.status == "cpu_limit" and result.exit_code == 128 + signal.SIGXCPU
    assert result.seconds < 5


@needs_bwrap
def test_sandbox_sleep_forever(sandbox_ok):
    result = _run("import time\ntime.sleep(10**6)\n", SandboxConfig(wall_time_s=1, uid_base=UID_BASE))
    assert result.status == "timeout" and result.exit_code is None
    assert 1 <= result.seconds < 3
    _assert_host_clean()


@needs_bwrap
def test_sandbox_print_1gb(sandbox_ok):
    start = time.monotonic()
    result = _run("import sys\nchunk = 'x' * 2**20\nfor _ in range(1024):\n    sys.stdout.write(chunk)\n")
    assert result.status == "output_limit"
    assert len(result.stdout) + len(result.stderr) == FAST.max_output_bytes
    assert time.monotonic() - start < 5


@needs_bwrap
def test_sandbox_kill_parent(sandbox_ok):
    source = "import os, signal, time\nos.kill(os.getppid(), signal.SIGKILL)\ntime.sleep(0.2)\nprint('alive')\n"
    result = _run(source)
    # As root the parent (bwrap's init, root-owned) refuses the signal; unprivileged, a PID namespace's init ignores
    # SIGKILL from inside its namespace and the program goes on.
    if ROOT:
        assert result.status == "failed" and "PermissionError" in result.stderr
    else:
        assert result.status == "passed" and result.stdout == "alive\n"


@needs_bwrap
def test_sandbox_kill_host_test_process(sandbox_ok):
    result = _run(f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)\n")
    assert result.status == "failed" and "ProcessLookupError" in result.stderr  # another PID namespace
    result = _run("import os, signal\nfor pid in range(2, 4096):\n    try:\n        os.kill(pid, signal.SIGKILL)\n"
                  "    except OSError:\n        pass\n")
    assert result.status in ("passed", "failed")  # it may kill itself; we are still here


_DAEMON = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sleep", ["sleep", "MARKER"])
    os._exit(0)
os.wait()
for _ in range(200):
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    if any(b"MARKER" in open(f"/proc/{p}/cmdline", "rb").read() for p in pids):
        break
    time.sleep(0.01)
else:
    raise SystemExit("the daemon did not start")
print("daemon started")
"""


@needs_bwrap
def test_sandbox_daemon_does_not_survive(sandbox_ok):
    marker = f"{3000 + os.getpid() % 1000}.{time.monotonic_ns() % 10**6}"  # a unique `sleep` argument
    result = _run(_DAEMON.replace("MARKER", marker))
    assert result.status == "passed" and result.stdout == "daemon started\n", result.stderr
    assert _processes_with(marker) == []
    _assert_host_clean()


@needs_bwrap
def test_sandbox_nested_user_namespace_refused(sandbox_ok):
    result = _run("import subprocess\nassert subprocess.run(['unshare', '--user', 'true']).returncode == 0\n")
    assert result.status == "failed"


@needs_bwrap
def test_sandbox_tmpfs_and_file_size_capped(sandbox_ok):
    config = SandboxConfig(tmpfs_mib=4, max_file_mib=2, uid_base=UID_BASE)
    many = _run("for i in range(8):\n    open(f'/tmp/f{i}', 'wb').write(b'x' * 2**20)\n", config)
    assert many.status == "failed" and "No space left on device" in many.stderr
    big = _run("open('/tmp/big', 'wb').write(b'x' * 3 * 2**20)\n", config)
    assert big.status == "failed" and "File too large" in big.stderr


# ---------------------------------------------------------------- ordinary programs, statuses, infrastructure

@needs_bwrap
def test_sandbox_passing_program_sees_its_interpreter(sandbox_ok):
    result = _run("import sys\nprint(sys.version.split()[0], __name__, __file__)\nexit(0)\n")
    assert result.status == "passed" and result.exit_code == 0
    assert result.stdout.split() == [resolve_interpreter("").version, "__main__", "/sandbox/main.py"]


@needs_bwrap
def test_sandbox_failing_assert_and_exit_codes(sandbox_ok):
    failed = _run("assert 1 + 1 == 3, 'arithmetic'")
    assert failed.status == "failed" and failed.exit_code == 1 and "AssertionError: arithmetic" in failed.stderr
    assert _run("import sys\nsys.exit(7)").exit_code == 7
    assert _run("def f(:\n").status == "failed"  # a syntax error is the program's


@needs_bwrap
def test_sandbox_stdin(sandbox_ok):
    result = _run("import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", stdin="1 2\n3\n")
    assert (result.status, result.stdout) == ("passed", "6\n")
    big = _run("import sys\nprint(len(sys.stdin.read()))", stdin="y" * 3_000_000)
    assert big.stdout == "3000000\n"
    assert _run("print(input())").status == "failed"  # no stdin: EOFError


def test_sandbox_missing_bwrap_is_infra_error(tmp_path):
    config = SandboxConfig(bwrap_path=str(tmp_path / "no-bwrap"), uid_base=UID_BASE)
    result = run_program("print(1)", config=config)
    assert result.status == "infra_error" and result.infra_error and result.exit_code is None
    assert "no-bwrap" in result.detail
    reason = check_sandbox(config, field_prefix="reward.sandbox")
    assert reason is not None and "reward.sandbox.bwrap_path" in reason


def test_sandbox_refused_start_is_infra_error(tmp_path):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: Creating new namespace failed: Operation not permitted' >&2\nexit 1\n")
    fake.chmod(0o755)
    result = run_program("print(1)", config=SandboxConfig(bwrap_path=str(fake), uid_base=UID_BASE))
    assert result.status == "infra_error" and "Operation not permitted" in result.detail
    assert "did not start the program" in result.detail


def test_sandbox_config_checks_fields():
    with pytest.raises(ValueError, match="SandboxConfig.mode"):
        SandboxConfig(mode="docker")
    with pytest.raises(ValueError, match="SandboxConfig.memory_mib must be an int >= 64, got 8"):
        SandboxConfig(memory_mib=8)
    with pytest.raises(ValueError, match="wall_time_s"):
        SandboxConfig(wall_time_s=0)
    with pytest.raises(ValueError, match="65534"):
        SandboxConfig(uid_base=65000, uid_count=1000)


@needs_bwrap
def test_sandbox_many_programs_in_parallel(sandbox_ok):
    programs = [Program(f"print({i} * {i})") for i in range(12)] + [Program("print(input())", stdin="s")]
    config = SandboxConfig(parallel=4, uid_base=UID_BASE, uid_count=64)
    results = run_programs(programs, config)
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(12)] + ["s\n"]
    assert all(r.status == "passed" for r in results)
    assert run_programs([], config) == []
    lengths = run_programs(programs, config, map_result=lambda index, result: (index, len(result.stdout)))
    assert lengths == [(i, len(f"{i * i}\n")) for i in range(12)] + [(12, 2)]


# ---------------------------------------------------------------- the weaker rlimits mode, the unprivileged path

def _rlimits_config() -> SandboxConfig:
    """rlimits mode with an interpreter the per-slot uid can run (a root-only pyenv cannot be: skip then). The wall
    limit is 6 CPU limits, so a CPU-bound loop reaches its CPU limit first even with a sixth of a core (a loaded
    2-core CI machine: 2 s of CPU against 3 s of wall ended as a timeout there)."""
    for python in ("", "/usr/bin/python3"):
        config = SandboxConfig(mode="rlimits", python=python, cpu_time_s=1, wall_time_s=6, uid_base=UID_BASE,
                               uid_count=64)
        if os.path.exists(python or sys.executable) and check_sandbox(config) is None:
            return config
    pytest.skip("no interpreter that rlimits mode's uid can run (e.g. Python under a 0700 /root)")


def test_sandbox_rlimits_mode_limits_and_env(monkeypatch):
    config = _rlimits_config()
    monkeypatch.setenv("GRPO_SANDBOX_FAKE_TOKEN", "x")
    assert _run("import os\nassert 'GRPO_SANDBOX_FAKE_TOKEN' not in os.environ\nprint(os.getcwd())",
                config).status == "passed"
    assert _run("x = bytearray(10 * 2**30)", config).status == "memory"
    assert _run("while True:\n    pass\n", config).status == "cpu_limit"
    if ROOT:
        bomb = _run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", config)
        assert bomb.status in ("timeout", "cpu_limit")
        _assert_host_clean()
        assert _run("import os\nos.fork() or print('forked')", config).status == "passed"  # zombies skipped


#: The top-level packages :data:`_UNPRIVILEGED` imports from (by path, without their dependencies).
_HARNESS_PACKAGES = ("sandbox",)
_UNPRIVILEGED = """
import sys
sys.path.insert(0, sys.argv[1])  # a copy of the sandbox package, which imports only the standard library
from sandbox import SandboxConfig, check_sandbox, run_program
config = SandboxConfig(cpu_time_s=2, wall_time_s=2)
assert check_sandbox(config) is None, check_sandbox(config)
print(run_program("import os; print(os.getuid())", config=config).stdout.strip())
print(run_program("import subprocess; assert subprocess.run(['unshare', '--user', 'true']).returncode == 0",
                  config=config).status)
print(run_program("import os\\nwhile True:\\n    try: os.fork()\\n    except OSError: pass", config=config).status)
"""


def _as_uid(uid: int, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``/usr/bin/python3 ARGS`` run as ``uid`` (no groups), in ``/``, with a bare environment."""
    return subprocess.run(["/usr/bin/setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
                           "/usr/bin/python3", *args], capture_output=True, text=True, timeout=timeout, cwd="/",
                          env={"PATH": "/usr/bin:/bin"})


@contextmanager
def _readable_by(uid: int):
    """A copy of :data:`_HARNESS_PACKAGES`' sources that ``uid`` can read, wherever the checkout lives (a clone in
    a 0700 ``mktemp -d`` folder, under a 0700 home, ...): a fresh folder (0755, files 0644) under the first of
    ``$TMPDIR``, /tmp, /var/tmp, /dev/shm whose every parent folder lets other users in. Yields its path; skips the
    test, saying why, when ``uid`` still cannot read it."""
    repo = Path(__file__).resolve().parents[2]
    bases = [Path(p) for p in (os.environ.get("TMPDIR"), "/tmp", "/var/tmp", "/dev/shm") if p]
    base = next((b for b in bases if b.is_dir() and all(p.stat().st_mode & 0o001 for p in (b, *b.parents))), None)
    if base is None:
        pytest.skip(f"no folder uid {uid} can enter among {[str(b) for b in bases]} to copy the harness's modules to")
    copy = Path(tempfile.mkdtemp(prefix="sandbox-harness-", dir=base))
    try:
        for package in _HARNESS_PACKAGES:
            shutil.copytree(repo / package, copy / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        for folder, _, files in os.walk(copy):
            os.chmod(folder, 0o755)
            for name in files:
                os.chmod(os.path.join(folder, name), 0o644)
        probe = _as_uid(uid, "-c", "import sys; open(sys.argv[1]).close()", str(copy / _HARNESS_PACKAGES[0] /
                                                                                "__init__.py"))
        if probe.returncode != 0:
            pytest.skip(f"uid {uid} cannot read the harness's modules copied to {copy}: {probe.stderr.strip()[-200:]}")
        yield copy
    finally:
        shutil.rmtree(copy, ignore_errors=True)


@needs_bwrap
@pytest.mark.skipif(not ROOT or not os.access("/usr/bin/python3", os.X_OK) or not os.access("/usr/bin/setpriv",
                    os.X_OK), reason="runs the harness under another uid: needs root, /usr/bin/python3, setpriv")
def test_sandbox_unprivileged_harness():
    """The path of a harness that is not root: bwrap makes a user namespace, the program keeps the caller's uid. The
    harness imports the sandbox modules from a copy its uid can read (:func:`_readable_by`), not from the checkout,
    which another user may not be able to enter."""
    uid = UID_BASE + 63
    with _readable_by(uid) as modules:
        done = _as_uid(uid, "-c", _UNPRIVILEGED, str(modules))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(uid), "failed", "timeout"]
    assert _live_processes(range(uid, uid + 1)) == []
