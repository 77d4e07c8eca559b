"""Stores shared by the web view's API and browser tests (built once per session: they take seconds)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def web_store(tmp_path_factory):
    from webstore import build

    return build(str(tmp_path_factory.mktemp("web") / "store"))


@pytest.fixture(scope="session")
def wide_store(tmp_path_factory):
    from webstore import build_wide

    return build_wide(str(tmp_path_factory.mktemp("wide") / "store"))
