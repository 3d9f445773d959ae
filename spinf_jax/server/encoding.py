"""Compressed request bodies: `Content-Encoding: zstd`, `gzip` or `deflate` on every route. The System One SDK
sends every body of 1 KiB or more zstd-compressed by default (Python 3.14, or its `zstd` extra), so a server
that cannot read them breaks drop-in use.

The compressed body is held to the limit of a plain body, and so is its decompressed size: a small body that
would inflate past it (a "zip bomb") is refused 413 after at most `limit` + 1 bytes of output, nothing else
done. A body that is not what its encoding says is a 400.
"""

import io
import zlib
from collections.abc import Callable

import zstandard
from litestar.exceptions import HTTPException
from litestar.types import ASGIApp, Receive, Scope, Send

ENCODINGS = ("zstd", "gzip", "deflate")


def decompress(raw: bytes, encoding: str, limit: int) -> bytes:
    """At most limit + 1 bytes of output, whatever the input claims: the caller refuses more than limit."""
    if encoding == "zstd":
        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw), read_across_frames=True)
        return reader.read(limit + 1)
    d = zlib.decompressobj(zlib.MAX_WBITS | 16 if encoding == "gzip" else zlib.MAX_WBITS)
    out = d.decompress(raw, limit + 1)
    if not d.eof and len(out) <= limit:
        raise zlib.error("the stream ends early")
    return out


def decompressing(app: ASGIApp, limit: int) -> ASGIApp:
    """ASGI middleware: a body with a Content-Encoding of ENCODINGS reaches the app decompressed, its headers
    saying so (no Content-Encoding, no Content-Length); other encodings are refused."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        headers = scope["headers"]
        encoding = next(
            (v.decode("latin-1").strip().lower() for k, v in headers if k == b"content-encoding"), ""
        )
        if encoding in ("", "identity"):
            return await app(scope, receive, send)
        kept = [(k, v) for k, v in headers if k not in (b"content-encoding", b"content-length")]
        scope = {**scope, "headers": kept}
        return await app(scope, _reader(receive, encoding, limit), send)

    return middleware


def _reader(receive: Receive, encoding: str, limit: int) -> Callable:
    """A `receive` that gives the whole body decompressed in one message, or raises the HTTP error."""
    done = False

    async def read():
        nonlocal done
        if done:
            return await receive()
        done = True
        if encoding not in ENCODINGS:
            raise HTTPException(
                status_code=400,
                detail=f"Content-Encoding {encoding!r} is not read here: send zstd, gzip or none",
            )
        raw = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message  # the client left
            raw += message.get("body", b"")
            if len(raw) > limit:
                raise HTTPException(status_code=413)
            if not message.get("more_body", False):
                break
        try:
            body = decompress(bytes(raw), encoding, limit)
        except (zlib.error, zstandard.ZstdError) as exc:
            raise HTTPException(status_code=400, detail=f"the body is not valid {encoding}: {exc}") from None
        if len(body) > limit:
            raise HTTPException(status_code=413)
        return {"type": "http.request", "body": bytes(body), "more_body": False}

    return read
