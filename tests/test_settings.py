"""Fail-closed start-up (issue 13): `spinf-jax serve` checks every flag before it loads anything, reports
every problem at once, one line each naming the flag, and exits 2; `serve --check` stops after the checks."""

import subprocess
import sys
from types import SimpleNamespace

import pytest

from spinf_jax import cli
from spinf_jax.server import settings as settings_module

SECRET = "s3cret-Key_1"


@pytest.fixture
def serve(monkeypatch, capsys):
    """Runs `spinf-jax serve ARGS` in this process with $SPINF_API_KEY unset; it never serves: it returns
    (exit status, stdout, stderr lines, the Settings the server would have been created with)."""
    monkeypatch.delenv("SPINF_API_KEY", raising=False)
    created = []
    monkeypatch.setattr("spinf_jax.server.protocol.uvicorn_config", lambda app, *args, **kwargs: None)
    monkeypatch.setattr("uvicorn.Server.run", lambda server, sockets=None: None)
    app = SimpleNamespace(state=SimpleNamespace(server=SimpleNamespace(engine=None)))
    monkeypatch.setattr("spinf_jax.server.app.create_app", lambda s, **_: created.append(s) or app)
    monkeypatch.setattr("spinf_jax.server.protocol.port_problem", lambda host, port: None)
    monkeypatch.setattr("spinf_jax.engine.Engine.load", lambda *a, **k: pytest.fail("a model was loaded"))

    def run(*args: str):
        status = cli.main(["serve", "--compile-cache", "none", *args])
        out, err = capsys.readouterr()
        return status, out, err.splitlines(), created[-1] if created else None

    return run


def test_valid_settings_pass_the_check_and_load_nothing(serve, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"# the billing team's key\n{SECRET}\n\n  other-key-2  \r\n")
    status, out, err, created = serve(
        "--check", "--api-key-file", str(keys), "--metrics-auth", "--port", "9000"
    )
    assert (status, err, created) == (0, [], None)
    assert "2 API key(s), /metrics behind the key" in out and SECRET not in out


def test_serve_starts_with_the_settings_read(serve, tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("k-1\nk-2\n")
    status, _, _, settings = serve(
        "--api-key", "k-0", "--api-key-file", str(keys), "--api-key", "k-1", "--max-queue", "8", "--buckets",
        "256,1024", "--served-model-name", "alias", "--max-delay-ms", "2.5",
    )  # fmt: skip
    assert status == 0
    assert settings.api_keys == ("k-0", "k-1", "k-2")
    assert (settings.max_queue, settings.buckets, settings.served_names) == (8, (256, 1024), ("alias",))
    assert (settings.max_delay_ms, settings.metrics_auth, settings.warm_extraction) == (2.5, False, True)
    assert not serve("--no-warm-extraction")[3].warm_extraction
    assert settings.hold_back and not serve("--no-hold-back")[3].hold_back
    assert settings.remote_media_timeout_s is None and not settings.limits().allow_remote_media
    remote = serve("--allow-remote-media", "--remote-media-timeout", "2.5")[3].limits()
    assert (remote.allow_remote_media, remote.remote_media_timeout_s) == (True, 2.5)
    assert serve("--allow-remote-media")[3].limits().remote_media_timeout_s == 10


def test_every_problem_is_reported_at_once(serve, tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("# no keys yet\n\n")
    status, _, err, created = serve(
        "./no/such/model", "--precision", "fp16", "--api-key", f"{SECRET} two", "--api-key-file", str(empty),
        "--api-key-file", str(tmp_path / "missing"), "--max-queue", "0", "--max-delay-ms", "nan", "--port",
        "http", "--buckets", "256,300", "--served-model-name", " ", "--log-level", "loud", "--host", "",
    )  # fmt: skip
    assert (status, created) == (2, None)
    flags = [
        "MODEL", "--precision", "--api-key (#1)", f"--api-key-file '{empty}'",
        f"--api-key-file '{tmp_path / 'missing'}'", "--max-queue", "--max-delay-ms", "--buckets",
        "--served-model-name", "--host", "--port", "--log-level",
    ]  # fmt: skip
    assert sorted(err) == sorted(next(line for line in err if f"serve: {flag}" in line) for flag in flags)
    assert all(line.startswith("spinf-jax serve: ") for line in err)
    assert not any(SECRET in line for line in err)


@pytest.mark.parametrize(
    "args, environ, problem",
    [
        (["--metrics-auth"], {}, "--metrics-auth: there is no key to ask for"),
        ([], {"SPINF_API_KEY": ""}, "$SPINF_API_KEY: the key is empty"),
        (
            [],
            {"SPINF_API_KEY": "tab\tkey"},
            "$SPINF_API_KEY: the key has a character that is not visible ASCII",
        ),
        (["--api-key", "café"], {}, "--api-key (#1): the key has a character that is not visible ASCII"),
        (["--buckets", "256,1024,512"], {}, "--buckets: bucket sizes must be ascending"),
        (["--buckets", "2048,x"], {}, "--buckets: '2048,x' is not a comma-separated list"),
        (["--max-delay-ms", "-1"], {}, "--max-delay-ms: must be a number of milliseconds, 0 or more"),
        (["--port", "70000"], {}, "--port: must be from 1 to 65535, not 70000"),
        (["--device-memory-cap", "0"], {}, "--device-memory-cap: must be a number of GiB, above 0, not '0'"),
        (["--row-tile", "wide"], {}, "--row-tile: 'wide' is not a whole number"),
        (["--device-memory-cap", "lots"], {}, "--device-memory-cap: 'lots' is not a number"),
        (["--remote-media-timeout", "5"], {}, "--remote-media-timeout: only with --allow-remote-media"),
        (
            ["--allow-remote-media", "--remote-media-timeout", "0"],
            {},
            "--remote-media-timeout: must be a number of seconds, above 0, not '0'",
        ),
    ],
)
def test_one_problem_one_line(serve, monkeypatch, args, environ, problem):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    status, _, err, _ = serve("--check", *args)
    assert status == 2 and len(err) == 1 and problem in err[0], err


def test_random_weights_need_a_transformers_config(serve, tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "gemma3_text"}')
    assert serve("--random-weights", str(config))[3].random_weights == config
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")  # MODEL may be a folder of tokenizer files
    assert serve(str(tokenizer), "--random-weights", str(config), "--check")[0] == 0
    assert serve(str(tokenizer), "--check")[0] == 2  # not without --random-weights
    (tmp_path / "other.json").write_text('{"architectures": []}')
    (tmp_path / "broken.json").write_text("{")
    for name, problem in [("other.json", "no model_type"), ("broken.json", "cannot be read as JSON"),
                          ("missing.json", "cannot be read as JSON")]:  # fmt: skip
        status, _, err, _ = serve("--check", "--random-weights", str(tmp_path / name))
        assert status == 2 and len(err) == 1 and "--random-weights" in err[0] and problem in err[0], err


def test_the_key_variable_counts_only_without_key_flags(serve, monkeypatch):
    monkeypatch.setenv("SPINF_API_KEY", "from-the-environment")
    assert serve()[3].api_keys == ("from-the-environment",)
    assert serve("--api-key", "from-the-flag")[3].api_keys == ("from-the-flag",)
    status, _, err, _ = serve("--check", "--api-key-file", "/no/such/file")
    assert status == 2 and len(err) == 1  # an unreadable file does not fall back on the variable


def test_buckets_fit_the_backend_row_tile(serve, monkeypatch):
    """A GPU runs rows in tiles of 1,024, so its buckets are 2,048 tokens at least: known before loading."""
    monkeypatch.setattr(settings_module, "default_row_tile", lambda: 1024)
    status, _, err, _ = serve("--check", "--buckets", "1024,2048")
    assert status == 2 and "must be a multiple of 1024 and at least 2048" in err[0]
    assert serve("--check", "--buckets", "2048,4096")[0] == 0


def test_a_row_tile_is_checked_against_the_buckets(serve):
    """--row-tile: every bucket holds two tiles, the given buckets or the backend's defaults (256 to 6,144
    on the CPU), known before loading; the tile reaches the Settings."""
    status, _, err, settings = serve("--row-tile", "64", "--buckets", "256,512")
    assert (status, err, settings.row_tile, settings.buckets) == (0, [], 64, (256, 512))
    assert serve()[3].row_tile is None  # the backend's
    status, _, err, _ = serve("--check", "--row-tile", "256", "--buckets", "256,1024")
    assert status == 2 and len(err) == 1 and "serve: --buckets:" in err[0] and "at least 512" in err[0]
    status, _, err, _ = serve("--check", "--row-tile", "4096")
    assert status == 2 and len(err) == 1 and "serve: --row-tile:" in err[0] and "give --buckets" in err[0]


def test_local_models_must_exist_and_parse(serve, tmp_path):
    (tmp_path / "bare").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    (tmp_path / "weights.gguf").write_bytes(b"PK\x03\x04 a zip, not a GGUF file")
    (tmp_path / "good").mkdir()
    (tmp_path / "good" / "config.json").write_text("{}")
    (tmp_path / "model.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    for model, problem in [
        ("bare", "a folder without config.json or a single .gguf file"),
        ("broken", "cannot be read"),
        ("weights.gguf", "weights.gguf is not a GGUF file"),
        ("missing", "no such file or folder, and not a built-in name or a Hub id"),
    ]:
        status, _, err, _ = serve("--check", str(tmp_path / model))
        assert status == 2 and problem in err[0], err
    for model in [str(tmp_path / "good"), str(tmp_path / "model.gguf"), "google/gemma-3-1b-it"]:
        assert serve("--check", model)[0] == 0, model  # a Hub id is checked when it loads


def test_the_command_exits_2():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "spinf_jax.cli",
            "serve",
            "--check",
            "--max-queue",
            "0",
            "--compile-cache",
            "none",
        ],
        capture_output=True,
        text=True,
        env={"JAX_PLATFORMS": "cpu", "PATH": ""},
    )
    assert (done.returncode, done.stderr) == (2, "spinf-jax serve: --max-queue: must be at least 1, not 0\n")


def test_a_calibration_file_is_checked_before_anything_loads(serve, tmp_path):
    good = tmp_path / "calibration.json"
    good.write_text(
        '{"version": 1, "workloads": {"triage": {"temperature": 1.7}, "spam": {"temperature": 0.4}}}'
    )
    status, _, _, settings = serve("--calibration", str(good))
    assert status == 0
    assert {n: w.temperature for n, w in settings.calibration.workloads.items()} == {
        "triage": 1.7,
        "spam": 0.4,
    }
    bad = {
        "missing.json": None,
        "not-json.json": "{workloads",
        "empty.json": '{"workloads": {}}',
        "nan.json": '{"workloads": {"triage": {"temperature": NaN}}}',
        "low.json": '{"workloads": {"triage": {"temperature": 0.01}}}',
        "text.json": '{"workloads": {"triage": {"temperature": "1.0"}}}',
    }
    for name, text in bad.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        status, _, err, created = serve("--check", "--calibration", str(tmp_path / name))
        assert (status, len(err)) == (2, 1) and created is settings, name  # no server was created since
        assert err[0].startswith(f"spinf-jax serve: --calibration: {tmp_path / name}"), err
