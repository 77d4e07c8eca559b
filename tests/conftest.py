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


@pytest.fixture
def one_thread():
    """Tiny models train fastest on one thread; on a busy machine more threads spin (100x slower here)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
