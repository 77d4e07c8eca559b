"""Doctest collection: skip an integration module whose framework is not installed."""

from __future__ import annotations

import importlib.util

collect_ignore = [f"{module}.py" for module, package in (("lightning", "pytorch_lightning"), ("transformers", "transformers"))
                  if importlib.util.find_spec(package) is None]
