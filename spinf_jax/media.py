"""Images in the content: decoding, preprocessing as the model's transformers processor does, and the tokens
an image stands as in the content. The engine sees token ids plus, for an image's soft-token rows, the tower's
output (spinf_jax.models.siglip); this layer makes the pixels and the ids.

Preprocessing follows transformers' PIL image processor (`Gemma3ImageProcessorPil`, the one that needs no
torchvision): RGB, a resize to the tower's square with PIL's filter, then rescale in float64 and normalise in
float32. transformers' default torchvision processor resizes with its own kernels, so its pixels can differ
from these in the last bits of a few values.
"""

import base64
import binascii
import hashlib
import io
import json
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

# An image of more pixels than this is refused before it is decoded (Pillow's own guard, raised to an error).
MAX_IMAGE_PIXELS = 50_000_000
# What a remote image URL may be (--allow-remote-media), redirects included: never plain http.
REMOTE_SCHEMES = ("https",)


class MediaError(ValueError):
    """A media part that cannot be read: `code` is the API error code, the message says why."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ImageFormat:
    """How a model reads an image: its preprocessing (the checkpoint's preprocessor_config.json) and the
    tokens it takes in the content (Gemma 3's processor writes "\\n\\n<start_of_image>", `soft_tokens`
    image tokens and "<end_of_image>\\n\\n" where the image is)."""

    height: int
    width: int
    resample: int  # a PIL resampling filter
    rescale: float
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    soft_tokens: int
    start_id: int
    end_id: int
    image_id: int

    @staticmethod
    def from_checkpoint(config: dict, folder: Path | None) -> "ImageFormat | None":
        """The format a checkpoint's config.json (and its folder's preprocessor_config.json, if any) describe;
        None for a model that reads no images."""
        vision = config.get("vision_config")
        if vision is None:
            return None
        pre = folder / "preprocessor_config.json" if folder is not None else None
        p = json.loads(pre.read_text()) if pre is not None and pre.is_file() else {}
        if p.get("do_pan_and_scan"):
            raise ValueError("pan-and-scan image crops (do_pan_and_scan) are not supported")
        side = vision["image_size"]
        size = p.get("size") or {"height": side, "width": side}
        return ImageFormat(
            height=size["height"],
            width=size["width"],
            resample=p.get("resample", Image.Resampling.BILINEAR),
            rescale=p.get("rescale_factor", 1 / 255),
            mean=tuple(p.get("image_mean", (0.5, 0.5, 0.5))),
            std=tuple(p.get("image_std", (0.5, 0.5, 0.5))),
            soft_tokens=config.get("mm_tokens_per_image", 256),
            start_id=config.get("boi_token_index", config.get("boi_token_id")),
            end_id=config.get("eoi_token_index", config.get("eoi_token_id")),
            image_id=config.get("image_token_index", config.get("image_token_id")),
        )

    def pixels(self, image: Image.Image) -> np.ndarray:
        """[3, height, width] float32: the image as the tower reads it."""
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        resized = np.asarray(rgb.resize((self.width, self.height), self.resample))  # [H, W, 3] uint8
        rescaled = (resized.astype(np.float64) * self.rescale).astype(np.float32)
        mean, std = np.array(self.mean, np.float32), np.array(self.std, np.float32)
        return ((rescaled - mean) / std).transpose(2, 0, 1)


def decode_data_url(url: str, param: str) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL."""
    head, comma, body = url.partition(",")
    if not comma or not head.startswith("data:") or not head.endswith(";base64"):
        raise MediaError("invalid_media", f"{param}: an image is given as a data:image/...;base64,... URL")
    if not head.removeprefix("data:").startswith("image/"):
        raise MediaError(
            "unsupported_media", f"{param}: {head.removeprefix('data:').split(';')[0]!r} is not an image type"
        )
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError("invalid_media", f"{param}: the data URL is not valid base64 ({e})") from None


class _SameSchemes(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to a URL of an allowed scheme (an https:// image may not lead to http://)."""

    def __init__(self, schemes: tuple[str, ...]):
        self.schemes = schemes

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme not in self.schemes:
            raise urllib.error.URLError(f"redirected to {newurl!r}, not an {'/'.join(self.schemes)} URL")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def fetch(url: str, param: str, *, max_bytes: int, timeout_s: float) -> bytes:
    """The bytes of an image at a remote URL: an image/* response of at most max_bytes, read whole within
    timeout_s (the connection, every read and the download together). Only a server started with
    --allow-remote-media calls this: the server then reaches whatever URL a request names."""
    schemes = REMOTE_SCHEMES
    if urllib.parse.urlsplit(url).scheme not in schemes:
        raise MediaError("invalid_media", f"{param}: a remote image URL is {'/'.join(schemes)}://...")
    deadline = time.monotonic() + timeout_s
    opener = urllib.request.build_opener(_SameSchemes(schemes))
    request = urllib.request.Request(url, headers={"User-Agent": "spinf-jax", "Accept": "image/*"})
    try:
        with opener.open(request, timeout=timeout_s) as response:
            kind = response.headers.get_content_type()
            if not kind.startswith("image/"):
                raise MediaError("unsupported_media", f"{param}: {url} is {kind!r}, not an image type")
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise MediaError("invalid_media", f"{param}: {int(declared):,} bytes; at most {max_bytes:,}")
            data = bytearray()
            while chunk := response.read1(64 * 1024):  # what has come, not a whole 64 KiB
                data += chunk
                if len(data) > max_bytes:
                    raise MediaError("invalid_media", f"{param}: more than {max_bytes:,} bytes")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not read whole within {timeout_s:g} s")
            return bytes(data)
    except MediaError:
        raise
    except urllib.error.HTTPError as e:
        raise MediaError("media_unreachable", f"{param}: {url} answered {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:  # TimeoutError is an OSError
        reason = getattr(e, "reason", e)
        raise MediaError("media_unreachable", f"{param}: could not fetch {url} ({reason})") from None


def open_image(data: bytes, param: str) -> Image.Image:
    """Decode an image file's bytes (every format Pillow reads; the first frame of an animation)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise MediaError(
                    "invalid_media",
                    f"{param}: {image.width}x{image.height} pixels; at most {MAX_IMAGE_PIXELS:,}",
                )
            image.load()
    except MediaError:
        raise
    except Exception as e:  # Pillow raises many kinds for a corrupt or truncated file
        raise MediaError("invalid_media", f"{param}: not an image Pillow can read ({e})") from None
    return image


def digest(data: bytes) -> str:
    """What identifies an image's soft tokens for a model: the file's bytes."""
    return hashlib.sha256(data).hexdigest()
