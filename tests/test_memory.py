"""Device memory: what a pass needs is known before serving, and running out during a pass fails that
request alone."""

import os
from types import SimpleNamespace

import jax
from litestar.testing import TestClient

from spinf_jax.models.params import nbytes
from spinf_jax.server import memory
from spinf_jax.server.app import Settings, create_app
from tests.serving import loaded

BODY = {
    "messages": [{"content": "Hello there."}],
    "scoring": {"queries": [{"id": "q", "template": "\n\nAnswer:{?}", "options": [" yes", " no"]}]},
}


def test_device_bytes_needed_counts_weights_and_the_largest_pass(gemma_engine):
    weights = nbytes(gemma_engine.model.decoder)
    needed = gemma_engine.device_bytes_needed()
    largest = gemma_engine.program(gemma_engine.buckets.largest).memory_analysis()
    assert needed >= weights + largest.temp_size_in_bytes
    assert needed < weights * 1.5  # a 1,024-token pass of a 270M model is small beside its weights


def test_out_of_memory_in_a_pass_fails_that_request_and_the_server_goes_on(gemma_engine, monkeypatch):
    app = create_app(Settings("spinf/gemma-3-270m"), gemma_engine)
    with TestClient(app) as client:
        assert loaded(client)["status"] == "ok"
        before = client.post("/v1/score", json=BODY).json()["results"]
        engine = app.state.server.engine
        real = engine.launch

        def exhausted(trees, cuts=None, behind=None):
            # What XLA raises when an allocation fails mid-pass (jaxlib's XlaRuntimeError text).
            raise RuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 12884901888 bytes."
            )

        monkeypatch.setattr(engine, "launch", exhausted)
        response = client.post("/v1/score", json=BODY)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "out_of_memory"
        assert int(response.headers["retry-after"]) >= 1
        monkeypatch.setattr(engine, "launch", real)
        after = client.post("/v1/score", json=BODY)
        assert after.status_code == 200 and after.json()["results"] == before


def test_health_reports_device_memory(gemma_engine):
    app = create_app(Settings("spinf/gemma-3-270m"), gemma_engine)
    with TestClient(app) as client:
        memory = loaded(client)["memory"]
        assert memory["needed_bytes"] == gemma_engine.device_bytes_needed()
        # The CPU backend keeps no allocator statistics: absent rather than zero.
        assert ("in_use_bytes" in memory) == (jax.default_backend() != "cpu")


def test_a_model_that_does_not_fit_the_cap_is_refused(gemma_engine):
    needed = gemma_engine.device_bytes_needed()
    cap = round(needed / 2**30 - 0.01, 2)
    app = create_app(Settings("spinf/gemma-3-270m", device_memory_cap_gib=cap), gemma_engine)
    with TestClient(app) as client:
        health = loaded(client)
        assert health["status"] == "error"
        assert f"need {needed / 2**30:.2f} GiB, over --device-memory-cap {cap:g} GiB" in health["error"]
        response = client.post("/v1/score", json=BODY)
        assert response.status_code == 503 and response.json()["error"]["code"] == "model_failed"


def test_the_cap_holds_the_gpu_allocator(monkeypatch):
    """On a machine with an NVIDIA GPU (nvidia-smi answers), the cap becomes JAX's memory fraction."""
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.setattr(memory.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(
        memory.subprocess, "run", lambda *a, **k: SimpleNamespace(returncode=0, stdout="143771\n143771\n")
    )
    memory.cap_device_memory(40)
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == f"{40 * 1024 / 143771:.4f}"
    monkeypatch.setattr(memory.shutil, "which", lambda name: None)  # no GPU: nothing to hold
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    memory.cap_device_memory(40)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ
