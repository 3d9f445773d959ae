"""What the server tests share: a test app served on a free port, and waiting for one to finish loading."""

import contextlib
import time
from pathlib import Path

import httpx

from spinf_jax.server.protocol import in_thread


@contextlib.contextmanager
def serving(app):
    """uvicorn serving `app` on 127.0.0.1 in a thread, once it answers /health with 200: its URL."""
    with in_thread(app) as url:
        deadline = time.monotonic() + 120
        while httpx.get(f"{url}/health").status_code != 200:
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.2)
        yield url


def loaded(client, timeout: float = 300) -> dict:
    """Poll /health until the model has loaded (or failed to); its last answer."""
    deadline = time.monotonic() + timeout
    while (health := client.get("/health").json())["status"] == "warming_up":
        assert time.monotonic() < deadline, health
        time.sleep(0.2)
    return health


def processes() -> dict[int, tuple[int, str]]:
    """Every live process: pid → (parent pid, command line), read from /proc (no procps on a bare machine)."""
    found = {}
    for folder in Path("/proc").iterdir():
        if not folder.name.isdigit():
            continue
        try:
            stat = (folder / "stat").read_text()
            command = (folder / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended meanwhile
            continue
        state, parent = stat.rsplit(") ", 1)[1].split()[:2]
        if state != "Z":
            found[int(folder.name)] = (int(parent), command)
    return found
