"""``ckpt serve``: a read-only web view of a store (lineage graph, versions, sizes, diffs, runs).

The second face beside the command line: its pages and its ``/api/`` documents are built
from ckpt's public API and carry what the CLI's ``--json`` carries. Needs the ``web``
extra (``pip install 'ckpt-store[web]'``: starlette, jinja2, uvicorn).
"""
