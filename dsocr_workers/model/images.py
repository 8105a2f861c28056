"""Opening untrusted image files: a format allowlist and a pixel limit checked from the header before
anything is decoded, EXIF rotation as the vendor applies it, and an `InputError` with a reason a person
can act on. Pillow only, no torch: `dsocr submit` probes every listed file with it.
"""

from __future__ import annotations

import io
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageOps, UnidentifiedImageError

from dsocr_workers.errors import InputError

# Pillow format names we decode. MPO is how Pillow names many phone JPEGs.
ALLOWED_FORMATS = frozenset({"PNG", "JPEG", "MPO", "WEBP", "TIFF", "BMP", "GIF", "PPM", "JPEG2000"})
NO_SUCH_FILE = "no such file"
# 64 megapixels: a 600-dpi A3 scan fits; a 30000x30000 decompression bomb (900 MP) does not.
MAX_PIXELS = 64_000_000


@dataclass(frozen=True)
class ImageProbe:
    format: str
    width: int  # as stored, before any EXIF rotation
    height: int
    mode: str


# ---------------------------------------------------------------------------------------------------
# Loading untrusted images


def _describe(source: object) -> str:
    return str(source) if isinstance(source, (str, os.PathLike)) else f"<{type(source).__name__}>"


def _check_file(path: Path) -> None:
    if not path.exists():
        raise InputError(f"{path}: {NO_SUCH_FILE}")
    if not path.is_file():
        raise InputError(f"{path}: not a regular file")
    if path.stat().st_size == 0:
        raise InputError(f"{path}: empty file")
    if not os.access(path, os.R_OK):
        raise InputError(f"{path}: not readable (permission denied)")


def _identify_any(fp: str | Path | io.BytesIO) -> str | None:
    """The format Pillow sees in the bytes, trying every plugin; None when it is no image at all.
    Only the header is parsed (nothing is decoded), to tell 'format not allowed' from 'not an image'."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(fp) as im:
                return im.format
    except Exception:
        return None


def _check_pixels(width: int, height: int, max_pixels: int, name: str) -> None:
    if width <= 0 or height <= 0:
        raise InputError(f"{name}: image has no pixels ({width}x{height})")
    if width * height > max_pixels:
        raise InputError(
            f"{name}: image too large: {width}x{height} = {width * height:,} pixels exceeds the limit of "
            f"{max_pixels:,} (a possible decompression bomb)"
        )


def _opener_formats() -> list[str]:
    # MPO has no opener of its own: the JPEG opener returns it. Image.init() loads every plugin once.
    Image.init()
    return sorted(f for f in ALLOWED_FORMATS if f in Image.OPEN)


def _open(fp: str | Path | io.BytesIO, name: str, max_pixels: int) -> Image.Image:
    """Image.open restricted to the allowlist, with our pixel limit instead of Pillow's warning."""
    try:
        # Pillow warns above its own pixel limit (ours is the one that counts) and about odd metadata
        # ("Corrupt EXIF data"); an untrusted file either opens or raises, so its warnings are noise.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            im = Image.open(fp, formats=_opener_formats())
    except Image.DecompressionBombError as exc:
        raise InputError(f"{name}: image too large (a possible decompression bomb): {exc}") from None
    except UnidentifiedImageError:
        if isinstance(fp, io.BytesIO):
            fp.seek(0)
        found = _identify_any(fp)
        if found is not None:
            raise InputError(
                f"{name}: image format {found} is not allowed; allowed: {', '.join(sorted(ALLOWED_FORMATS))}"
            ) from None
        raise InputError(f"{name}: not an image (the bytes match no known image format)") from None
    except OSError as exc:
        raise InputError(f"{name}: cannot read: {exc}") from None
    except Exception as exc:  # a corrupt header can trip a plugin in many ways; all mean bad input
        raise InputError(f"{name}: corrupt image header: {exc}") from None
    try:
        _check_pixels(im.width, im.height, max_pixels, name)
    except InputError:
        im.close()
        raise
    return im


def probe_image(path: str | os.PathLike, *, max_pixels: int = MAX_PIXELS) -> ImageProbe:
    """Validate a file from its bytes (not its extension) without decoding the pixels."""
    p = Path(path)
    _check_file(p)
    with _open(p, str(p), max_pixels) as im:
        return ImageProbe(format=im.format or "", width=im.width, height=im.height, mode=im.mode)


def load_image(
    source: str | os.PathLike | bytes | Image.Image, *, max_pixels: int = MAX_PIXELS
) -> Image.Image:
    """Open, fully decode, EXIF-transpose and convert to RGB, as the vendor does (spec §3.1).

    Alpha is dropped, not composited (vendor `convert("RGB")`)."""
    name = _describe(source)
    if isinstance(source, Image.Image):
        im = source
        _check_pixels(im.width, im.height, max_pixels, name)
    elif isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise InputError(f"{name}: empty image data")
        im = _open(io.BytesIO(bytes(source)), name, max_pixels)
    elif isinstance(source, (str, os.PathLike)):
        p = Path(source)
        _check_file(p)
        im = _open(p, name, max_pixels)
    else:
        raise InputError(f"cannot load an image from a {type(source).__name__}")
    try:
        return _decode_upright_rgb(im, name, owned=im is not source)
    finally:
        if im is not source:
            im.close()  # multi-frame formats keep their file open until closed


def _decode_upright_rgb(im: Image.Image, name: str, owned: bool = False) -> Image.Image:
    """`im` decoded, upright and RGB: a new image. An `owned` one (opened here) is turned in place, so the
    page is copied once (by `convert`), not twice."""
    try:
        im.load()
    except MemoryError:
        raise
    except Exception as exc:  # truncated or corrupt data: decoders raise OSError, SyntaxError, ValueError…
        raise InputError(f"{name}: cannot decode image (truncated or corrupt): {exc}") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Corrupt EXIF data": tolerated, like the vendor does
            if owned:
                ImageOps.exif_transpose(im, in_place=True)
                upright = im
            else:
                upright = ImageOps.exif_transpose(im)
    except Exception:  # the vendor falls back to the image as stored on any EXIF trouble
        upright = im
    try:
        with warnings.catch_warnings():
            # Pillow's advice for palette images with transparency; dropping alpha is the vendor's choice.
            warnings.filterwarnings("ignore", "Palette images with Transparency", UserWarning)
            return upright.convert("RGB")
    except Exception as exc:
        raise InputError(f"{name}: cannot convert image mode {upright.mode} to RGB: {exc}") from None
