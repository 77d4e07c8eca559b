"""The codec ids a chunk blob's header names (docs/format.md, ckpt/codecs/chunk.py), and their names."""

from __future__ import annotations

RAW, ZSTD, PLANES, XOR, SUB, GSUB = 0, 1, 2, 3, 4, 5
CODEC_NAMES = {RAW: "raw", ZSTD: "zstd", PLANES: "planes", XOR: "xor", SUB: "sub", GSUB: "gsub"}
DELTA_CODECS = (XOR, SUB, GSUB)
