"""`spinf-jax serve` as a child process on a free port, for the benchmarks that measure over HTTP."""

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def start_server(serve_args: list[str], log: Path, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "spinf_jax.cli", "serve", "--port", str(port), *serve_args]
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    return process, f"http://127.0.0.1:{port}"


def wait_ready(url: str, process: subprocess.Popen | None, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was ready")
        try:
            response = httpx.get(f"{url}/health", timeout=10)
            if response.status_code == 200:
                return response.json()
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server was not ready after {timeout:.0f} s")


def wait_compiled(url: str, timeout: float) -> dict:
    """After wait_ready: until /health lists no bucket still compiling in the background (the server is
    ready once its smallest and largest buckets are); its last answer."""
    deadline = time.monotonic() + timeout
    while (health := httpx.get(f"{url}/health", timeout=10).json()).get("compiling"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"buckets {health['compiling']} still compiling after {timeout:.0f} s")
        time.sleep(0.5)
    return health


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
