"""The test harness inside the sandbox, and the plain-data wire format it shares with the judge (``sandbox.judge``).

Its text reaches the sandboxed interpreter through the harness pipe (``sandbox.bootstrap``), with the request
(``sandbox.judge.harness_input``), and is loaded before the program runs; outside the sandbox the judge imports this
module for the wire format. Standard library only, and only modules that cost nothing to import (``json`` would add
7 ms to every program here: the frames are written by :func:`dumps`).

Requests (``marshal`` of plain data, version 2: written by this project, never by the program):

- ``{"style": "calls", "entry_point": NAME, "calls": [(ARGS, KWARGS, APPLY), ...]}``: call the program's function
  NAME with each call's arguments (ARGS a tuple, KWARGS a dict of str keys; APPLY None or one of :data:`APPLY`,
  applied to the result here, as ``tuple(candidate(...))`` in a test would). Frames, one JSON object a line:
  ``{"case": i, "value": WIRE}`` or ``{"case": i, "error": "Type: message"}`` for each call in order, then
  ``{"done": n}``. The expected results never enter the sandbox: the judge compares them with these values outside
  it, so what the program can write here is at most a value, never a verdict.
- ``{"style": "asserts", "tests": SOURCE, "nonce": HEX, "entry_point": NAME or None, "setup": SOURCE}``: run test
  code after the program, in its process (what cannot be judged outside it). With an entry point, the tests run in
  a namespace of their own: ``setup`` (the row's starter code: helpers as the problem defines them) run again, the
  entry point as a function whose results reach the tests as plain data (:func:`plain_returns`), and the builtins
  as they were before the program ran; without one, in a copy of the program's namespace with those builtins.
  Frames: ``{"passed": NONCE}`` once the tests returned, ``{"error": "Type: message"}`` when they raised
  (``SystemExit`` included). The nonce, fresh for each program, is the evidence: docs/sandbox.md lists what this
  style does not catch.

Either way the harness ends the process itself (``os._exit``) once its frames are written: the program's ``atexit``
hooks and leftover threads do not run after the evidence.

Plain data (:func:`plain`): None, bool, int, float, str, bytes, complex, and lists, tuples, dicts, sets and
frozensets of them, at most :data:`MAX_DEPTH` levels deep. Subclasses of these types are read through the base
type's own methods (an ``int`` subclass is its int value, whatever its ``__eq__``, ``__iter__`` or ``__repr__``
say); any other type is refused (TypeError). Wire format (:func:`encode`, :func:`decode`): JSON where null,
booleans, numbers (NaN and infinities as Python's ``json`` writes them), strings and arrays (lists) stand for
themselves and every JSON object is a tag with one key: ``{"tuple": [...]}``, ``{"dict": [[key, value], ...]}``,
``{"set": [...]}``, ``{"frozenset": [...]}``, ``{"bytes": "hex"}``, ``{"complex": [real, imag]}``, ``{"int":
"hex"}`` (an int of more than 13,000 bits, beyond what ``json`` reads in decimal).
"""

import os
import sys

try:
    from _json import encode_basestring_ascii as _quote
except ImportError:  # an interpreter without the C accelerator
    from json.encoder import encode_basestring_ascii as _quote

#: Deepest nesting of containers plain data may have.
MAX_DEPTH = 100
#: Transformations a call's result may get in the sandbox before it is sent (the test's ``tuple(candidate(x))``).
APPLY = {"tuple": tuple, "list": list, "sorted": sorted, "set": set}
_BIG_INT_BITS = 13_000
_FLOATS = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def plain(value, depth=0):
    """A copy of ``value`` made of Python's own builtins only (module doc). Raises TypeError for a type outside plain
    data, ValueError past :data:`MAX_DEPTH` (or a container that holds itself)."""
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels (or a container that holds itself)")
    if value is None or type(value) is bool:
        return value
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, str):
        return str.__str__(value)
    deeper = depth + 1
    if isinstance(value, list):
        return [plain(item, deeper) for item in list.__iter__(value)]
    if isinstance(value, tuple):
        return tuple(plain(item, deeper) for item in tuple.__iter__(value))
    if isinstance(value, dict):
        return {plain(k, deeper): plain(v, deeper) for k, v in dict.items(value)}
    if isinstance(value, frozenset):
        return frozenset(plain(item, deeper) for item in frozenset.__iter__(value))
    if isinstance(value, set):
        return {plain(item, deeper) for item in set.__iter__(value)}
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, complex):
        return complex(complex.real.__get__(value), complex.imag.__get__(value))
    raise TypeError(f"a {type(value).__name__} is not plain data (expected None, bool, int, float, str, bytes, "
                    f"complex, list, tuple, dict, set or frozenset)")


def _to_json(value):
    """The wire format's JSON text of a value :func:`plain` made (so every type is exact)."""
    kind = type(value)
    if value is None:
        return "null"
    if kind is bool:
        return "true" if value else "false"
    if kind is str:
        return _quote(value)
    if kind is int:
        return int.__repr__(value) if value.bit_length() <= _BIG_INT_BITS else '{"int": "%s"}' % hex(value)
    if kind is float:
        text = float.__repr__(value)
        return _FLOATS.get(text, text)
    if kind is list:
        return "[" + ", ".join(_to_json(item) for item in value) + "]"
    if kind is dict:
        pairs = ", ".join("[" + _to_json(k) + ", " + _to_json(v) + "]" for k, v in value.items())
        return '{"dict": [' + pairs + "]}"
    if kind is bytes:
        return '{"bytes": "' + value.hex() + '"}'
    if kind is complex:
        return '{"complex": [' + _to_json(value.real) + ", " + _to_json(value.imag) + "]}"
    return '{"' + kind.__name__ + '": [' + ", ".join(_to_json(item) for item in value) + "]}"  # tuple, set, frozenset


def encode(value):
    """``value`` in the wire format, as JSON text (module doc). Raises as :func:`plain`."""
    return _to_json(plain(value))


def decode(data, depth=0):
    """Plain data back from the wire format as ``json.loads`` parsed it. Raises ValueError for anything else (an
    unknown tag, a body of the wrong shape, an unhashable set item or key, nesting past :data:`MAX_DEPTH`)."""
    if depth > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    deeper = depth + 1
    if kind is list:
        return [decode(item, deeper) for item in data]
    if kind is not dict or len(data) != 1:
        raise ValueError(f"not the wire format: {data!r:.80}")
    ((tag, body),) = data.items()
    try:
        if tag == "int" and type(body) is str:
            return int(body, 16)
        if tag == "bytes" and type(body) is str:
            return bytes.fromhex(body)
        if type(body) is not list:
            raise ValueError(f"tag {tag!r} needs a list, got {type(body).__name__}")
        if tag == "tuple":
            return tuple(decode(item, deeper) for item in body)
        if tag == "set":
            return {decode(item, deeper) for item in body}
        if tag == "frozenset":
            return frozenset(decode(item, deeper) for item in body)
        if tag == "dict":
            return {decode(k, deeper): decode(v, deeper) for k, v in body}
        if tag == "complex" and len(body) == 2 and all(type(x) in (int, float) for x in body):
            return complex(body[0], body[1])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"not the wire format ({tag!r}): {exc}") from None
    raise ValueError(f"not the wire format: unknown tag {tag!r}")


def parse_request(data):
    """The request from the pipe's bytes (before the program runs)."""
    import marshal

    return marshal.loads(data)


def plain_returns(function):
    """``function`` wrapped so that its results are handed on as plain data (:func:`plain`): what the tests of the
    ``asserts`` style compare is never an object of the program's."""
    def entry_point(*args, **kwargs):
        return plain(function(*args, **kwargs))

    entry_point.__name__ = getattr(function, "__name__", "entry_point")
    return entry_point


def describe(exc):
    """``"Type: message"`` of an exception, whatever its ``__str__`` does."""
    try:
        return f"{type(exc).__name__}: {exc}"[:500]
    except BaseException:  # noqa: BLE001 - a program's exception may fail to print itself
        return type(exc).__name__


def send(fd, key, value, case=None):
    """Write one frame to ``fd``, whole: ``{"case": case, key: value}`` (without ``case`` when None) and a newline;
    ``value`` is JSON text when ``key`` is ``"value"``, else a str or an int."""
    text = value if key == "value" else _quote(value) if type(value) is str else int.__repr__(value)
    head = "" if case is None else '"case": %d, ' % case
    data = ("{" + head + _quote(key) + ": " + text + "}\n").encode("ascii")
    while data:
        data = data[os.write(fd, data):]


def finish(code):
    """Flush the program's output and end the process at once with exit status ``code``."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - the program may have replaced or closed its streams
            pass
    os._exit(code)


def run_calls(request, namespace, results_fd):
    """The ``calls`` style (module doc): every call runs, a raising call fails alone."""
    calls = request["calls"]
    function = namespace.get(request["entry_point"])
    for index, (args, kwargs, apply) in enumerate(calls):
        try:
            if not callable(function):
                raise NameError(f"the program defines no function {request['entry_point']!r}")
            value = function(*args, **kwargs)
            key, text = "value", encode(APPLY[apply](value) if apply else value)
        except BaseException as exc:  # noqa: BLE001 - SystemExit too: the call failed, the others still run
            key, text = "error", describe(exc)
        send(results_fd, key, text, case=index)
    send(results_fd, "done", len(calls))
    finish(0)


def run_asserts(request, namespace, results_fd, pristine_builtins):
    """The ``asserts`` style (module doc): the nonce is written only after the tests returned."""
    entry_point = request.get("entry_point")
    if entry_point:
        tests_namespace = {"__name__": "__main__", "__builtins__": pristine_builtins}
        function = namespace.get(entry_point)
        try:
            if request.get("setup"):
                exec(compile(request["setup"], "<starter code>", "exec", dont_inherit=True), tests_namespace)
            if callable(function):
                tests_namespace[entry_point] = plain_returns(function)
        except BaseException as exc:  # noqa: BLE001 - the starter code failing is the tests failing
            send(results_fd, "error", describe(exc))
            finish(1)
    else:
        tests_namespace = {**namespace, "__builtins__": pristine_builtins}
    try:
        exec(compile(request["tests"], "<tests>", "exec", dont_inherit=True, optimize=0), tests_namespace)
    except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt too: the tests did not pass
        send(results_fd, "error", describe(exc))
        finish(1)
    send(results_fd, "passed", request["nonce"])
    finish(0)


def run(request, namespace, results_fd, pristine_builtins):
    """Run the request's style after the program (``sandbox.bootstrap``); never returns."""
    if request["style"] == "calls":
        run_calls(request, namespace, results_fd)
    run_asserts(request, namespace, results_fd, pristine_builtins)
