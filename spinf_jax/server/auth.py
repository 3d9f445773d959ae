"""API keys: who may call the scoring routes (and /metrics, with `--metrics-auth`).

A request shows a key as `Authorization: Bearer <key>` or as `x-api-key: <key>`. Every credential it sends
must be one of the server's keys: a wrong key in either header is refused whatever the other one says, so is
an Authorization header of another scheme (a bare key included), and so is a request with neither.

Keys are compared in constant time: the SHA-256 of what was sent against that of each of the server's keys,
with hmac.compare_digest, and against all of them before deciding. The time taken then says nothing of how
much of a key matched, of its length, or of which key it was.
"""

import hashlib
import hmac
from collections.abc import Iterable

from litestar.datastructures import Headers


class ApiKeys:
    def __init__(self, keys: Iterable[str]):
        self._digests = tuple(_digest(key) for key in dict.fromkeys(keys))

    def admit(self, headers: Headers) -> bool:
        """Whether a request with these headers may pass; any may when the server has no keys."""
        if not self._digests:
            return True
        sent = [_bearer(value) for value in headers.getall("authorization", [])]
        sent += headers.getall("x-api-key", [])
        known = [key is not None and self._known(key) for key in sent]  # each one compared, none skipped
        return bool(known) and all(known)

    def _known(self, key: str) -> bool:
        digest = _digest(key)
        matches = [hmac.compare_digest(digest, known) for known in self._digests]  # no exit at a match
        return any(matches)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _bearer(authorization: str) -> str | None:
    """The key in `Bearer <key>` (the scheme's name in any case, RFC 7235); None for anything else."""
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return key.strip()
