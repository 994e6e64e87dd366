"""What an encoded image's header says, read without decoding a pixel: format, stored size, EXIF
orientation, and for a JPEG its coding (which decoders can take it) and whether its data reaches
an end-of-image marker. The request limits (body size, pixels, smallest side) are checked here,
before any decoding work: a decompression bomb of a few kilobytes declaring a gigapixel is
refused before any pixel is allocated.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import (  # the plugins of every accepted format, so Image.open(formats=...) knows them
    BmpImagePlugin,  # noqa: F401
    GifImagePlugin,  # noqa: F401
    Image,
    JpegImagePlugin,  # noqa: F401
    PngImagePlugin,  # noqa: F401
    TiffImagePlugin,  # noqa: F401
    UnidentifiedImageError,
    WebPImagePlugin,  # noqa: F401
)

from handlers.ground.errors import ClientError
from handlers.ground.limits import ImageLimits

# Pillow opens MPO files through its JPEG plugin and reports format "MPO".
ACCEPTED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF")
ACCEPTED_NAMES = "JPEG, PNG, WebP, BMP, GIF or TIFF"
EXIF_ORIENTATION_TAG = 0x0112
EXIF_ORIENTATIONS = range(1, 9)

# JPEG markers (ITU T.81, table B.1)
SOI, EOI, SOS = b"\xff\xd8", b"\xff\xd9", 0xDA
START_OF_FRAME = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}   # not DHT, JPG, DAC
STANDALONE = frozenset(range(0xD0, 0xD8)) | {0x01}                   # RSTn, TEM: no length
# Frame types nvJPEG decodes: baseline, extended sequential and progressive, Huffman-coded.
# Lossless, hierarchical and arithmetic-coded JPEGs are not among them.
HUFFMAN_DCT_FRAMES = frozenset({0xC0, 0xC1, 0xC2})
# The segments that may stand between the scans of one frame (a progressive or non-interleaved
# JPEG's): SOS, DHT, DQT, DRI, DNL, COM, APPn. Any other marker after the first scan (a second
# SOF, an SOI, a code T.81 does not define) is one libjpeg refuses or reads its own way.
BETWEEN_SCANS = frozenset({SOS, 0xC4, 0xDB, 0xDD, 0xDC, 0xFE, *range(0xE0, 0xF0)})
EOI_CODE = 0xD9
# After 0xFF in entropy-coded data: a stuffed 0x00, a fill byte, or a restart marker (or TEM);
# MARKS[byte] is True for any other byte, i.e. where 0xFF and that byte make a marker.
MARKS = np.ones(256, dtype=bool)
MARKS[[0x00, 0xFF, *STANDALONE]] = False


@dataclass(frozen=True)
class JpegCoding:
    """A JPEG's frame as its markers give it: frame type (the SOFn marker's second byte), sample
    precision, component count, where its first scan starts, whether an end-of-image marker
    follows it (without one, libjpeg runs out of data and torchvision refuses the file as
    truncated; entropy-coded data cannot contain one, its 0xFF bytes being stuffed), and whether
    every marker from there to that end is one that may stand between scans (`plain_markers`:
    libjpeg refuses a file with an unknown marker code, "Unsupported marker type", where nvJPEG
    may decode it, so such a file is left to the CPU, which gives the CPU's answer or error)."""

    frame: int
    precision_bits: int
    components: int
    scan_offset: int
    ends: bool
    plain_markers: bool = True
    # How many pixels share a chroma sample (horizontal, vertical): (2, 2) for 4:2:0, (2, 1)
    # for 4:2:2, (1, 1) for 4:4:4 and grey; (0, 0) when the two chroma planes differ or do not
    # divide luma's sampling.
    chroma_factors: tuple[int, int] = (1, 1)

    @property
    def device_decodable(self) -> bool:
        """nvJPEG (through torchvision) decodes it to the same kind of image as the CPU: 8-bit
        Huffman-coded DCT, grey or YCbCr (not CMYK / YCCK), and complete."""
        return (self.frame in HUFFMAN_DCT_FRAMES and self.precision_bits == 8
                and self.components in (1, 3) and self.ends and self.plain_markers)

    @property
    def progressive(self) -> bool:
        return self.frame in (0xC2, 0xC6, 0xCA, 0xCE)


@dataclass(frozen=True)
class ImageHeader:
    """Format, stored size and EXIF orientation (1..8; 1 when absent or not a valid value); for
    WebP whether it is animated; for a JPEG its coding (None when its markers cannot be read,
    which leaves it to the CPU decoders and their errors)."""

    image_format: str
    width: int
    height: int
    orientation: int = 1
    animated: bool = False
    jpeg: JpegCoding | None = None

    @property
    def pixels(self) -> int:
        return self.width * self.height


def read_jpeg_coding(data: bytes) -> JpegCoding | None:
    """The frame header and first scan of JPEG bytes, by walking the marker segments; None if
    they are malformed before the first scan."""
    if not data.startswith(SOI):
        return None
    frame: tuple[int, int, int] | None = None
    factors = (1, 1)
    position = 2
    while position + 4 <= len(data):
        if data[position] != 0xFF:
            return None
        marker = data[position + 1]
        if marker == 0xFF:          # fill byte
            position += 1
            continue
        if marker in STANDALONE:
            position += 2
            continue
        length = int.from_bytes(data[position + 2:position + 4], "big")
        if marker in START_OF_FRAME and position + 10 <= len(data):
            frame = (marker, data[position + 4], data[position + 9])
            factors = chroma_factors(data[position + 10:position + 2 + length], frame[2])
        if marker == SOS:
            if frame is None:
                return None
            ends, plain = walk_scans(data, position + 2 + length)
            return JpegCoding(frame[0], frame[1], frame[2], position, ends, plain, factors)
        position += 2 + length
    return None


def chroma_factors(specs: bytes, components: int) -> tuple[int, int]:
    """From a frame header's component specifications (3 bytes each: id, sampling factors as
    two nibbles, quantisation table): pixels per chroma sample, as `JpegCoding.chroma_factors`."""
    if components != 3:
        return (1, 1)
    if len(specs) < 9:
        return (0, 0)
    (luma_h, luma_v), cb, cr = ((byte >> 4, byte & 0x0F) for byte in specs[1:9:3])
    if cb != cr or 0 in cb or luma_h % cb[0] or luma_v % cb[1]:
        return (0, 0)
    return (luma_h // cb[0], luma_v // cb[1])


def walk_scans(data: bytes, start: int) -> tuple[bool, bool]:
    """From the first scan's entropy-coded data at `start`: (an end-of-image marker is reached,
    every marker before it is one that may stand between scans). The segments between scans are
    stepped over by their lengths; the 0xFF bytes of entropy-coded data are found at once."""
    body = np.frombuffer(data, dtype=np.uint8)
    after_ff = np.flatnonzero(body[start:-1] == 0xFF)
    markers = after_ff[MARKS[body[start + 1:][after_ff]]]      # offsets from `start`
    resume = start
    for offset in markers.tolist():
        position = start + offset
        if position < resume:                   # inside a segment already stepped over
            continue
        code = data[position + 1]
        if code == EOI_CODE:
            return True, True
        if code not in BETWEEN_SCANS or position + 4 > len(data):
            return data.find(EOI, position) >= 0, False
        resume = position + 2 + int.from_bytes(data[position + 2:position + 4], "big")
    return False, True


def _describe_unreadable(data: bytes) -> ClientError:
    """Say why bytes that no accepted decoder could read were refused."""
    try:
        other = Image.open(io.BytesIO(data))
        if other.format not in (*ACCEPTED_FORMATS, "MPO"):
            return ClientError(400, "UnsupportedFormat",
                               f"{other.format} images are not accepted; send {ACCEPTED_NAMES}")
    except Exception:  # noqa: BLE001 - any failure here only means "not an image we know"
        pass
    head = data[:512]
    try:
        looks_like_text = all(ch.isprintable() or ch.isspace() for ch in head.decode("utf-8"))
    except UnicodeDecodeError:
        looks_like_text = False
    if looks_like_text:
        return ClientError(400, "NotAnImage", f"the body is text, not an image; send {ACCEPTED_NAMES}")
    return ClientError(400, "UndecodableImage", f"the body is not a readable {ACCEPTED_NAMES} image")


def _orientation(image: Image.Image) -> int:
    value = image.getexif().get(EXIF_ORIENTATION_TAG, 1)
    return value if isinstance(value, int) and value in EXIF_ORIENTATIONS else 1


# Segments a plain JPEG's header may hold before its first scan that Pillow reads without a
# side effect on the header (its handlers: Skip, COM, APPn), besides DQT and SOFn, checked apart.
DHT, DQT, DRI, COM = 0xC4, 0xDB, 0xDD, 0xFE
APP0, APP1, APP2, APP13, APP14 = 0xE0, 0xE1, 0xE2, 0xED, 0xEE


def plain_jpeg_header(data: bytes) -> ImageHeader | None:
    """A JPEG's header read from its markers alone, exactly as `read_header` reads it through
    Pillow, for the JPEGs whose header Pillow can only read one way: segments it reads without a
    side effect on the header (DQT tables it accepts, DHT, DRI, COM, APPn), one 8-bit frame
    header of 1, 3 or 4 components and a size Pillow does not warn about, then a scan. None for
    anything else (an EXIF or XMP segment, which may orient it; MPF; Photoshop or Adobe segments
    or a JFIF segment Pillow might fail to read; bytes between segments; a second frame header;
    any other marker; a segment past the end): Pillow reads those, as before. A fraction of
    the time of opening the file with Pillow (docs/benchmarks.md)."""
    if not data.startswith(b"\xff\xd8\xff"):
        return None
    frame: tuple[int, int, int, int, int] | None = None
    factors = (1, 1)
    position, size = 2, len(data)
    while position + 4 <= size:
        if data[position] != 0xFF:
            return None
        marker = data[position + 1]
        if marker == 0xFF:          # fill byte
            position += 1
            continue
        end = position + 2 + (data[position + 2] << 8 | data[position + 3])
        if end < position + 4 or end > size:
            return None
        if marker == SOS:
            return None if frame is None else _plain_header(data, frame, factors, position, end)
        if marker in START_OF_FRAME:
            if frame is not None or end - position < 10:
                return None
            components = data[position + 9]
            frame = (marker, data[position + 4], components, data[position + 5] << 8 | data[position + 6],
                     data[position + 7] << 8 | data[position + 8])
            factors = chroma_factors(data[position + 10:end], components)
        elif marker != DHT and not _plain_segment(marker, data[position + 4:end]):
            return None
        position = end
    return None


def _plain_segment(marker: int, segment: bytes) -> bool:
    """A segment before the scan that Pillow reads without failing or changing the header."""
    if marker == DQT:
        while segment:
            table_length = 1 + (64 if segment[0] < 16 else 128)
            if len(segment) < table_length:
                return False            # Pillow: "bad quantization table marker"
            segment = segment[table_length:]
        return True
    if marker in (DRI, COM):
        return True
    if not 0xE0 <= marker <= 0xEF or marker == APP1:            # EXIF, XMP: orientation
        return False
    if marker == APP0 and segment.startswith(b"JFIF"):
        return len(segment) >= 7
    if marker == APP2:
        return not segment.startswith(b"MPF\0") and (not segment.startswith(b"ICC_PROFILE\0")
                                                     or len(segment) >= 14)
    if marker == APP13:
        return not segment.startswith(b"Photoshop 3.0\0")
    if marker == APP14 and segment.startswith(b"Adobe"):
        return len(segment) >= 7
    return True


def _plain_header(data: bytes, frame: tuple[int, int, int, int, int], factors: tuple[int, int],
                  scan_offset: int, scan_data: int) -> ImageHeader | None:
    marker, bits, components, height, width = frame
    limit = Image.MAX_IMAGE_PIXELS
    if (bits != 8 or components not in (1, 3, 4) or width == 0 or height == 0
            or (limit is not None and width * height > limit)):
        return None                     # Pillow refuses, or warns
    ends, plain = walk_scans(data, scan_data)
    return ImageHeader("JPEG", width, height,
                       jpeg=JpegCoding(marker, bits, components, scan_offset, ends, plain, factors))


def read_header(data: bytes) -> ImageHeader:
    """Read format, size and orientation without decoding pixels; ClientError if unreadable.

    Nothing here may load pixel data (Pillow's PNG `getexif`, for one, decodes the whole image),
    so that the pixel limit is checked before any decoding work: orientation is read for JPEG
    (its APP1 segment, parsed when the file is opened) and WebP only, the formats whose decoders
    here leave orientation to the caller.
    """
    plain = plain_jpeg_header(data)
    if plain is not None:
        return plain
    return pillow_header(data)


def pillow_header(data: bytes) -> ImageHeader:
    """`read_header` through Pillow: any accepted format, any JPEG."""
    try:
        image = Image.open(io.BytesIO(data), formats=ACCEPTED_FORMATS)
        width, height = image.size
        if image.format in ("JPEG", "MPO"):
            return ImageHeader("JPEG", width, height, _orientation(image), jpeg=read_jpeg_coding(data))
        if image.format != "WEBP":
            return ImageHeader(str(image.format), width, height)
        return ImageHeader("WEBP", width, height, _orientation(image),
                           bool(getattr(image, "is_animated", False)))
    except Image.DecompressionBombError as error:
        raise ClientError(413, "ImageTooLarge", str(error)) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, KeyError, TypeError):
        raise _describe_unreadable(data) from None


def check_pixel_limits(header: ImageHeader, limits: ImageLimits) -> None:
    if header.pixels > limits.max_pixels:
        raise ClientError(
            413,
            "ImageTooLarge",
            f"the image is {header.width}x{header.height} = {header.pixels} pixels; "
            f"the limit is {limits.max_pixels}",
        )
    if min(header.width, header.height) < limits.min_side_px:
        raise ClientError(
            400,
            "ImageTooSmall",
            f"the image is {header.width}x{header.height}; each side must be at least "
            f"{limits.min_side_px} pixels",
        )


def check_body_size(data: bytes, limits: ImageLimits) -> None:
    if not data:
        raise ClientError(400, "EmptyBody", "the request body is empty")
    if len(data) > limits.max_body_bytes:
        raise ClientError(
            413,
            "BodyTooLarge",
            f"the body is {len(data)} bytes; the limit is {limits.max_body_bytes}",
        )


def checked_header(data: bytes, limits: ImageLimits) -> ImageHeader:
    """The header of bytes within every limit; ClientError (400 / 413) otherwise."""
    check_body_size(data, limits)
    header = read_header(data)
    check_pixel_limits(header, limits)
    return header
