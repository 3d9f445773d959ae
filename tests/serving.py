"""What the server tests share: waiting for a test app to finish loading."""

import time


def loaded(client, timeout: float = 300) -> dict:
    """Poll /health until the model has loaded (or failed to); its last answer."""
    deadline = time.monotonic() + timeout
    while (health := client.get("/health").json())["status"] == "warming_up":
        assert time.monotonic() < deadline, health
        time.sleep(0.2)
    return health
