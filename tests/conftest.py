from __future__ import annotations

import uuid

import pytest


@pytest.fixture(params=["local", "memory"])
def store_url(request, tmp_path):
    """A fresh store URL on each backend the conformance tests cover."""
    if request.param == "local":
        return str(tmp_path / "store")
    return f"memory://ckpt-test-{uuid.uuid4().hex}"


@pytest.fixture
def store(tmp_path):
    import ckpt

    return ckpt.Store.init(str(tmp_path / "store"))
