"""Doctest collection: skip an integration module whose framework is not installed."""

from __future__ import annotations

import importlib.util


def _missing(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is None
    except (ImportError, ValueError):  # a parent package missing, or a module blocked in sys.modules
        return True


collect_ignore = [f"{module}.py" for module, package in (("lightning", "pytorch_lightning"), ("transformers", "transformers"))
                  if _missing(package)]
