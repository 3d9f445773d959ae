"""How uvicorn serves the app: its HTTP/1.1 protocol with a deadline on request headers, the timeouts that
keep slow or idle clients from holding connections, and the logs."""

import copy

import uvicorn
from uvicorn.config import LOG_LEVELS, LOGGING_CONFIG
from uvicorn.protocols.http.h11_impl import H11Protocol

from spinf_jax.progress import formatter

# From a connection's start, or the end of its previous response, to the end of a request's headers.
HEADER_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this
GRACEFUL_SHUTDOWN_S = 60  # on SIGTERM: requests in flight get this long to be answered


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's line and headers. uvicorn has none: a client
    that sends a header byte a minute would hold its connection for as long as it likes."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_too_slow)

    def on_response_complete(self) -> None:
        # Armed before the base class looks at pipelined requests, which may start the next cycle at once.
        self._header_deadline.cancel()
        self._header_deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_too_slow)
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        self._header_deadline.cancel()
        super().connection_lost(exc)

    def _headers_too_slow(self) -> None:
        # Only between requests: a request whose headers arrived is the app's to answer, however long.
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()


def uvicorn_config(app, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's own log keeps its errors; its access log is off, as the app logs each request itself, with
    more (server/app.py)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        log_config=_log_config(log_level),
        access_log=False,
        http=HeaderTimeoutProtocol,
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


def _log_config(log_level: str) -> dict:
    """uvicorn's logging, and spinf_jax's loggers (requests, loading and compiling) on stderr at the same
    level, as spinf_jax.progress formats them for that stream."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["formatters"]["spinf_jax"] = {"()": formatter, "stream": "ext://sys.stderr"}
    config["handlers"]["spinf_jax"] = {
        "formatter": "spinf_jax",
        "class": "logging.StreamHandler",
        "stream": "ext://sys.stderr",
    }
    config["loggers"]["spinf_jax"] = {
        "handlers": ["spinf_jax"],
        "level": LOG_LEVELS[log_level],
        "propagate": False,
    }
    return config
