"""A real ``specrelay serve`` subprocess for tests (this repository's code, stderr in a
file, stopped by its pid), and a tiny model saved as a ``--model DIR`` folder."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_S = 120      # seconds a server may take to answer /healthz

__all__ = ["ServeProcess", "free_port", "save_tiny"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_tiny(path) -> str:
    """The tests' tiny target and tokenizer as a model folder (``--model DIR``)."""
    conftest.tiny_model(seed=0).save_pretrained(path)
    conftest.tiny_tokenizer().save_pretrained(path)
    return str(path)


class ServeProcess:
    """One ``specrelay serve`` subprocess (stderr in a file); ``url`` once it answers
    /healthz. Raises AssertionError (with its stderr) when it exits or is not up in
    ``START_S`` seconds. Args: tmp (folder of the log), name (the log's name), args
    (``serve`` options after ``--port``)."""

    def __init__(self, tmp, name: str, args: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"{name}.log"
        env = {**os.environ, "PYTHONPATH": ROOT}
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "specrelay_cli", "serve", "--port", str(self.port),
                 *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)

    def wait_healthy(self) -> dict:
        """The first /healthz answer (polled every 0.3 s, at most START_S s)."""
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=2) as r:
                    return json.loads(r.read())
            except OSError:
                time.sleep(0.3)
        raise AssertionError(f"not up in {START_S} s: {self.log.read_text()}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s (this process only, by its pid)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
