"""Moving chunks between memory and a store in parallel: hashing, encoding and writing on
push (writing.py); fetching, decoding and verifying on every read (reading.py, one chunk
in fetch.py); pipeline.py names them all."""
