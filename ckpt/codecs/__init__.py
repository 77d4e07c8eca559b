"""Lossless chunk codecs: the blob header, byte planes, XOR/SUB/GSUB deltas and the choice
between them (chunk.py), the pure array transforms they use (transforms.py), and the
optional C kernels (_native.c) that do the same in one pass over memory."""
