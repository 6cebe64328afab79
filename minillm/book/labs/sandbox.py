"""The learner's notebook in a process of its own, which the grader calls into and never trusts.

The grading process (:class:`Sandbox`) starts the notebook's process in a new session, so that it and
everything it starts form one process group. That process runs the notebook's cells, then waits for
calls: the grader sends a function's name and arguments over a socket (:mod:`.wire`), the learner's
function runs there, and its value, the arguments as it left them and the minillm code it reached come
back. The checks, the comparison with the reference, the score and the report stay in the grading
process: nothing the notebook does to its own interpreter (rebinding the grader, ignoring signals,
printing) reaches them.

The grader keeps the clock. A cell or a call that does not answer in time is stopped from outside
(no signal the notebook could ignore): its place in the code is read from a traceback that
``faulthandler`` writes on SIGUSR1, then the whole process group is killed, and the notebook's process
starts again, running the cells before (a cell that never ends, or that ended the process, is skipped).
When the grading ends, the process group is killed and, on Linux, every process that left the group
(a new session, a double fork) is found and killed too: the grader is their subreaper, so they become
its children when their parents die.
"""
from __future__ import annotations

import contextlib
import ctypes
import io
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from . import wire
from .cells import notebook_cells, run_cells
from .checker import FunctionStopped, LearnerError

RESTARTS = 8  # a notebook whose process had to start again more often than this is not graded
STARTUP_SECONDS = 120.0  # the notebook's process must start (and move from cell to cell) within this
_TRACE = re.compile(r'File "<(.*) cell (\d+)>", line (\d+)')


class NotGraded(Exception):
    """The notebook could not be graded (its time ran out, its process broke the protocol, ...)."""


# --- the grading process's side ---------------------------------------------------------------------------

def _prctl_subreaper(on: bool) -> bool:
    """Make this process the subreaper of its descendants (Linux): orphans become its children."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(36, int(on), 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _children() -> set[int]:
    """The process ids whose parent is this process (Linux; elsewhere none)."""
    me, found = os.getpid(), set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 1 and fields[1] == str(me):
            found.add(int(entry))
    return found


class Sandbox:
    """One notebook's process: :meth:`start` runs its cells, :meth:`call` calls one of its functions,
    :meth:`close` ends it and everything it started.

    ``cell_seconds``: each cell's limit; ``deadline``: time.monotonic() by which the whole grading must end.
    ``describe`` names a value the wire does not carry (for messages).
    """

    def __init__(self, path: str | Path, cell_seconds: float, deadline: float, describe):
        self.path, self.cell_seconds, self.deadline, self.describe = Path(path), cell_seconds, deadline, describe
        self.functions: list[str] = []  # the lab functions the notebook defines
        self.problems: dict[int, str] = {}  # cell index -> what went wrong there (first time only)
        self.uses: list[str] = []  # minillm code the last call reached ("next_token_probs called ...")
        self._skip: set[int] = set()
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._restarts = -1
        self._keep: set[int] = set()  # this process's children before the notebook's
        self._folder = tempfile.TemporaryDirectory(prefix="minillm-grade-")
        self._trace = Path(self._folder.name) / "trace.txt"
        self._stderr = b""
        self._subreaper = False
        self._sources = self._cell_sources()

    # -- life --------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the notebook's process and run its cells; NotGraded if it cannot be done in time."""
        if self._restarts >= RESTARTS:
            raise NotGraded(f"its process had to start again {self._restarts} times (a cell or a function "
                            "that kills it?)")
        self._restarts += 1
        if not self._subreaper:
            self._keep = _children()
            self._subreaper = _prctl_subreaper(True)
        ours, theirs = socket.socketpair()
        self._trace.write_bytes(b"")
        package_root = str(Path(__file__).resolve().parents[3])
        env = dict(os.environ, MPLBACKEND="Agg",
                   PYTHONPATH=os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p))
        command = [sys.executable, "-m", "minillm.book.labs", "run-notebook", str(self.path.resolve()),
                   "--fd", str(theirs.fileno()), "--trace", str(self._trace),
                   "--skip", ",".join(map(str, sorted(self._skip)))]
        self._proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, pass_fds=(theirs.fileno(),),
                                      start_new_session=True, env=env, cwd=self.path.resolve().parent)
        theirs.close()
        self._sock = ours
        threading.Thread(target=self._drain, args=(self._proc.stderr,), daemon=True).start()
        self._run_cells()

    def _drain(self, pipe) -> None:
        """Keep the last 4 kB of what the notebook's process writes to stderr (for a crash's message)."""
        with contextlib.suppress(OSError, ValueError):
            for chunk in iter(lambda: pipe.read1(4096), b""):
                self._stderr = (self._stderr + chunk)[-4096:]

    def _run_cells(self) -> None:
        index = None  # the cell running now
        while True:
            limit = time.monotonic() + (self.cell_seconds if index is not None else STARTUP_SECONDS)
            try:
                message, _ = self._receive(min(limit, self.deadline))
            except TimeoutError:
                if index is None:  # the process did not start its next cell (or its first)
                    self._kill()
                    raise NotGraded(f"its process did not answer within {STARTUP_SECONDS:g} s") from None
                where = self._stop()
                self._note(index, f"cell {index} did not finish within {self.cell_seconds:g} s{where}: it was "
                                  "stopped, the cells after it still ran")
                self._skip.add(index)
                return self.start()
            except EOFError:
                code = self._ended()
                if index is None:
                    self._kill()
                    raise NotGraded(f"its process ended (exit code {code}) outside a cell: "
                                    f"{self._last_error()}") from None
                self._note(index, f"cell {index} ended the notebook's process (exit code {code}): the cells "
                                  "after it still ran")
                self._skip.add(index)
                self._kill()  # what the cell started dies with the rest of its group
                return self.start()
            event = message.get("event")
            if event == "cell":
                index = int(message["index"])
            elif event == "cell-done":
                if message.get("problem"):
                    self._note(int(message["index"]), str(message["problem"]))
                index = None
            elif event == "ready":
                self.functions = [str(name) for name in message.get("functions", [])]
                return None
            else:
                raise NotGraded(f"its process sent an unknown message {str(message)[:80]!r}")

    def _note(self, index: int, text: str) -> None:
        self.problems.setdefault(index, text)

    def call(self, name: str, args: tuple, kwargs: dict, seconds: float, limit: float | None = None):
        """The learner's ``name(*args, **kwargs)`` in the notebook's process, within ``seconds`` (of a
        check whose limit, for the message, is ``limit``).

        Returns its value (arguments it changed in place change here too); raises checker.LearnerError
        for what it raised, FunctionStopped when it ran out of time or ended its process, NotGraded when
        the notebook's time runs out.
        """
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            self.start()
        encoder = wire.Encoder(self.describe)
        data = encoder.encode([list(args), dict(kwargs)])
        mine = dict(enumerate(encoder.objects))
        until = time.monotonic() + max(seconds, 0.0)
        try:
            wire.send(self._sock, {"op": "call", "name": name, "args": data}, encoder.blobs)
            message, blobs = self._receive(min(until, self.deadline))
        except TimeoutError:
            where = self._stop()
            raise FunctionStopped(name, f"did not finish within {limit or seconds:g} s{where}", True) from None
        except (EOFError, BrokenPipeError, ConnectionResetError):
            code = self._ended()
            self._kill()
            raise FunctionStopped(name, f"{name} ended the notebook's process (exit code {code})",
                                  False) from None
        self.uses = [str(use) for use in message.get("uses", [])]
        try:
            result, _args, _kwargs = wire.Decoder(blobs, mine).decode(message["reply"])
        except (wire.WireError, KeyError, IndexError, TypeError, ValueError) as exc:
            raise NotGraded(f"its process sent a reply the grader cannot read ({exc})") from None
        if "error" in message:
            error = message["error"]
            raised = LearnerError(str(error.get("message", "")), bool(error.get("not_written")))
            raised.__cause__ = wire.exception_of(str(error.get("cause", "Exception")))
            raise raised
        return result

    def _receive(self, deadline: float) -> tuple[dict, list[bytes]]:
        try:
            return wire.receive(self._sock, deadline)
        except TimeoutError:
            if time.monotonic() >= self.deadline:
                self._stop()
                raise NotGraded("its time ran out (the notebook limit)") from None
            raise
        except wire.WireError as exc:
            self._kill()
            raise NotGraded(f"its process broke the grader's protocol ({exc})") from None
        except OSError as exc:
            raise EOFError(str(exc)) from None

    def _stop(self) -> str:
        """Stop the notebook's process now; where its code was (' (stopped at line N of cell M: `...`)')."""
        where = ""
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(OSError):
                os.kill(self._proc.pid, signal.SIGUSR1)  # faulthandler writes every thread's stack
                for _ in range(20):  # within half a second, unless the notebook took SIGUSR1 away
                    time.sleep(0.025)
                    if b"File" in self._trace.read_bytes():
                        break
                time.sleep(0.025)
            where = self._where(self._trace.read_text(errors="replace"))
        self._kill()
        return where

    def _where(self, trace: str) -> str:
        for match in _TRACE.finditer(trace):  # most recent call first
            index, line = int(match.group(2)), int(match.group(3))
            lines = self._sources.get(index, [])
            code = lines[line - 1].strip() if 0 < line <= len(lines) else ""
            return f" (stopped at line {line} of cell {index}" + (f": `{code}`)" if code else ")")
        return ""

    def _ended(self) -> int | None:
        """The exit code of the notebook's process, once it has ended (None if it does not end soon)."""
        try:
            return self._proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return None

    def _last_error(self) -> str:
        lines = self._stderr.decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else "no message"

    def _kill(self) -> None:
        """Kill the notebook's process group, then every process that left it."""
        proc, self._proc = self._proc, None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        self._sweep()

    def _sweep(self, seconds: float = 5.0) -> None:
        """Kill and reap the processes that became this one's children (orphans of the notebook's)."""
        end, quiet = time.monotonic() + seconds, 0
        while time.monotonic() < end and quiet < 2:
            strays = _children() - self._keep
            if self._proc is not None:
                strays.discard(self._proc.pid)
            quiet = quiet + 1 if not strays else 0
            for pid in strays:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
            time.sleep(0.02)

    def close(self) -> None:
        """End the notebook's process and every process it started."""
        if self._sock is not None and self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(OSError):
                wire.send(self._sock, {"op": "bye"})
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=0.5)
        self._kill()
        if self._subreaper:
            self._sweep(0.2)
            _prctl_subreaper(False)
            self._subreaper = False
        self._folder.cleanup()

    def _cell_sources(self) -> dict[int, list[str]]:
        return {i: "".join(c["source"]).splitlines() for i, c in enumerate(notebook_cells(self.path))}


# --- the notebook's process -------------------------------------------------------------------------------

def _reply(sock: socket.socket, header: dict, values, received: dict[int, int], describe) -> None:
    encoder = wire.Encoder(describe, received)
    header["reply"] = encoder.encode(values)
    wire.send(sock, header, encoder.blobs)


def serve(path: str, fd: int, trace: str, skip: set[int]) -> int:
    """Run the notebook's cells (reporting each to the grader), then answer calls until told to stop."""
    import faulthandler

    from . import checker

    sock = socket.socket(fileno=fd)
    trace_file = open(trace, "w")
    faulthandler.register(signal.SIGUSR1, file=trace_file, all_threads=True)

    def started(index: int) -> None:
        wire.send(sock, {"event": "cell", "index": index})

    def done(index: int, problem: str | None) -> None:
        wire.send(sock, {"event": "cell-done", "index": index, "problem": problem})

    namespace = run_cells(path, skip, started, done)
    known = set(checker.function_names())
    functions = {k: v for k, v in namespace.items() if k in known and callable(v)}
    wire.send(sock, {"event": "ready", "functions": sorted(functions)})
    torch.set_num_threads(1)  # the hidden cases are small: one thread is faster and steadier
    quiet = io.StringIO()
    while True:
        try:
            request, blobs = wire.receive(sock)
        except EOFError:
            return 0
        if request.get("op") != "call":
            return 0
        decoder = wire.Decoder(blobs)
        args, kwargs = decoder.decode(request["args"])
        name = request["name"]
        checker.start_recording()
        header: dict = {}
        result = None
        try:
            with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
                result = checker.call(functions[name], *args, **kwargs)
        except checker.LearnerError as exc:
            header["error"] = {"message": str(exc), "not_written": exc.not_written,
                               "cause": wire.exception_name(exc.__cause__) if exc.__cause__ else "Exception"}
        quiet.seek(0)
        quiet.truncate()
        header["uses"] = checker.stop_recording()
        _reply(sock, header, (result, args, kwargs), decoder.received, checker.describe)
