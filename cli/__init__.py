"""The ``ckpt`` command line: parses, calls the ckpt API, prints. Nothing else."""
