"""The command line's own words: its version, and help text printed as written."""

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
