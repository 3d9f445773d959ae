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


@pytest.mark.slow  # a subprocess that imports the package
def test_a_reader_that_leaves_early_gets_no_traceback():
    """`spinf-jax packs schema | head`, the reader gone before the command writes: it ends quietly."""
    command = [sys.executable, "-m", "spinf_jax.cli", "packs", "schema"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()  # long before the package has imported and printed
    _, err = process.communicate(timeout=120)
    assert process.returncode == 0 and "Error" not in err, err[-2000:]
