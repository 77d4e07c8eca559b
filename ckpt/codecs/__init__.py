"""Lossless chunk codecs: the blob header and the choice between codecs (chunk.py), byte planes
and XOR/SUB/GSUB deltas (planes.py), the codec ids (ids.py), the per-thread contexts and buffers
they work in (buffers.py), the pure array transforms they use (transforms.py), and the
optional C kernels (_native.c) that do the same in one pass over memory."""
