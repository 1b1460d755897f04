"""`peer` commands started fast: forked from a template process that has done the imports already.

A fresh `python -m peer.cli.main join ...` spends most of its start importing: torch (about 1 s of CPU),
hivemind with scipy (0.5 s), and torch._dynamo, which torch's optimizers import on their first
call (about 1-2 s). On a 2-core machine that starts many peers (a test suite, a demo) this is the
larger part of the work. A `Forkserver` starts one template process that imports all of it once
and then forks a child for each command it is asked to run.

Each child is a whole peer process of its own: its own session and process group, its command
line (`sys.argv`), working directory, environment, niceness and output, and `peer.cli.main.main` runs
there as `python -m peer.cli.main` would run it (it forks its reaper, its hivemind processes, and may
exec itself to move to another stage), and it ends as the interpreter would: non-daemon threads
joined, atexit functions run. Random generators are seeded afresh in each child. What it shares
with its siblings is what the template fixed when it started: the modules imported, the hash seed,
multiprocessing's authkey, `sys.path` and `__main__` (peer uses none of these across processes).

Lifetime: the template is spawned through `peer.process.lifetime.tied_to_me`, so it dies with the
process that started it, and it exits when that process closes its end of the control socket.
Each child gets SIGKILL when the template dies (PR_SET_PDEATHSIG), and its reaper ends the rest.

The control socket carries JSON messages (no pickles): a request has an id and names the command,
its directory, environment and niceness, with the output's file descriptor attached. The template
answers `{"id": id, "started": pid}` once the child has its own session (or `{"id": id, "error":
...}`, and goes on serving), and later `{"id": id, "exited": returncode}` (a negative code is the
signal that ended it, as with subprocess). Answers name the request, not the pid, which the
kernel reuses.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import itertools
import json
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from peer.process.grpc_env import tune_grpc
from peer.process.lifetime import tied_to_me
from peer.process.reaper import stat

# what the template imports before it forks: the heavy libraries a peer imports, none that makes state shared
# between processes at import. Not hivemind (so none of peer's runtime modules, which import it): its classes
# create multiprocessing locks at import, which every child of the template would share, so a peer SIGKILLed
# holding one (MPFuture's, SharedBytes') would hang every later peer's DHT start. Each child imports it anew
# (about 0.8 CPU-s with the peer modules), and so has locks of its own, as a fresh process does.
PRELOAD = ("torch", "torch._dynamo", "scipy.optimize", "grpc", "pydantic", "rich.console")
ENTRY = "peer.cli.main"  # the module whose main(argv) each child runs
NEVER_PRELOADED = ("hivemind",)  # the template refuses to start with these imported
MAX_MESSAGE = 1 << 17  # bytes: one request (its environment included); under the socket's send buffer
START_TIMEOUT = 120.0  # s: the template's imports, on a loaded 2-core machine
READY_TIMEOUT = 10.0  # s: a child's setup (its own session, output, directory) before "started" is said
PR_SET_PDEATHSIG = 1


class Forkserver:
    """A template process, tied to this one, that forks `peer` commands on request.

    Use it from one thread; `start` returns a `ForkedPeer`, which answers as a `subprocess.Popen`.
    """

    def __init__(self, preload: tuple[str, ...] = PRELOAD, env: dict[str, str] | None = None, log: str | None = None):
        """Start the template (with `env`; its own output, a traceback if it fails, to the file `log`)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, "-m", "peer.process.forkserver", str(theirs.fileno()), *preload]
        with open(log or os.devnull, "ab") as out:
            self._proc = subprocess.Popen(
                tied_to_me(argv),
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a terminal's Ctrl+C is for the process that started it
                env=env,
            )
        theirs.close()
        self._sock, self._lock, self._closed = ours, threading.Lock(), False
        self._exited: dict[int, int] = {}  # request id -> return code
        self._requests = itertools.count(1)
        try:
            self._answer(START_TIMEOUT, "ready", 0)
        except BaseException:  # stops the template, then re-raises whatever it was
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self._proc.pid

    def start(self, argv: list[str], cwd: str, env: dict[str, str], output: int, niceness: int = 0) -> ForkedPeer:
        """Run `peer ARGV` in a forked child, with `output` (a file descriptor) as its stdout and stderr.

        Returns once the child has its own session (a signal to its process group reaches it)."""
        with self._lock:
            request = next(self._requests)
            message = {"id": request, "argv": list(argv), "cwd": str(cwd), "env": dict(env), "niceness": niceness}
            socket.send_fds(self._sock, [json.dumps(message).encode()], [output])
            return ForkedPeer(self, request, self._answer(30.0, "started", request))

    def _answer(self, timeout: float, kind: str, request: int) -> int:
        """Read answers until the one of `kind` for `request`, noting exits on the way (call with the lock held)."""
        deadline = time.monotonic() + timeout
        while True:
            message = self._receive(max(0.0, deadline - time.monotonic()))
            if message is None:
                raise RuntimeError(f"the peer forkserver gave no {kind!r} answer within {timeout} s")
            if message.get("id") != request:
                continue
            if "error" in message:
                raise RuntimeError(f"the peer forkserver: {message['error']}")
            if kind in message:
                return message[kind]

    def _receive(self, timeout: float) -> dict | None:
        """One message (exits are noted), or None after `timeout`; raises if the template is gone."""
        self._sock.settimeout(timeout)
        try:
            data = self._sock.recv(MAX_MESSAGE)
        except (TimeoutError, BlockingIOError):
            return None
        if not data:
            raise RuntimeError(f"the peer forkserver exited ({self._proc.poll()})")
        message = json.loads(data)
        if "exited" in message:
            self._exited[message["id"]] = message["exited"]
        return message

    def exit_code(self, request: int, pid: int) -> int | None:
        """The return code of the child started for `request` (process `pid`), once it has exited."""
        with self._lock:
            if self._closed or self._proc.poll() is not None:
                # the template is gone: the kernel ended what was left (SIGKILL, PR_SET_PDEATHSIG)
                return self._exited.get(request, None if stat(pid) is not None else -signal.SIGKILL)
            while request not in self._exited and self._receive(0.0) is not None:
                pass
            return self._exited.get(request)

    def close(self) -> None:
        """End the template; children still running get SIGKILL from the kernel (their reapers end the rest)."""
        with self._lock:
            self._closed = True
            self._sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(5)
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> Forkserver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ForkedPeer:
    """A forked `peer` command, as much of a `subprocess.Popen` as the test fixtures use."""

    def __init__(self, server: Forkserver, request: int, pid: int):
        self._server, self._request, self.pid, self.returncode = server, request, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self._request, self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"peer[{self.pid}]", timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


# ---- the template -----------------------------------------------------------------------------
def _serve(sock: socket.socket) -> None:
    """The template's loop: fork a child per request, report each child's exit; end with the socket."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    children: dict[int, int] = {}  # pid -> request id
    sock.send(json.dumps({"id": 0, "ready": os.getpid()}).encode())
    while True:
        for key, _ in selector.select():
            if key.fileobj is wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                _report_exits(sock, children)
                continue
            data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 1)
            if not data:
                return  # the process that started us has gone: our children die with us
            request = json.loads(data)
            try:
                pid = _fork(request, fds, sock, (wake_r, wake_w), selector)
            except Exception as e:  # a failed fork (EAGAIN, ENOMEM) or request: said, and we go on serving
                sock.send(json.dumps({"id": request.get("id"), "error": f"{type(e).__name__}: {e}"}).encode())
                continue
            finally:
                for fd in fds:
                    os.close(fd)
            children[pid] = request["id"]
            sock.send(json.dumps({"id": request["id"], "started": pid}).encode())


def _fork(request: dict, fds: list[int], sock: socket.socket, wake: tuple[int, int], selector) -> int:
    """Fork the child for `request`; returns once it has its own session (or has died trying)."""
    if len(fds) != 1:
        raise ValueError(f"a request carries one file descriptor (its output), not {len(fds)}")
    template = os.getpid()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        for fd in wake:
            os.close(fd)
        selector.close()
        _child(request, fds[0], sock, template, ready_w)
    os.close(ready_w)
    with os.fdopen(ready_r, "rb") as ready:
        select.select([ready], [], [], READY_TIMEOUT)  # EOF: the child closed its end (or exited)
    return pid


def _report_exits(sock: socket.socket, children: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        sock.send(json.dumps({"id": children.pop(pid, None), "exited": code}).encode())


def _child(request: dict, output: int, sock: socket.socket, template: int, ready: int) -> None:
    """In a forked child: become `peer ARGV`, then exit as Python would. Never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        _become(request, output, template)
        os.close(ready)  # the template may now say "started"
        code = _run(request["argv"])
    except KeyboardInterrupt:  # as Python does: end by the signal itself
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # whatever happened is printed, and the child exits
        traceback.print_exc()
    finally:
        _flush()
        os._exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _become(request: dict, output: int, template: int) -> None:
    """The child's own process: dies with the template; its session, output, directory, environment."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != template:  # the template died before the line above
        os._exit(1)
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(output, 1)
    os.dup2(output, 2)
    for fd in (null, output):
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if request["niceness"]:
        os.nice(request["niceness"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False, errors="backslashreplace")
    sys.stdout.reconfigure(write_through=unbuffered)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False, errors="backslashreplace")
    sys.argv = ["peer", *request["argv"]]
    _fresh_state()


def _fresh_state() -> None:
    """What a fresh interpreter would not share with its siblings: random state, the temporary directory."""
    import numpy  # lazy: loaded by the template's preload; the test process imports this module without them
    import torch  # lazy: as numpy

    tempfile.tempdir = None  # read TMPDIR of the new environment
    numpy.random.seed()  # Python's random reseeds itself at fork
    torch.seed()


def _run(argv: list[str]) -> int:
    """`peer.cli.main.main(argv)` with the exit code Python would give it, then the interpreter's own shutdown
    steps: non-daemon threads are joined, then the atexit functions run (logging, multiprocessing)."""
    # by name, not an import: a lower package must not import the CLI, and the template must not load the runtime
    main = importlib.import_module(ENTRY).main

    try:
        code = main(argv)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            sys.stderr.write(f"{e.code}\n")  # as the interpreter says a SystemExit with a message
            code = 1
    threading._shutdown()  # what Py_FinalizeEx does first (multiprocessing's children do the same)
    atexit._run_exitfuncs()
    return code


def _main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    tune_grpc()  # before the preloads import grpc
    for name in sys.argv[2:]:
        __import__(name)
    shared = [name for name in NEVER_PRELOADED if name in sys.modules]
    if shared:
        sock.send(
            json.dumps({"id": 0, "error": f"the template must not import {shared} (state shared at import)"}).encode()
        )
        sys.exit(2)
    _serve(sock)


if __name__ == "__main__":
    _main()
