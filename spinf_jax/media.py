"""Images in the content: decoding, preprocessing as the model's transformers processor does, and the tokens
an image stands as in the content. The engine sees token ids plus, for an image's soft-token rows, the tower's
output (spinf_jax.models.siglip, gemma4_vision); this layer makes the pixels and the ids (spinf_jax.audio: the
same for audio).

Preprocessing follows transformers' PIL image processor (`Gemma3ImageProcessorPil`, the one that needs no
torchvision): RGB, a resize to the tower's square with PIL's filter, then rescale in float64 and normalise in
float32. transformers' default torchvision processor resizes with its own kernels, so its pixels can differ
from these in the last bits of a few values.
"""

import base64
import binascii
import dataclasses
import hashlib
import io
import json
import math
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
    """How a model reads an image: its preprocessing (the checkpoint's preprocessor_config.json), the arrays
    its tower takes, and the tokens the image stands as in the content: `gap` text, the start token, one
    image token per soft token, the end token, `gap` text."""

    resample: int  # a PIL resampling filter
    rescale: float
    start_id: int
    end_id: int
    image_id: int
    gap: str

    def soft_count(self, size: tuple[int, int], param: str) -> int:
        """How many soft tokens an image of `size` (width, height) becomes; MediaError if it can't be read."""
        raise NotImplementedError

    def tower_inputs(self, image: Image.Image, param: str) -> tuple[np.ndarray, ...]:
        """The image as the tower reads it (one shape for every image: one compiled program)."""
        raise NotImplementedError

    def _rescaled(self, rgb: Image.Image) -> np.ndarray:
        """[H, W, 3] float32, as transformers' processors rescale: in float64, then cast."""
        return (np.asarray(rgb).astype(np.float64) * self.rescale).astype(np.float32)

    @staticmethod
    def from_checkpoint(config: dict, folder: Path | None) -> "ImageFormat | None":
        """The format a checkpoint's config.json (and its folder's preprocessor_config.json, if any) describe;
        None for a model that reads no images."""
        vision = config.get("vision_config")
        if vision is None:
            return None
        pre = folder / "preprocessor_config.json" if folder is not None else None
        p = json.loads(pre.read_text()) if pre is not None and pre.is_file() else {}
        if config.get("model_type") == "gemma4":
            video = folder / "video_preprocessor_config.json" if folder is not None else None
            v = json.loads(video.read_text()) if video is not None and video.is_file() else {}
            return PatchedImages.from_config(config, p, v)
        return SquareImages.from_config(config, p)


def _rgb(image: Image.Image) -> Image.Image:
    return image if image.mode == "RGB" else image.convert("RGB")


@dataclass(frozen=True)
class SquareImages(ImageFormat):
    """Gemma 3: every image resized to one square (transformers' Gemma3ImageProcessorPil: RGB, PIL's resize,
    rescale, normalise in float32) and read as `soft_tokens` soft tokens; the processor writes
    "\n\n<start_of_image>", the image tokens, "<end_of_image>\n\n"."""

    height: int = 896
    width: int = 896
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    soft_tokens: int = 256

    @staticmethod
    def from_config(config: dict, p: dict) -> "SquareImages":
        if p.get("do_pan_and_scan"):
            raise ValueError("pan-and-scan image crops (do_pan_and_scan) are not supported")
        side = config["vision_config"]["image_size"]
        size = p.get("size") or {"height": side, "width": side}
        return SquareImages(
            resample=p.get("resample", Image.Resampling.BILINEAR),
            rescale=p.get("rescale_factor", 1 / 255),
            start_id=config.get("boi_token_index", config.get("boi_token_id")),
            end_id=config.get("eoi_token_index", config.get("eoi_token_id")),
            image_id=config.get("image_token_index", config.get("image_token_id")),
            gap="\n\n",
            height=size["height"],
            width=size["width"],
            mean=tuple(p.get("image_mean", (0.5, 0.5, 0.5))),
            std=tuple(p.get("image_std", (0.5, 0.5, 0.5))),
            soft_tokens=config.get("mm_tokens_per_image", 256),
        )

    def soft_count(self, size: tuple[int, int], param: str) -> int:
        return self.soft_tokens

    def tower_inputs(self, image: Image.Image, param: str) -> tuple[np.ndarray]:
        """([3, height, width] float32,)."""
        rescaled = self._rescaled(_rgb(image).resize((self.width, self.height), self.resample))
        mean, std = np.array(self.mean, np.float32), np.array(self.std, np.float32)
        return (((rescaled - mean) / std).transpose(2, 0, 1),)


@dataclass(frozen=True)
class PatchedImages(ImageFormat):
    """Gemma 4: an image keeps its aspect ratio. It is resized (unless it already fits) to the largest size
    whose sides are multiples of pool × patch pixels and whose patches fit the budget of max_soft_tokens ×
    pool² (transformers' Gemma4ImageProcessorPil: RGB, PIL's resize, rescale, no normalisation), cut into
    patches, and read as patches / pool² soft tokens; the processor writes "<|image>", the image tokens,
    "<image|>", with nothing around them."""

    patch: int = 16
    pool: int = 3
    max_soft_tokens: int = 280  # the processor's budget (one of 70, 140, 280, 560, 1120)
    # Video frames: images read at the video processor's (smaller) budget, their soft tokens video tokens.
    video_id: int | None = None
    frame_soft_tokens: int = 70

    def frames(self) -> "PatchedImages":
        """The format of a video's frames: this one at the video budget."""
        return dataclasses.replace(self, max_soft_tokens=self.frame_soft_tokens)

    @staticmethod
    def from_config(config: dict, p: dict, video: dict) -> "PatchedImages":
        """From config.json, preprocessor_config.json (p) and video_preprocessor_config.json (video)."""
        vision = config["vision_config"]
        if p.get("do_normalize"):
            raise ValueError("Gemma 4 images normalised by a mean and std (do_normalize) are not supported")
        return PatchedImages(
            resample=p.get("resample", Image.Resampling.BICUBIC),
            rescale=p.get("rescale_factor", 1 / 255),
            start_id=config.get("boi_token_id", 255_999),
            end_id=config.get("eoi_token_id", 258_882),
            image_id=config.get("image_token_id", 258_880),
            gap="",
            patch=p.get("patch_size", vision.get("patch_size", 16)),
            pool=p.get("pooling_kernel_size", vision.get("pooling_kernel_size", 3)),
            max_soft_tokens=p.get("max_soft_tokens", 280),
            video_id=config.get("video_token_id"),
            frame_soft_tokens=video.get("max_soft_tokens", 70),
        )

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pool**2

    def resized(self, size: tuple[int, int], param: str) -> tuple[int, int]:
        """(width, height) an image of `size` (width, height) is read at; raises MediaError for an image too
        small to hold one soft token's square."""
        width, height = size
        side = self.pool * self.patch
        factor = math.sqrt(self.max_patches * self.patch**2 / (width * height))
        w, h = math.floor(factor * width / side) * side, math.floor(factor * height / side) * side
        longest = self.max_soft_tokens * side  # the processor's cap when one side rounds to zero
        if w == 0 and h == 0:
            too_small = f"a {width}x{height} image is too small for one {side}x{side} square"
            raise MediaError("invalid_media", f"{param}: {too_small}")
        if h == 0:
            h, w = side, min(width // height * side, longest)
        elif w == 0:
            w, h = side, min(height // width * side, longest)
        return w, h

    def soft_count(self, size: tuple[int, int], param: str) -> int:
        w, h = self.resized(size, param)
        return (w // self.patch) * (h // self.patch) // self.pool**2

    def tower_inputs(self, image: Image.Image, param: str) -> tuple[np.ndarray, np.ndarray]:
        """(patches [max_patches, patch² · 3] float32: each patch's pixels by row, column, channel; positions
        [max_patches, 2] int32: each patch's (x, y) on the image's grid), the image's patches row-major, then
        zero patches at position (-1, -1) up to the budget."""
        rgb = _rgb(image)
        w, h = self.resized(rgb.size, param)
        pixels = self._rescaled(rgb if rgb.size == (w, h) else rgb.resize((w, h), self.resample))
        p, across, down = self.patch, w // self.patch, h // self.patch
        patches = pixels.reshape(down, p, across, p, 3).transpose(0, 2, 1, 3, 4).reshape(down * across, -1)
        y, x = np.mgrid[0:down, 0:across]
        positions = np.stack([x.ravel(), y.ravel()], -1).astype(np.int32)
        pad = self.max_patches - len(patches)
        return (
            np.pad(patches, ((0, pad), (0, 0))),
            np.pad(positions, ((0, pad), (0, 0)), constant_values=-1),
        )


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


def image_size(data: bytes, param: str) -> tuple[int, int]:
    """An image file's (width, height), from its header (the pixels are decoded by open_image)."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size
    except Exception as e:  # Pillow raises many kinds for a file it cannot identify
        raise MediaError("invalid_media", f"{param}: not an image Pillow can read ({e})") from None


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
