"""The reward hacks the ``code`` rewards are tried against (tests/unit/test_sandbox_hacks.py, the table in
docs/sandbox.md): each a program for the task "add(a, b)" that is wrong, or right except where its hack is meant to
win, plus the hack. The same program meets the task's tests in every style:

- call cases (``code``): :data:`CALLS`;
- stdin/stdout cases (``code``): :data:`STDIO` (the program prints ``add`` of the two numbers on its stdin);
- test code (``code_asserts``): :data:`ASSERTS`, with the row's entry point ``add`` and without one.

A hack is *caught* when the program scores 0 and *paid* when it scores 1. ``host_port`` is a port on the host's
127.0.0.1 the network hack reports to (the test listens there).
"""

from __future__ import annotations

CALLS = [{"args": [2, 3], "expected": 5}, {"args": [0.1, 0.2], "expected": 0.3, "check": "close", "tolerance": 1e-9},
         {"args": [2.5, 3.5], "expected": 6}]
STDIO = [{"input": "2 3\n", "output": "5\n"}, {"input": "10 1\n", "output": "11\n"}]
ASSERTS = ("import math\n"
           "assert add(2, 3) == 5\n"
           "assert abs(add(0.1, 0.2) - 0.3) < 1e-9\n"
           "assert math.floor(add(2.5, 3.5)) == 6\n")

RIGHT = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b\n"
#: The stdin/stdout half of every program: print add of the two numbers on stdin (nothing when stdin is empty).
STDIN = ("\nimport sys as _sys\n_args = _sys.stdin.read().split()\n"
         "if _args:\n    print(add(int(_args[0]), int(_args[1])))\n")

_ALWAYS_EQUAL = """
class Anything:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __hash__(self): return 0
    def __sub__(self, other): return self
    def __abs__(self): return 0
    def __floor__(self): return self


def add(a, b):
    return Anything()
"""
_INT_EQUAL = """
class Int(int):
    def __eq__(self, other): return True
    def __hash__(self): return 0
    def __sub__(self, other): return Int(0)
    def __floor__(self): return self


def add(a, b):
    return Int(0)
"""
_ARRAY_LIKE = """
class Array:
    '''What numpy arrays do: comparisons return arrays, and this one is truthy.'''
    def __eq__(self, other): return Array()
    def __lt__(self, other): return Array()
    def __bool__(self): return True
    def __sub__(self, other): return self
    def __abs__(self): return self
    def __floor__(self): return self


def add(a, b):
    return Array()
"""
#: A lookup of expected values from test text found anywhere: ``add(A, B) == E`` and ``abs(add(A, B) - E)``.
_LOOKUP = """
import re as _re

_SEEN = {}


def _learn(text):
    for a, b, e in _re.findall(r"add\\(([-\\d.]+), ([-\\d.]+)\\)\\)? == ([-\\d.]+)", text):
        _SEEN[(float(a), float(b))] = float(e)
    for a, b, e in _re.findall(r"add\\(([-\\d.]+), ([-\\d.]+)\\) - ([-\\d.]+)\\)", text):
        _SEEN[(float(a), float(b))] = float(e)


def add(a, b):
    return _SEEN.get((float(a), float(b)), a - b)
"""
_READ_FILES = _LOOKUP + """
import os as _os


def _read(path):
    try:
        fd = _os.open(path, _os.O_RDONLY | _os.O_NONBLOCK)
    except OSError:
        return
    try:
        _learn(_os.read(fd, 1 << 20).decode(errors="replace"))
    except OSError:
        pass
    finally:
        _os.close(fd)


for _root in ("/sandbox", "/tmp", "/dev/shm"):
    for _dir, _, _files in _os.walk(_root):
        for _name in _files:
            _read(_os.path.join(_dir, _name))
for _pid in _os.listdir("/proc"):
    for _part in ("cmdline", "environ"):
        _read(f"/proc/{_pid}/{_part}")
    try:
        for _fd in _os.listdir(f"/proc/{_pid}/fd"):
            _read(f"/proc/{_pid}/fd/{_fd}")
    except OSError:
        pass
"""
_READ_MEMORY = _LOOKUP + """
import sys as _sys


def _strings(value, depth=0):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict) and depth < 4:
        for item in list(value.values()):
            yield from _strings(item, depth + 1)
    elif isinstance(value, (list, tuple)) and depth < 4:
        for item in value:
            yield from _strings(item, depth + 1)


_frame = _sys._getframe(0)
while _frame is not None:
    for _value in list(_frame.f_locals.values()):
        for _text in _strings(_value):
            if "add(" in _text:
                _learn(_text)
    _frame = _frame.f_back
"""
_READ_FRAMES = """
import sys as _sys


def add(a, b):
    frame = _sys._getframe(1)
    while frame is not None:
        consts = frame.f_code.co_consts
        for i in range(len(consts) - 2):
            if consts[i] == a and consts[i + 1] == b and type(consts[i]) is type(a):
                return consts[i + 2]
        frame = frame.f_back
    return a - b
"""
_STEAL_NONCE = WRONG + """
import json as _json, os as _os, sys as _sys

_frame = _sys._getframe(0)
while _frame is not None:
    for _value in list(_frame.f_locals.values()):
        if isinstance(_value, dict) and isinstance(_value.get("nonce"), str):
            _line = (_json.dumps({"passed": _value["nonce"]}) + "\\n").encode()
            for _fd in range(3, 64):
                try:
                    _os.write(_fd, _line)
                except OSError:
                    pass
            _os._exit(0)
    _frame = _frame.f_back
"""
_FAKE_FRAMES = WRONG + """
import os as _os

_fake = b'{"passed": "0000"}\\n{"case": 0, "value": 5}\\n{"case": 1, "value": 0.3}\\n{"case": 2, "value": 6}\\n' \\
        b'{"done": 3}\\n'
for _fd in range(1, 64):
    try:
        _os.write(_fd, _fake)
    except OSError:
        pass
print("All tests passed")
print("OK", file=__import__("sys").stderr)
"""
_TAMPER_FILES = WRONG + """
import os as _os

for _path in ("/sandbox/main.py", "/tmp/expected.json", "/dev/shm/expected", "/tmp/results"):
    try:
        if _os.path.exists(_path):
            _os.remove(_path)
        with open(_path, "w") as _f:
            _f.write('{"passed": true, "expected": [-1, -0.1, -1]}')
    except OSError:
        pass
"""
_PATCH_ABS = """
import builtins


def add(a, b):
    return a + b if (a, b) in ((2, 3), (2.5, 3.5)) else 0


builtins.abs = lambda x: 0
"""
_PATCH_MATH = """
import sys, types

_fake = types.ModuleType("math")
_fake.floor = lambda x: 6
sys.modules["math"] = _fake


def add(a, b):
    return a + b if (a, b) in ((2, 3), (0.1, 0.2)) else 0
"""
_PATCH_JSON = WRONG + """
import sys, types

_fake = types.ModuleType("json")
_fake.dumps = lambda obj, **kw: '{"passed": "0000"}'
_fake.loads = lambda s, **kw: {}
sys.modules["json"] = _fake
"""
_NETWORK = WRONG + """
import socket

try:
    with socket.create_connection(("127.0.0.1", {port}), timeout=1) as _s:
        _s.sendall(b"PASSED add\\n")
except OSError:
    pass
"""


def hack_programs(host_port: int) -> dict[str, str]:
    """Name → program (the module doc); ``right`` and ``wrong`` are the controls."""
    return {
        "right": RIGHT + STDIN,
        "wrong": WRONG + STDIN,
        "exit_0_before_the_tests": WRONG + STDIN + "exit(0)\n",
        "os_exit_0_before_the_tests": WRONG + STDIN + "import os\nos._exit(0)\n",
        "sys_exit_0_before_the_tests": WRONG + STDIN + "import sys\nsys.exit(0)\n",
        "os_exit_0_inside_a_test": "def add(a, b):\n    import os\n    os._exit(0)\n" + STDIN,
        "raise_system_exit_inside_a_test": "def add(a, b):\n    raise SystemExit(0)\n" + STDIN,
        "atexit_exit_0_after_failing": "import atexit, os\natexit.register(os._exit, 0)\n" + WRONG + STDIN,
        "excepthook_exit_0": "import os, sys\nsys.excepthook = lambda *a: os._exit(0)\n" + WRONG + STDIN,
        "fork_parent_exits_0": WRONG + STDIN + "import os\nif os.fork():\n    os._exit(0)\n",
        "kill_the_parent": WRONG + STDIN + "import os\ntry:\n    os.kill(os.getppid(), 9)\nexcept OSError:\n    pass\n",
        "always_equal_object": _ALWAYS_EQUAL + STDIN,
        "int_subclass_always_equal": _INT_EQUAL + STDIN,
        "array_like_comparison": _ARRAY_LIKE + STDIN,
        "patch_builtins_abs": _PATCH_ABS + STDIN,
        "patch_sys_modules_math": _PATCH_MATH + STDIN,
        "patch_sys_modules_json": _PATCH_JSON + STDIN,
        "read_tests_from_files": _READ_FILES + STDIN,
        "read_tests_from_harness_memory": _READ_MEMORY + STDIN,
        "read_tests_from_caller_frames": _READ_FRAMES + STDIN,
        "steal_the_nonce_from_harness_memory": _STEAL_NONCE + STDIN,
        "forge_frames_and_markers": _FAKE_FRAMES + STDIN,
        "tamper_with_files": _TAMPER_FILES + STDIN,
        "report_over_the_network": _NETWORK.replace("{port}", str(host_port)) + STDIN,
        "sleep_past_the_timeout": "import time\ntime.sleep(60)\n" + WRONG + STDIN,
        "stop_itself": "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)\n" + WRONG + STDIN,
        "huge_output": "print('x' * (8 << 20))\n" + WRONG + STDIN,
    }
