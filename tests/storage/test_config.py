from __future__ import annotations

import json

import pytest

from ckpt_store.storage.backend import open_backend
from ckpt_store.storage.config import CONFIG_PATH, init_config, read_config
from ckpt_store.storage.errors import StoreFormatError, StoreNotFoundError


def test_init_then_read(store_url):
    b = open_backend(store_url)
    cfg, created = init_config(b)
    assert created
    again, created2 = init_config(b)
    assert not created2 and again == cfg
    assert read_config(b) == cfg


def test_missing_store(tmp_path):
    with pytest.raises(StoreNotFoundError):
        read_config(open_backend(str(tmp_path / "none")))


def test_unknown_version_is_refused_clearly(tmp_path):
    b = open_backend(str(tmp_path))
    init_config(b)
    obj = json.loads((tmp_path / CONFIG_PATH).read_bytes())
    obj["version"] = 999
    (tmp_path / CONFIG_PATH).write_text(json.dumps(obj))
    with pytest.raises(StoreFormatError, match="version 999"):
        read_config(b)


def test_golden_bytes():
    from ckpt_store.storage.config import StoreConfig

    assert StoreConfig("abc", 1.5).to_json() == b'{"check":"17c8b234187603d459b4ff11c1e9a70e","created":1.5,"format":"ckpt-store","store_id":"abc","version":2}'
