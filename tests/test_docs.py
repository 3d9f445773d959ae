"""Every example in the docs runs, so none rots: README.md, docs/**/*.md and skills/**/SKILL.md.

Each file's blocks run in order against one test server on the default model (Gemma 3 270M, fp32, the
official packs loaded), its URL for localhost:8000 / 127.0.0.1:8000, in one temporary folder. Two runners:
- **a fresh shell**, the way a reader runs them (README: from the checkout, through `uv run`): every command
  as written in its own `bash -c`, with no virtual environment on PATH (so a bare `spinf-jax` is `command not
  found`, as for a reader), `UV_PROJECT` naming the checkout, curl failing on an error status (a curlrc with
  `fail-with-body`), `export` carried to the next commands, `serve` given `--check` (it validates every flag
  and file without loading, then exits), and the file's ```python blocks executed in order by one `uv run
  python` process, as one program saved to a file would be (tests/docs_python.py);
- **in process**, cheap where an example loads a model: ```python blocks executed in one namespace,
  ```sh / ```bash blocks read a command at a time (`curl` sent with httpx and answering 2xx, heredocs
  written, `uv run spinf-jax ...` run through cli.main), with `Engine.load` of the two built-in models handing
  back the session's engines, so no example costs a second load.
Commands that need a machine of their own (docker, installers, git) are listed in NOT_RUN; any other command
the in-process runner does not know fails the test.
The fast tier runs each file's first example in process. CI (the slow tier) runs every example of a file in a
fresh shell where none loads a model (tests/conftest.py then drops the fast tier's copy), and in process where
one does; the full tier runs those in a fresh shell too.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
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
    assert not command.startswith("spinf-jax"), (
        f"a command from a checkout runs as `uv run spinf-jax ...` (README): {command}"
    )
    argv = program(command)
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


def loads_a_model(path: Path) -> bool:
    """Whether a file's examples load a model in the reader's process: Python that builds an Engine, or a
    command that scores (without --url) or calibrates there."""
    for lang, code in blocks(path):
        if lang == "python":
            if "Engine" in code:
                return True
            continue
        for argv in map(program, commands(code)):
            if argv[0] == "spinf-jax" and (
                (argv[1] == "score" and "--url" not in argv) or "calibrate" in argv[1:3]
            ):
                return True
    return False


def program(command: str) -> list[str]:
    """The argv of the program a command runs (`uv run`'s own options dropped; a heredoc is `cat`)."""
    if HEREDOC.fullmatch(command):
        return ["cat"]
    argv = shlex.split(command.replace("\\\n", ""))  # a shell drops a backslash-newline
    return _after_uv_options(argv[2:]) if argv[:2] == ["uv", "run"] else argv


RUNNABLE = [p for p in DOCS if blocks(p)]
BY_PATH = {"argvalues": RUNNABLE, "ids": lambda p: str(p.relative_to(REPO))}
IN_A_FRESH_SHELL = {
    "argvalues": [
        pytest.param(p, marks=pytest.mark.full if loads_a_model(p) else pytest.mark.slow) for p in RUNNABLE
    ],
    "ids": BY_PATH["ids"],
}
IN_PROCESS = {"argvalues": [p for p in RUNNABLE if loads_a_model(p)], "ids": BY_PATH["ids"]}


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
@pytest.mark.parametrize("path", **IN_PROCESS)
def test_the_examples_run(path, default_url, engines, tmp_path, monkeypatch):
    """Every example of a file that loads a model, in order, in process (the first again: the later ones may
    build on it)."""
    run_blocks(path, None, default_url, monkeypatch, tmp_path)


SHELL_LOCAL = re.compile(r"(https?://)?(?:localhost|127\.0\.0\.1):8000")


@pytest.fixture(scope="module")
def reader_env(tmp_path_factory) -> dict[str, str]:
    """A reader's shell in the checkout: no virtual environment on PATH, uv on it, curl failing on errors."""
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed here")
    venv = str(REPO / ".venv")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env = {k: v for k, v in env.items() if not k.startswith("SPINF_")}
    paths = [p for p in env.get("PATH", "").split(os.pathsep) if p and not p.startswith(venv)]
    curlrc = tmp_path_factory.mktemp("curl")
    (curlrc / ".curlrc").write_text("fail-with-body\nshow-error\n")
    env |= {"PATH": os.pathsep.join([str(Path(uv).parent), *paths]), "UV_PROJECT": str(REPO),
            "CURL_HOME": str(curlrc)}  # fmt: skip
    bare = subprocess.run(
        ["bash", "-c", "command -v spinf-jax || true"], env=env, capture_output=True, text=True
    )
    assert not bare.stdout.startswith(venv), "the reader's shell must not see the test's venv"
    return env


def run_in_a_fresh_shell(path: Path, url: str, env: dict[str, str], folder: Path) -> None:
    """Every example of `path` as a reader runs it (the module's docstring), in `folder`."""
    hostport = url.split("://", 1)[1]
    env = {**env, "SPINF_BASE_URL": url}
    python = None
    try:
        for lang, code in blocks(path):
            if lang == "python":
                if python is None:
                    python = subprocess.Popen(
                        ["uv", "run", "python", str(REPO / "tests" / "docs_python.py")], cwd=folder, env=env,
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                    )  # fmt: skip
                python.stdin.write(json.dumps({"code": LOCAL.sub(url, code), "path": str(path)}) + "\n")
                python.stdin.flush()
                reply = python.stdout.readline()
                assert reply, f"{path.name}: the example's Python process ended"
                error = json.loads(reply)["error"]
                assert error is None, f"{path.name}:\n{code}\n→ {error}"
                continue
            for command in commands(code):
                argv = program(command)
                if argv[0] in NOT_RUN and not command.startswith("uv run"):
                    continue
                if argv[0] == "export":  # the reader's shell keeps it for the next commands
                    name, value = argv[1].split("=", 1)
                    env[name] = LOCAL.sub(url, value)
                    continue
                shell = SHELL_LOCAL.sub(lambda m: (m.group(1) or "") + hostport, command)
                if argv[:2] == ["spinf-jax", "serve"]:
                    shell += " --check"
                done = subprocess.run(
                    ["bash", "-c", shell], cwd=folder, env=env, capture_output=True, text=True, timeout=600
                )
                said = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
                assert done.returncode == 0, f"{path.name}: {command}\n→ exit {done.returncode}\n{said}"
    finally:
        if python is not None:
            python.stdin.close()
            python.wait(timeout=60)


@pytest.mark.parametrize("path", **IN_A_FRESH_SHELL)
def test_the_examples_run_in_a_fresh_shell(path, default_url, reader_env, tmp_path):
    """Every example of the file, in order, as a reader's shell runs it (the slow tier where the file's
    examples load no model, the full tier where they do)."""
    run_in_a_fresh_shell(path, default_url, reader_env, tmp_path)


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


@pytest.mark.slow  # a uv run each
@pytest.mark.parametrize(
    ("example", "said"),
    [
        ("```sh\ncurl -s localhost:8000/v1/nothing\n```", "404"),  # curl fails on an error status
        ("```sh\nspinf-jax --version\n```", "command not found"),  # a reader's shell has no venv
        ("```python\nraise ValueError('wrong')\n```", "ValueError: wrong"),
    ],
)
def test_a_fresh_shell_fails_where_a_reader_would(example, said, default_url, reader_env, tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(f"# A doc\n\n{example}\n")
    with pytest.raises(AssertionError, match=said):
        run_in_a_fresh_shell(doc, default_url, reader_env, tmp_path)
