"""Start ``python -m minillm serve`` as a child process on 127.0.0.1, wait until it answers, stop it.

The tests and the book use it: the server runs in its own process (its engine thread and the client
do not share one interpreter), listens on a free port of the loopback interface only, writes its log
to a file, and exits when its parent closes the pipe on its standard input, even if the parent dies.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy


def free_port() -> int:
    """A TCP port nobody listens on right now (the system picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A running server: ``url`` (ends in ``/v1``, for OpenAI clients), ``base``, ``health()``, ``stop()``."""

    def __init__(self, args: list[str], startup_timeout: float):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.base}/v1"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="minillm-serve-", suffix=".log", delete=False)
        command = [sys.executable, "-m", "minillm", "serve", *args,
                   "--host", "127.0.0.1", "--port", str(self.port), "--exit-with-parent"]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.process.poll() is not None:
                log = self.log_text()
                self.stop()
                raise RuntimeError(f"the server exited with status {self.process.returncode}:\n{log}")
            try:
                self.health()
                return
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    log = self.log_text()
                    self.stop()
                    raise TimeoutError(f"the server did not answer within {startup_timeout} s:\n{log}") from None
                time.sleep(0.1)

    def health(self) -> dict:
        """``GET /health``: the engine's load (running, waiting, KV blocks used ...)."""
        with NO_PROXY.open(f"{self.base}/health", timeout=5) as response:
            return json.load(response)

    def log_text(self) -> str:
        """What the server has written to stdout and stderr so far."""
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self, timeout: float = 10.0) -> int:
        """Shut the server down (closing its stdin, then SIGTERM, then SIGKILL), delete its log; its exit
        status."""
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.terminate()
                try:
                    self.process.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
        if not self.log.closed:
            self.log.close()
            os.unlink(self.log.name)
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch_server(args: list[str] = (), startup_timeout: float = 120.0) -> ServerProcess:
    """``python -m minillm serve *args`` on 127.0.0.1 and a free port, once ``/health`` answers."""
    return ServerProcess(list(args), startup_timeout)
