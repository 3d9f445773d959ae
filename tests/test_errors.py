"""Error codes are defined once (spinf_jax.errors.CODES), documented (docs/api.md), the only ones raised."""

import ast
import re
from pathlib import Path

import pytest

from spinf_jax.errors import CODES, ScoringError

REPO = Path(__file__).resolve().parent.parent
# Where a code is the n-th positional argument of a call, and helpers that stand for one code.
CODE_ARGUMENT = {"ScoringError": 0, "ApiError": 0, "_coded": 0}
HELPERS = {
    "_invalid": "invalid_request",
    "_unknown": "unknown_placeholder",
    "_bad_template": "invalid_template",
}


def _raised_codes() -> dict[str, list[str]]:
    """Every code the package's source raises, with where."""
    found: dict[str, list[str]] = {}
    for path in sorted((REPO / "spinf_jax").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", getattr(node.func, "attr", None))
            code = HELPERS.get(name)
            at = CODE_ARGUMENT.get(name)
            if at is not None and len(node.args) > at and isinstance(node.args[at], ast.Constant):
                code = node.args[at].value
            if code is not None:
                found.setdefault(code, []).append(f"{path.relative_to(REPO)}:{node.lineno}")
    found.pop("http_error", None)  # named in a mapping (server/errors.py), not a call
    return found


def test_every_code_raised_is_defined():
    raised = _raised_codes()
    assert len(raised) >= 25, raised  # the scan sees the raise sites
    undefined = {code: where for code, where in raised.items() if code not in CODES}
    assert not undefined


def test_docs_list_exactly_the_defined_codes_with_their_status():
    rows = re.findall(r"^\| `([a-z_]+)` \| (\d{3}) \|", (REPO / "docs" / "api.md").read_text(), re.M)
    assert dict((code, int(status)) for code, status in rows) == {c: s for c, (s, _) in CODES.items()}


def test_an_undefined_code_cannot_be_raised():
    with pytest.raises(ValueError, match="not defined"):
        ScoringError("made_up_code", "no such code")
    assert ScoringError("not_supported", "later").status == 501
