"""How uvicorn serves the app: its HTTP/1.1 protocol with a deadline on request headers, the timeouts that
keep slow or idle clients from holding connections, and the logs."""

import contextlib
import copy
import errno
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import h11
import msgspec
import uvicorn
from uvicorn.config import LOG_LEVELS, LOGGING_CONFIG
from uvicorn.protocols.http.h11_impl import H11Protocol

from spinf_jax import api
from spinf_jax.progress import ReplicaTag, formatter
from spinf_jax.replicas import REPLICA_VARIABLE, free_port

# From a connection's start, or the end of its previous response, to the end of a request's headers.
HEADER_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5  # an idle keep-alive connection is closed after this
GRACEFUL_SHUTDOWN_S = 60  # on SIGTERM: requests in flight get this long to be answered
# On SIGTERM an idle keep-alive connection stays open this long, and a request on it is answered with
# `Connection: close`: closed at once (uvicorn's way), a client sending its next request on it just then
# gets a reset connection instead of an answer.
DRAIN_IDLE_S = 1.0
CLOSE = (b"connection", b"close")


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

    def handle_events(self) -> None:
        super().handle_events()
        if getattr(self, "_draining", False):
            self._answer_with_close()

    def shutdown(self) -> None:
        """The server is stopping (SIGTERM, Ctrl-C): every response from now on says `Connection: close`
        (uvicorn closes after the response in flight without saying so, and the client, thinking the
        connection reusable, may send its next request into the close), and an idle connection is closed
        after DRAIN_IDLE_S unless a request comes first."""
        self._draining = True
        if self.cycle is None or self.cycle.response_complete:
            self.loop.call_later(DRAIN_IDLE_S, self._close_if_idle)
        else:
            self._answer_with_close()
            self.cycle.keep_alive = False

    def _answer_with_close(self) -> None:
        # uvicorn adds `Connection: close` to a response whose request asked for it.
        cycle = self.cycle
        if cycle is not None and not cycle.response_started and CLOSE not in cycle.scope["headers"]:
            cycle.scope["headers"].append(CLOSE)

    def _close_if_idle(self) -> None:
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self.conn.send(h11.ConnectionClosed())
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (`Content-Length: abc`, a broken request line): the API's envelope,
        as JSON, where uvicorn sends a line of plain text."""
        message = f"a malformed HTTP request: {msg}"
        error = api.ErrorDetail(
            type="invalid_request_error", code="invalid_request", message=message, param=None
        )
        body = msgspec.json.encode(api.ErrorEnvelope(error=error, request_id=f"req_{uuid.uuid4().hex}"))
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        head = h11.Response(status_code=400, headers=headers, reason=b"Bad Request")
        for event in (head, h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _headers_too_slow(self) -> None:
        # Only between requests: a request whose headers arrived is the app's to answer, however long.
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()


class Server(uvicorn.Server):
    """uvicorn's server, except on Ctrl-C or SIGTERM: uvicorn shuts down gracefully and then raises the signal
    again, which ends the process in a KeyboardInterrupt traceback (and a cancelled lifespan's) after a clean
    stop. Here the signal only asks for the shutdown (a second one forces it, as in uvicorn)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        before = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)


def port_problem(host: str, port: int) -> str | None:
    """Why uvicorn could not listen on host:port (one line), found before anything loads; None if it can."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"--host {host}: {e.strerror}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is in use (another server?); choose another with --port"
            return f"cannot listen on {host}:{port}: {e.strerror}"
    return None


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


class ListeningLine(logging.Filter):
    """uvicorn's "Uvicorn running on URL" comes the moment the port is open, long before the model has
    loaded: said so, that nobody sends the first request then and waits on a 503."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("Uvicorn running on"):
            where = (
                record.getMessage()
                .removeprefix("Uvicorn running on ")
                .removesuffix(" (Press CTRL+C to quit)")
            )
            record.msg = (
                f"Listening on {where}; the model is loading, and a `ready` line follows (CTRL+C to quit)"
            )
            record.args = ()
            record.__dict__.pop("color_message", None)
        return True


def _log_config(log_level: str) -> dict:
    """uvicorn's logging, and spinf_jax's loggers (requests, loading and compiling) on stderr at the same
    level, as spinf_jax.progress formats them for that stream; a replica's lines say which it is."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["formatters"]["spinf_jax"] = {"()": formatter, "stream": "ext://sys.stderr"}
    config["handlers"]["spinf_jax"] = {
        "formatter": "spinf_jax",
        "class": "logging.StreamHandler",
        "stream": "ext://sys.stderr",
    }
    if REPLICA_VARIABLE in os.environ:
        config.setdefault("filters", {})["replica"] = {
            "()": ReplicaTag,
            "replica": os.environ[REPLICA_VARIABLE],
        }
        config["handlers"]["spinf_jax"]["filters"] = ["replica"]
    config.setdefault("filters", {})["listening"] = {"()": ListeningLine}
    config["handlers"]["default"]["filters"] = ["listening"]
    config["loggers"]["spinf_jax"] = {
        "handlers": ["spinf_jax"],
        "level": LOG_LEVELS[log_level],
        "propagate": False,
    }
    return config


@contextlib.contextmanager
def in_thread(app, log_level: str = "warning", timeout: float = 60) -> Iterator[str]:
    """uvicorn serving `app` on 127.0.0.1 on a thread of this process while the block runs: its URL, once it
    listens (the app may still be loading: /health says)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, name="spinf-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"uvicorn did not start on port {port}")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=120)
