"""Every example in the docs runs, so none rots: README.md, docs/**/*.md and skills/**/SKILL.md.

Each file's blocks run in order, in one temporary folder, against one test server on the default model
(Gemma 3 270M, fp32, the official packs loaded):
- ```python blocks are executed in one namespace per file, with the server's URL for localhost:8000;
- ```sh / ```bash blocks are read a command at a time: `curl` is sent with httpx and must answer 2xx,
  `cat > FILE <<'EOF'` writes the file, `mkdir -p DIR` makes the folder, `export K=V` sets the variable,
  `uv run spinf-jax ...` (how a reader runs it from a checkout; a bare `spinf-jax` fails the test, as a
  shell outside the venv would) runs in process (`serve` with `--check`, which validates every flag and
  file without loading), and the few commands that need a machine of their own (docker, installers) are
  listed in NOT_RUN. Any other command fails the test.
The fast tier runs each file's first example; the slow tier (CI) every example of each file, and then the
fast tier's copy is deselected (tests/conftest.py).
`Engine.load` of the two built-in models hands back the session's engines (fp32 whatever precision is asked),
so an example that loads a model costs no second load.
"""

import re
import shlex
from pathlib import Path

import httpx
import pytest

from spinf_jax import cli
from spinf_jax.engine import Engine

REPO = Path(__file__).resolve().parent.parent
DOCS = [
    REPO / "README.md",
    *sorted((REPO / "docs").rglob("*.md")),
    *sorted((REPO / "skills").rglob("SKILL.md")),
]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
LOCAL = re.compile(r"https?://(?:localhost|127\.0\.0\.1):8000")
# Commands shown for a machine of their own: they start servers or containers, or install things.
NOT_RUN = ("docker", "uv", "pip", "python3", "git", "nvidia-smi")
HEREDOC = re.compile(r"^cat > (\S+) <<'?(\w+)'?\n(.*?)^\2$", re.S | re.M)


def blocks(path: Path) -> list[tuple[str, str]]:
    """(language, code) of every fenced block that is a runnable example."""
    return [
        (lang, code) for lang, code in FENCE.findall(path.read_text()) if lang in ("python", "sh", "bash")
    ]


def commands(code: str) -> list[str]:
    """A shell block's commands: heredocs whole, lines joined over `\\` and open quotes, comments dropped."""
    out, pending = [], ""
    pos = 0
    for match in HEREDOC.finditer(code):
        out += commands(code[pos : match.start()])
        out.append(match.group(0))
        pos = match.end()
    if pos:
        return out + commands(code[pos:])
    for line in code.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line + "\n"
        if line.endswith("\\"):
            continue
        try:
            shlex.split(pending)
        except ValueError:  # a quote still open: the command goes on
            continue
        out.append(pending.strip())
        pending = ""
    assert not pending, f"unterminated command: {pending}"
    return out


def curl(argv: list[str], url: str) -> httpx.Response:
    """The curl options the docs use: -s, -S, -f, -H, -d/--data(-binary) (@file too), -X, and the URL."""
    headers, data, method, target = {}, None, None, None
    args = iter(argv[1:])
    for arg in args:
        if arg in ("-s", "-S", "-sS", "-f", "-fsS", "--silent", "--fail"):
            continue
        if arg in ("-H", "--header"):
            name, value = next(args).split(":", 1)
            headers[name.strip()] = value.strip()
        elif arg in ("-d", "--data", "--data-binary"):
            data = next(args)
            data = Path(data[1:]).read_bytes() if data.startswith("@") else data.encode()
        elif arg in ("-X", "--request"):
            method = next(args)
        else:
            assert not arg.startswith("-"), f"curl option {arg} is not understood by the docs runner"
            target = arg
    target = LOCAL.sub(url, target if "://" in target else f"http://{target}")
    return httpx.request(
        method or ("POST" if data else "GET"), target, headers=headers, content=data, timeout=300
    )


def run_command(command: str, url: str, setenv=None) -> None:
    if heredoc := HEREDOC.fullmatch(command):
        Path(heredoc.group(1)).write_text(heredoc.group(3))
        return
    argv = shlex.split(command.replace("\\\n", ""))  # a shell drops a backslash-newline
    assert argv[0] != "spinf-jax", (
        f"a command from a checkout runs as `uv run spinf-jax ...` (README): {command}"
    )
    if argv[:2] == ["uv", "run"]:  # how the docs run commands from a checkout: the command after uv's options
        argv = _after_uv_options(argv[2:])
    if argv[0] == "export":
        name, value = argv[1].split("=", 1)
        setenv(name, LOCAL.sub(url, value))
    elif argv[0] == "mkdir":
        for folder in argv[1:]:
            if not folder.startswith("-"):
                Path(folder).mkdir(parents=True, exist_ok=True)
    elif argv[0] == "curl":
        reply = curl(argv, url)
        assert reply.is_success, f"{command}\n→ {reply.status_code} {reply.text}"
    elif argv[0] == "spinf-jax":
        argv = [LOCAL.sub(url, a) for a in argv[1:]]
        if argv[0] == "serve":
            argv.append("--check")
        assert cli.main(argv) == 0, command
    else:
        assert argv[0] in NOT_RUN, f"the docs runner does not know how to run: {command}"


def _after_uv_options(argv: list[str]) -> list[str]:
    """`uv run [--extra X]... [--] COMMAND ...` → COMMAND ...; the docs' uv options take a value or none."""
    with_value = {"--extra", "--with", "--python", "--group", "--package"}
    while argv and argv[0].startswith("-"):
        option = argv.pop(0)
        if option == "--":
            break
        if option in with_value:
            argv.pop(0)
    return argv


@pytest.fixture
def engines(gemma_engine, smollm_engine, monkeypatch):
    """Engine.load of a built-in model gives the session's engine."""
    loaded = {"spinf/gemma-3-270m": gemma_engine, "spinf/smollm2-135m-instruct": smollm_engine}
    load = Engine.load.__func__

    def cached(cls, spec="spinf/gemma-3-270m", precision="bf16", **kwargs):
        return loaded[spec] if spec in loaded else load(cls, spec, precision, **kwargs)

    monkeypatch.setattr(Engine, "load", classmethod(cached))


RUNNABLE = [p for p in DOCS if blocks(p)]
BY_PATH = {"argvalues": RUNNABLE, "ids": lambda p: str(p.relative_to(REPO))}


def run_blocks(path: Path, count: int | None, url: str, monkeypatch, tmp_path: Path) -> None:
    """The first `count` runnable blocks of a file (all: None), in order, in one namespace."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPINF_BASE_URL", url)
    monkeypatch.delenv("SPINF_API_KEY", raising=False)
    namespace: dict = {}
    for lang, code in blocks(path)[:count]:
        if lang == "python":
            exec(compile(LOCAL.sub(url, code), str(path), "exec"), namespace)
            continue
        for command in commands(code):
            run_command(command, url, monkeypatch.setenv)


@pytest.mark.parametrize("path", **BY_PATH)
def test_the_first_example_runs(path, default_url, engines, tmp_path, monkeypatch):
    """The fast tier's check of every file: its first example."""
    run_blocks(path, 1, default_url, monkeypatch, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("path", **BY_PATH)
def test_the_examples_run(path, default_url, engines, tmp_path, monkeypatch):
    """Every example of the file, in order (the first again: the later ones may build on it)."""
    run_blocks(path, None, default_url, monkeypatch, tmp_path)


def test_the_runner_reads_commands_as_a_shell_would():
    code = """# a comment
curl -s localhost:8000/v1/score -H 'content-type: application/json' -d '{
  "a": 1
}'
spinf-jax score in.jsonl \\
    --out out.jsonl
cat > q.json <<'EOF'
[1, 2]
EOF
export SPINF_API_KEY=k
"""
    assert commands(code) == [
        "curl -s localhost:8000/v1/score -H 'content-type: application/json' -d '{\n  \"a\": 1\n}'",
        "spinf-jax score in.jsonl \\\n    --out out.jsonl",
        "cat > q.json <<'EOF'\n[1, 2]\nEOF",
        "export SPINF_API_KEY=k",
    ]
    with pytest.raises(AssertionError, match="does not know how to run"):
        run_command("rm -rf /tmp/x", "http://127.0.0.1:1")
    with pytest.raises(AssertionError, match="runs as `uv run spinf-jax"):  # a reader's shell has no venv
        run_command("spinf-jax --version", "http://127.0.0.1:1")


def test_the_runner_joins_continued_lines_and_makes_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SPINF_API_KEY", raising=False)
    run_command("mkdir -p out/plots", "http://127.0.0.1:1")
    assert (tmp_path / "out" / "plots").is_dir()
    # one command over two lines: serve --check must exit 0 with both flags read
    run_command(
        "uv run --extra server spinf-jax serve --port 8001 \\\n    --max-queue 8", "http://127.0.0.1:1"
    )


@pytest.mark.slow  # subprocesses through uv, each importing the package
def test_a_fresh_shell_in_the_checkout_runs_what_the_docs_write():
    """The way the docs run things from a checkout works in a shell outside the test's venv: `uv run
    spinf-jax ...` finds the command, `uv run python` imports the package (a bare `spinf-jax` there is
    `command not found`, which the docs therefore never write)."""
    import os
    import shutil
    import subprocess

    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed here")
    venv = str(REPO / ".venv")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    paths = [p for p in env.get("PATH", "").split(os.pathsep) if p and not p.startswith(venv)]
    env["PATH"] = os.pathsep.join([str(Path(uv).parent), *paths])

    def shell(command: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=600)  # fmt: skip

    bare = shell("command -v spinf-jax || echo none")
    assert bare.stdout.strip() == "none" or not bare.stdout.startswith(venv)
    version = shell("uv run --extra server --extra models spinf-jax --version")
    assert version.returncode == 0 and version.stdout.startswith("spinf-jax "), version.stderr[-2000:]
    client = shell("uv run python -c 'import spinf_jax.client, sys; print(\"jax\" in sys.modules)'")
    assert client.returncode == 0, client.stderr[-2000:]
