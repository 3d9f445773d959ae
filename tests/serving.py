"""What the server tests share: a test app served on a free port, and waiting for one to finish loading."""

import contextlib
import socket
import threading
import time

import httpx
import uvicorn


@contextlib.contextmanager
def serving(app):
    """uvicorn serving `app` on 127.0.0.1 in a thread, once it answers /health with 200: its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _ready(url):
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.2)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health").status_code == 200
    except httpx.TransportError:  # not listening yet
        return False


def loaded(client, timeout: float = 300) -> dict:
    """Poll /health until the model has loaded (or failed to); its last answer."""
    deadline = time.monotonic() + timeout
    while (health := client.get("/health").json())["status"] == "warming_up":
        assert time.monotonic() < deadline, health
        time.sleep(0.2)
    return health
