"""Start the server as a separate process on a free loopback port, wait for it, stop it with
SIGTERM. Used by the seed's HTTP experiment and by the server tests, so both exercise exactly
the command a user types (``python -m experiments.serve ...``)."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from engine.core.config import ModelConfig, SchedulerConfig
from engine.serving.app import ServerConfig

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _value(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return repr(v)


def overrides(prefix: str, config) -> list[str]:
    """Hydra overrides that reproduce a config dataclass field by field."""
    return [f"{prefix}.{f.name}={_value(getattr(config, f.name))}" for f in dataclasses.fields(config)]


class ServerProcess:
    """A running ``experiments.serve`` process; a context manager that always stops it."""

    def __init__(self, model: ModelConfig, scheduler: SchedulerConfig, server: ServerConfig,
                 log_path: Path | None = None) -> None:
        self.url = f"http://{server.host}:{server.port}"
        cmd = [sys.executable, "-m", "experiments.serve", "model=tiny",  # any option; every field is overridden
               *overrides("model", model), *overrides("scheduler", scheduler), *overrides("server", server)]
        self.log_path = log_path
        self._log = open(log_path, "wb") if log_path is not None else subprocess.DEVNULL
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        """Until /health answers 200 (the engine is warmed up); raise if the process dies first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before it was healthy"
                                   + (f"; see {self.log_path}" if self.log_path else ""))
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server at {self.url} was not healthy within {timeout_s} s")

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then wait for the exit status (SIGKILL only if it hangs past ``timeout_s``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
            self._log = subprocess.DEVNULL
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
