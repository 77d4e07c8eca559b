"""The store itself: bytes and names, never tensors.

``backends`` (by URL scheme: local, S3, any fsspec filesystem), ``objects`` (content-addressed blobs),
``refs`` (names with history), ``config`` (the store's format record) and ``gc``.
This package must not import torch (tests/test_layers.py checks it).
"""
