"""docs/notebook.py (a jupytext notebook) runs top to bottom on the default model, as a user would run it."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parent.parent / "docs" / "notebook.py"


@pytest.mark.slow  # a subprocess that imports JAX, loads the default model and compiles
def test_notebook_runs():
    out = subprocess.run([sys.executable, str(NOTEBOOK)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    # Every section printed what it shows: scores, floors, a layer's Params, hidden states, token level.
    assert re.search(r"^refund \{' yes': 0\.\d+, ' no': 0\.\d+\}", text, re.M)
    assert re.search(r"billing +p 0\.\d+ +floor 0\.\d+ +lift", text)
    assert re.search(r"^averaged: \{'billing': 0\.\d+, 'shipping': 0\.\d+, 'tech': 0\.\d+\}", text, re.M)
    assert re.search(r"^top (billing|shipping|tech) agreement (0|1)\.\d+", text, re.M)
    assert "model.layers.3.self_attn.q_proj.weight" in text
    assert "(19, 1, 640)" in text  # 18 layers + the final output, one row, 640 wide
    assert re.search(r"log P\( yes\), log P\( no\): \[-\d", text)
