"""Scripts' runs that end in their argument parsers (``--help``, a usage error), many in one
interpreter: each fresh ``python SCRIPT`` would spend its seconds importing torch."""

from __future__ import annotations

import json
import subprocess

MARKER = "ONE_PROCESS_RESULTS "

# Each argv [SCRIPT, ARGS...] as `python SCRIPT ARGS...` runs it, up to its exit: SCRIPT as __main__
# with its folder first on sys.path, its output captured. Prints MARKER and [exit status, stdout,
# stderr] per argv, as JSON.
PROGRAM = f"""
import contextlib, io, json, os, runpy, sys, traceback
results = []
for argv in json.loads(sys.argv[1]):
    out, err, path, status = io.StringIO(), io.StringIO(), list(sys.path), 0
    sys.argv, sys.path[:0] = argv, [os.path.dirname(os.path.abspath(argv[0]))]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as exit:
            status = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
        except BaseException:
            traceback.print_exc()
            status = 1
    sys.path[:] = path
    results.append([status, out.getvalue(), err.getvalue()])
print({MARKER!r} + json.dumps(results), flush=True)
"""


def arguments(argvs: list[list[str]]) -> list[str]:
    """python's arguments that run every argv of ``argvs`` in one interpreter."""
    return ["-c", PROGRAM, json.dumps(argvs)]


def results(argvs: list[list[str]], out: subprocess.CompletedProcess) -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    """Each argv's run, by argv, as ``subprocess.run(..., capture_output=True, text=True)`` of
    ``python ARGV`` would return it; ``out``: python's run with :func:`arguments`, which must have finished."""
    (line,) = [line for line in out.stdout.splitlines() if line.startswith(MARKER)] or [None]
    assert out.returncode == 0 and line is not None, out.stderr[-3000:]
    return {tuple(argv): subprocess.CompletedProcess(argv, *result) for argv, result in zip(argvs, json.loads(line[len(MARKER) :]))}
