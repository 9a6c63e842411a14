#!/usr/bin/env python3
"""Writes tests/data/aperio_rgb.svs and tests/data/aperio_ycbcr.svs: small Aperio-style slides
whose tiles are JPEG streams sharing one set of tables (the JPEGTables tag), as Aperio's
scanners write them. Level 0 is 384x256 in 128-pixel tiles, then a striped thumbnail (not a
level), then level 1 (192x128). aperio_rgb.svs stores RGB components (photometric RGB, no
colour transform); aperio_ycbcr.svs stores YCbCr with 2x2 chroma subsampling (photometric
YCbCr, Aperio's common case). OpenSlide opens both as Aperio slides.

Needs numpy, tifffile and imagecodecs:
    .venv-torch/bin/pip install tifffile imagecodecs
    .venv-torch/bin/python scripts/make_svs_fixture.py
"""

import os

import imagecodecs
import numpy
import tifffile

TILE = 128
QUALITY = 70
OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "data")


def pixels(width, height):
    """A deterministic colourful texture: gradients, a grating and soft blobs."""
    y, x = numpy.mgrid[0:height, 0:width].astype(numpy.float64)
    r = 180 + 60 * numpy.sin(x / 17.0) * numpy.cos(y / 23.0)
    g = 120 + 80 * numpy.sin((x + 2 * y) / 31.0)
    b = 200 - 0.3 * x + 40 * numpy.cos(numpy.hypot(x - 200, y - 120) / 9.0)
    rgb = numpy.stack([r, g, b], axis=-1)
    return numpy.clip(numpy.rint(rgb), 0, 255).astype(numpy.uint8)


def split(stream):
    """A full JPEG stream as (tables, abbreviated tile): the tables hold SOI, every DQT and
    DHT segment and EOI; the tile keeps the rest."""
    assert stream[:2] == b"\xff\xd8"
    tables, rest, at = [b"\xff\xd8"], [b"\xff\xd8"], 2
    while True:
        marker = stream[at : at + 2]
        if marker == b"\xff\xda":  # SOS: entropy-coded data to the end
            rest.append(stream[at:])
            break
        length = int.from_bytes(stream[at + 2 : at + 4], "big")
        segment = stream[at : at + 2 + length]
        (tables if marker in (b"\xff\xdb", b"\xff\xc4") else rest).append(segment)
        at += 2 + length
    tables.append(b"\xff\xd9")
    return b"".join(tables), b"".join(rest)


def tiles(image, colourspace, subsampling):
    """The image's tiles (edge tiles padded to a full tile, as TIFF stores them), JPEG
    encoded, split into their one shared set of tables and abbreviated streams."""
    height, width, _ = image.shape
    streams = []
    for ty in range(0, height, TILE):
        for tx in range(0, width, TILE):
            tile = numpy.zeros((TILE, TILE, 3), numpy.uint8)
            part = image[ty : ty + TILE, tx : tx + TILE]
            tile[: part.shape[0], : part.shape[1]] = part
            streams.append(
                imagecodecs.jpeg8_encode(
                    tile,
                    level=QUALITY,
                    colorspace="RGB",
                    outcolorspace=colourspace,
                    subsampling=subsampling,
                )
            )
    pairs = [split(s) for s in streams]
    tables = {t for t, _ in pairs}
    assert len(tables) == 1, "tiles encoded with different tables"
    return tables.pop(), [s for _, s in pairs]


def write(name, colourspace, subsampling):
    level0 = pixels(384, 256)
    level1 = level0.reshape(128, 2, 192, 2, 3).mean(axis=(1, 3)).round().astype(numpy.uint8)
    description = (
        "Aperio Image Library v10.0.0\r\n384x256 [0,0 384x256] (128x128) JPEG/RGB Q=80"
        "|AppMag = 20|MPP = 0.5"
    )
    path = os.path.join(OUT, name)
    with tifffile.TiffWriter(path) as tif:
        for index, level in enumerate([level0, None, level1]):
            if level is None:
                # The thumbnail: striped, so not a level.
                tif.write(level0[::4, ::4], photometric="rgb", compression="zlib", metadata=None)
                continue
            tables, streams = tiles(level, colourspace, subsampling)
            tif.write(
                iter(streams),
                shape=level.shape,
                dtype=numpy.uint8,
                tile=(TILE, TILE),
                photometric="rgb",
                compression="jpeg",
                compressionargs={"outcolorspace": colourspace},
                jpegtables=tables,
                subsampling=(2, 2) if subsampling == "420" else (1, 1),
                metadata=None,
                description=description if index == 0 else None,
            )
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    write("aperio_rgb.svs", "RGB", "444")
    write("aperio_ycbcr.svs", "YCbCr", "420")
