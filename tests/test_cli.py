"""The command line's own words: its version, and help text printed as written."""

import subprocess
import sys
from importlib.metadata import version

import pytest

from spinf_jax import cli


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"spinf-jax {version('spinf-jax')}"


@pytest.mark.parametrize("command", ["calibrate", "score", "serve", "packs", "parity", "quantize"])
def test_help_prints_no_format_escapes(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    assert "%%" not in capsys.readouterr().out


def test_help_answers_without_importing_jax():
    """`spinf-jax --help` and every command's: the parser alone, so they answer at once (JAX's import took
    3.5 s of `--help` on the 2-core machine). A fresh interpreter, as the test session has JAX imported."""
    code = """
import contextlib, io, sys
from spinf_jax import cli
for command in ([], ["serve"], ["score"], ["calibrate"], ["packs"], ["parity"], ["quantize"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        cli.main([*command, "--help"])
print("jax" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.slow  # a subprocess that imports the package
def test_a_reader_that_leaves_early_gets_no_traceback():
    """`spinf-jax packs schema | head`, the reader gone before the command writes: it ends quietly."""
    command = [sys.executable, "-m", "spinf_jax.cli", "packs", "schema"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()  # long before the package has imported and printed
    _, err = process.communicate(timeout=120)
    assert process.returncode == 0 and "Error" not in err, err[-2000:]


def test_a_busy_port_is_one_line_before_anything_loads(capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    said = f"port {port} on 127.0.0.1 is in use (another server?); choose another with --port"
    assert err == f"spinf-jax serve: {said}\n"


@pytest.mark.slow  # a server of its own, in a subprocess
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_and_sigterm_stop_the_server_quietly(sig, tmp_path):
    """One Ctrl-C (or SIGTERM) after `ready`: uvicorn's graceful shutdown, exit status 0, no traceback; and
    the start-up said where it listens and that the model is loading, without JAX's backend noise."""
    import signal
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    err_path = tmp_path / "err.log"
    command = [
        sys.executable,
        "-m",
        "spinf_jax.cli",
        "serve",
        "--port",
        str(port),
        "--precision",
        "fp32",
        "--buckets",
        "256",  # one small program to compile, and no extraction programs: the test is about stopping
        "--no-warm-extraction",
    ]
    with err_path.open("w") as err:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 300
        while '"ready"' not in err_path.read_text() and process.poll() is None:
            assert time.monotonic() < deadline, err_path.read_text()[-2000:]
            time.sleep(0.5)
        process.send_signal(getattr(signal, sig))
        assert process.wait(timeout=120) == 0, err_path.read_text()[-3000:]
    said = err_path.read_text()
    assert "Traceback" not in said and "CancelledError" not in said and "libtpu" not in said, said[-3000:]
    assert f"Listening on http://127.0.0.1:{port}; the model is loading" in said
    assert f'"url": "http://127.0.0.1:{port}"' in said and "Application shutdown complete" in said
