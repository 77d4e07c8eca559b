"""Moving chunks between memory and a store in parallel: hashing, encoding and writing on
push; fetching, decoding and verifying on every read (pipeline.py)."""
