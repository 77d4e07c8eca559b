"""Collection rules for the whole checkout (not shipped: the wheel holds packages only).

``--doctest-modules`` imports every module under the test paths. Modules that need an
optional framework are skipped where it is not installed, so that ``pytest`` collects
cleanly without the ``lightning``/``transformers`` extras; the tests that use them skip
with a reason instead (``pytest.importorskip``).
"""

from __future__ import annotations

import importlib.util


def _missing(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is None
    except (ImportError, ValueError):  # a parent package missing, or a module blocked in sys.modules
        return True


_NEEDS = {
    "ckpt/integrations/lightning.py": "pytorch_lightning",
    "tests/ckpt/integrations/lightning_script.py": "pytorch_lightning",
    "ckpt/integrations/transformers.py": "transformers",
    "tests/ckpt/integrations/hf_script.py": "transformers",
}
collect_ignore = [path for path, package in _NEEDS.items() if _missing(package)]
