"""The first code the sandboxed interpreter runs (``sandbox.launch``): limits, the "started" byte, the program, and,
for a program under test, the harness.

Run as ``python -I [-S] -c LAUNCHER SOURCE MARKER_FD PROGRAM HARNESS_FD RESULTS_FD LIMIT...``: the launcher executes
SOURCE, this file's text, in a namespace of its own (never the program's ``__main__``) and calls :func:`main`, which

1. sets the limits (each LIMIT is ``NAME:SOFT:HARD``, ``resource.RLIMIT_<NAME>``) and, without ``site`` (``-S``),
   adds the ``exit``/``quit`` builtins that ``site`` would (model-written programs call them);
2. reads the program from PROGRAM and, when HARNESS_FD >= 0, everything the harness pipe holds, to its end, then
   closes it: the text of ``sandbox/harness.py``, a NUL byte, and the request (JSON). The harness is loaded in a
   namespace of its own and parses the request now: from here on the tests exist only in this process's memory,
   nowhere in its file system;
3. writes one byte to MARKER_FD and closes it (before it, a failure is the sandbox's; after it, the program's);
4. runs the program in ``__main__``'s namespace (emptied first) with ``__file__`` and ``sys.argv`` naming it;
5. under a harness, hands over to it (``sandbox.harness.run``: the tests, their frames on RESULTS_FD, the end of the
   process). A program alone ends as its code does.

Standard library only (this text runs in the sandbox); short, since every program compiles it.
"""

import builtins
import os
import resource
import sys


def _read_to_end(fd):
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def main(args):
    """The steps of the module doc; ``args`` = MARKER_FD PROGRAM HARNESS_FD RESULTS_FD LIMIT..."""
    marker_fd, path, harness_fd, results_fd = int(args[0]), args[1], int(args[2]), int(args[3])
    for limit in args[4:]:
        name, soft, hard = limit.split(":")
        resource.setrlimit(getattr(resource, "RLIMIT_" + name), (int(soft), int(hard)))
    if not hasattr(builtins, "exit"):
        import _sitebuiltins

        builtins.exit = _sitebuiltins.Quitter("exit", "Ctrl-D (i.e. EOF)")
        builtins.quit = _sitebuiltins.Quitter("quit", "Ctrl-D (i.e. EOF)")
    with open(path, "rb") as f:
        source = f.read()
    harness = request = None
    if harness_fd >= 0:
        code, _, request_bytes = _read_to_end(harness_fd).partition(b"\0")
        os.close(harness_fd)
        harness = {"__name__": "sandbox_harness"}
        exec(compile(code, "<sandbox.harness>", "exec", dont_inherit=True), harness)
        request = harness["parse_request"](request_bytes)
    pristine_builtins = dict(vars(builtins))
    os.write(marker_fd, b"1")
    os.close(marker_fd)
    namespace = sys.modules["__main__"].__dict__
    namespace.clear()
    namespace.update(__name__="__main__", __file__=path, __builtins__=builtins, __doc__=None)
    sys.argv = [path]
    exec(compile(source, path, "exec", dont_inherit=True), namespace)
    if harness is not None:
        harness["run"](request, namespace, results_fd, pristine_builtins)
