"""One server process per device: what `serve --devices` and `score --devices` run (docs/scale-out.md).

Each replica is `spinf-jax serve` pinned to one device, the same single-device program as ever, so its
scores are the bits one device gives; a request may go to any of them. On NVIDIA GPUs a replica sees only its
own card (CUDA_VISIBLE_DEVICES: no other card's memory is touched); elsewhere (the CPU, with forced host
devices in the tests) it is told which of the process's devices to use (DEVICE_VARIABLE).

The replicas share the compile cache: the first one compiles and fills it, the others start once it is ready
and done compiling (its /health lists no `compiling` buckets) and read the programs from it, so a cold start
costs one compile, not one per device, and the first replica serves meanwhile. A replica whose process
exits is started again on the same device and port; requests go to the others until it is ready.
"""

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from spinf_jax.progress import log

DEVICE_VARIABLE = "SPINF_JAX_DEVICE"  # a replica's device: an index into jax.devices() (not on GPUs)
REPLICA_VARIABLE = "SPINF_JAX_REPLICA"  # a replica's number, added to its log lines
LOG = logging.getLogger("spinf_jax.replicas")
POLL_S = 0.5  # how often the supervisor looks at the replicas
# A ready replica's /health is answered by its event loop, not its engine: a replica busy with a long pass
# still answers at once. One that has not answered for HEALTH_DEADLINE_S is stuck (stopped, hung): it is
# marked down, and the front passes its requests in flight to another replica. Stuck for STUCK_RESTART_S, its
# process is killed and started again (as an exit would be).
HEALTH_DEADLINE_S = 5.0
STUCK_RESTART_S = 60.0
# A replica that exits this many times within RESTART_WINDOW_S is left failed, not started again.
MAX_RESTARTS, RESTART_WINDOW_S = 3, 600.0
_PROBE = "import json, jax; d = jax.devices(); print(json.dumps([d[0].platform, len(d)]))"


@dataclass(frozen=True)
class Devices:
    """The devices a process started from this environment sees, and what pins a replica to each."""

    platform: str  # jax's name: "gpu", "cpu", "tpu"
    ids: tuple[str, ...]  # on GPUs the CUDA device ids (what CUDA_VISIBLE_DEVICES lists), else jax indices

    def pinned(self, environ: Mapping[str, str], index: int) -> dict[str, str]:
        """The environment of a replica on device `index`."""
        if self.platform == "gpu":
            return {**environ, "CUDA_VISIBLE_DEVICES": self.ids[index]}
        return {**environ, DEVICE_VARIABLE: self.ids[index]}

    def name(self, index: int) -> str:
        return f"{self.platform}:{self.ids[index]}"


def probe(environ: Mapping[str, str]) -> Devices:
    """Ask a child process which devices there are: the parent never starts a backend, so on GPUs it holds no
    device memory (and a replica's card is all the replica's)."""
    env = {**environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        raise RuntimeError(f"could not list the devices: {done.stderr.strip().splitlines()[-1:]}")
    platform, count = json.loads(done.stdout.strip().splitlines()[-1])
    visible = environ.get("CUDA_VISIBLE_DEVICES", "")
    if platform == "gpu" and visible:
        ids = tuple(v.strip() for v in visible.split(",") if v.strip())[:count]
    else:
        ids = tuple(str(i) for i in range(count))
    return Devices(platform, ids)


def how_many(asked: str, devices: Devices) -> int:
    """`--devices all|N` against what there is."""
    if asked == "all":
        return len(devices.ids)
    try:
        n = int(asked)
    except ValueError:
        raise ValueError(f"--devices: {asked!r} is not 'all' or a whole number") from None
    if not 1 <= n <= len(devices.ids):
        raise ValueError(
            f"--devices: {n} asked, and this host has {len(devices.ids)} {devices.platform} device(s)"
        )
    return n


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(eq=False)
class Replica:
    index: int
    device: str  # "gpu:0", "cpu:1"
    url: str
    state: str = "starting"  # starting | ready | down (stopped answering; looked at again) | failed
    compiling: bool = False  # ready, with buckets still compiling in the background
    in_flight: int = 0
    restarts: int = 0
    error: str | None = None
    process: subprocess.Popen | None = None
    env: dict[str, str] | None = field(default=None, repr=False)
    exits: list[float] = field(default_factory=list, repr=False)  # when its process exited
    answered: float = field(default_factory=time.monotonic, repr=False)  # its /health's last answer


class Replicas:
    """The replicas and the choice among them. `spawn` starts and supervises server processes; a Replicas
    over running servers' URLs (the tests) only routes."""

    def __init__(self, members: Sequence[Replica], headers: Mapping[str, str] | None = None):
        self.members = list(members)
        self.headers = dict(headers or {})  # what the supervisor sends with its /health checks
        self._lock = threading.Lock()
        self._turn = 0  # among replicas equally loaded, the next one after the last chosen
        self._closing = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._command: list[str] = []  # spawn's
        self._stagger = False

    @classmethod
    def spawn(
        cls,
        serve_args: Sequence[str],
        devices: Devices,
        count: int,
        environ: Mapping[str, str],
        headers: Mapping[str, str] | None = None,
        stagger: bool = True,
    ) -> "Replicas":
        """`spinf-jax serve SERVE_ARGS` on 127.0.0.1, once per device of the first `count`, from `start()` on;
        with `stagger`, the first alone until it is ready (it fills the compile cache the others read)."""
        members = []
        for i in range(count):
            url = f"http://127.0.0.1:{free_port()}"
            env = devices.pinned(environ, i) | {REPLICA_VARIABLE: str(i)}
            members.append(Replica(i, devices.name(i), url, env=env))
        replicas = cls(members, headers)
        replicas._command = [sys.executable, "-m", "spinf_jax.cli", "serve", *serve_args]
        replicas._command += ["--host", "127.0.0.1"]
        replicas._stagger = stagger
        return replicas

    def start(self) -> None:
        """Start the processes of `spawn`, and their supervisor (nothing for replicas not spawned)."""
        if not self._command or self._supervisor is not None:
            return
        for member in self.members[: 1 if self._stagger else len(self.members)]:
            self._start(member)
        self._supervisor = threading.Thread(target=self._supervise, name="spinf-replicas", daemon=True)
        self._supervisor.start()

    def _start(self, replica: Replica) -> None:
        port = replica.url.rsplit(":", 1)[1]
        replica.process = subprocess.Popen([*self._command, "--port", port], env=replica.env)
        replica.state, replica.error = "starting", None
        replica.answered = time.monotonic()
        log(LOG, "replica_started", replica=replica.index, device=replica.device, pid=replica.process.pid)

    def _supervise(self) -> None:
        with httpx.Client(timeout=HEALTH_DEADLINE_S, headers=self.headers) as http:
            while not self._closing.wait(POLL_S):
                for replica in self.members:
                    self._look_at(replica, http)
                self._start_waiting()

    def _start_waiting(self) -> None:
        """The replicas not started yet (stagger), once the first has compiled every bucket or failed."""
        waiting, first = [r for r in self.members if r.process is None], self.members[0]
        if waiting and first.state != "starting" and not first.compiling:
            for replica in waiting:
                self._start(replica)

    def _look_at(self, replica: Replica, http: httpx.Client) -> None:
        process = replica.process
        if process is None or replica.state == "failed":
            return
        if process.poll() is not None:
            now = time.monotonic()
            replica.exits = [t for t in replica.exits if now - t < RESTART_WINDOW_S] + [now]
            log(LOG, "replica_exited", logging.WARNING, replica=replica.index, code=process.returncode)
            if len(replica.exits) > MAX_RESTARTS:
                replica.state = "failed"
                replica.error = f"its process exited {len(replica.exits)} times in {RESTART_WINDOW_S:g} s"
                return
            replica.restarts += 1
            self._start(replica)
            return
        try:
            health = http.get(f"{replica.url}/health").json()
        except (httpx.HTTPError, ValueError):
            self._unanswered(replica)  # not listening yet, or stuck
            return
        replica.answered = time.monotonic()
        if health.get("ready"):
            replica.compiling = bool(health.get("compiling"))
            if replica.state != "ready":
                replica.state, replica.error = "ready", None
                log(LOG, "replica_ready", replica=replica.index, device=replica.device)
        elif health.get("status") == "error":
            replica.state, replica.error = "failed", health.get("error")

    def _unanswered(self, replica: Replica) -> None:
        """A replica whose /health did not answer within HEALTH_DEADLINE_S: once ready, it is stuck (marked
        down: no requests, and those in flight go elsewhere); stuck STUCK_RESTART_S, it is restarted."""
        if replica.state == "starting":
            replica.answered = time.monotonic()  # loading: its port may not be open yet
            return
        silent = time.monotonic() - replica.answered
        if replica.state == "ready":
            replica.state = "down"
            replica.error = f"its /health did not answer within {HEALTH_DEADLINE_S:g} s"
            log(LOG, "replica_stuck", logging.WARNING, replica=replica.index, silent_s=round(silent, 1))
        elif replica.state == "down" and silent > STUCK_RESTART_S and replica.process is not None:
            log(LOG, "replica_restarted", logging.WARNING, replica=replica.index, silent_s=round(silent, 1))
            replica.process.kill()  # SIGKILL reaches a stopped process too; the exit restarts it
            replica.process.wait(timeout=30)
            replica.restarts += 1
            self._start(replica)
            replica.answered = time.monotonic()

    def pick(self, skip: Sequence[Replica] = ()) -> Replica | None:
        """The ready replica with the fewest requests in flight (not one of `skip`); None if there is none."""
        with self._lock:
            n = len(self.members)
            order = [self.members[(self._turn + i) % n] for i in range(n)]
            ready = [r for r in order if r.state == "ready" and r not in skip]
            if not ready:
                return None
            chosen = min(ready, key=lambda r: r.in_flight)
            self._turn = (chosen.index + 1) % n
            return chosen

    @contextlib.contextmanager
    def using(self, replica: Replica) -> Iterator[Replica]:
        """Count a request in flight on `replica` while the block runs."""
        with self._lock:
            replica.in_flight += 1
        try:
            yield replica
        finally:
            with self._lock:
                replica.in_flight -= 1

    def lost(self, replica: Replica) -> None:
        """A request found the replica not answering: no more requests until its /health answers again."""
        if replica.state == "ready":
            replica.state = "down"
            log(LOG, "replica_down", logging.WARNING, replica=replica.index)
            if replica.process is None:  # not supervised: nothing else will look at it
                replica.state = "failed"

    @property
    def starting(self) -> bool:
        return any(r.state in ("starting", "down") for r in self.members)

    def wait_ready(self, timeout: float, every: bool = False) -> None:
        """Until one replica is ready (`every`: all of them); RuntimeError once that cannot happen (a replica
        failed where all are needed, or all failed), or at the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            ready = [r.state == "ready" for r in self.members]
            if all(ready) or (any(ready) and not every):
                return
            failed = [r for r in self.members if r.state == "failed"]
            if failed and (every or len(failed) == len(self.members)):
                first = failed[0]
                raise RuntimeError(f"replica {first.index} ({first.device}) failed: {first.error}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replicas were not ready after {timeout:g} s")
            time.sleep(POLL_S)

    def close(self, timeout: float = 60) -> None:
        """Stop supervising, then stop every replica (SIGTERM: requests in flight are answered first)."""
        self._closing.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        running = [r.process for r in self.members if r.process is not None and r.process.poll() is None]
        for process in running:
            process.terminate()
        deadline = time.monotonic() + timeout
        for process in running:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()


def pin_this_process(environ: Mapping[str, str]) -> None:
    """In a replica: use the device DEVICE_VARIABLE names (GPU replicas see one card and need nothing)."""
    if DEVICE_VARIABLE in environ:
        import jax

        jax.config.update("jax_default_device", jax.devices()[int(environ[DEVICE_VARIABLE])])


def outlive_no_front(environ: Mapping[str, str], every_s: float = 1.0) -> threading.Thread | None:
    """In a replica: stop (SIGTERM, so requests in flight are answered) once the front that started it is
    gone. A front killed outright cannot stop its replicas, and they would hold their GPUs and ports."""
    if REPLICA_VARIABLE not in environ:
        return None
    front = os.getppid()

    def watch():
        while os.getppid() == front:  # an orphan is adopted by another process
            time.sleep(every_s)
        log(LOG, "front_gone", logging.WARNING, replica=environ[REPLICA_VARIABLE])
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="spinf-front-watch", daemon=True)
    thread.start()
    return thread


def serve_args(argv: Sequence[str], dropped: Sequence[str] = ("--devices", "--host", "--port")) -> list[str]:
    """`serve`'s arguments for a replica: the front's, less the flags (and their values) that are the front's
    own."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in dropped:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out
