from __future__ import annotations

import json

import pytest

from ckpt_store.storage.backends import open_backend
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


def test_enclosing_store_walks_every_ancestor_and_resolves_links(tmp_path):
    from ckpt_store.storage.config import enclosing_store

    init_config(open_backend(str(tmp_path / "st")))
    root = str((tmp_path / "st").resolve())
    assert enclosing_store(str(tmp_path / "st")) == root
    assert enclosing_store(str(tmp_path / "st" / "refs" / "not" / "yet")) == root
    (tmp_path / "link").symlink_to(tmp_path / "st" / "objects", target_is_directory=True)
    assert enclosing_store(str(tmp_path / "link" / "x")) == root
    assert enclosing_store(str(tmp_path / "elsewhere")) is None


def test_check_location_says_what_the_path_is(tmp_path):
    from ckpt_store.storage.config import check_location
    from ckpt_store.storage.errors import StoreLocationError

    init_config(open_backend(str(tmp_path / "st")))
    with pytest.raises(StoreLocationError, match="inside the store at"):
        check_location(open_backend(str(tmp_path / "st" / "refs")), create=True)
    check_location(open_backend(str(tmp_path / "st" / "refs")), create=False)  # opening: "no store" later
    (tmp_path / "f").write_text("x")
    with pytest.raises(StoreLocationError, match="is a file"):
        check_location(open_backend(str(tmp_path / "f")), create=False)
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")  # said as such, not "cannot write ckpt-store.json: File exists"
    for create in (True, False):
        with pytest.raises(StoreLocationError, match="symbolic link to .*nowhere.*which does not exist"):
            check_location(open_backend(str(tmp_path / "gone")), create=create)
    for url in ("", "  ", "file://"):
        with pytest.raises(StoreLocationError, match="empty store URL"):
            open_backend(url)


@pytest.mark.parametrize("url", ["s3:/bucket/store", "s3:bucket/store", "S3:/bucket", "s3a:/b/x", "memory:/x", "gs:b/x"])
def test_a_url_with_a_slash_missing_is_no_local_folder(url, tmp_path, monkeypatch):
    """`--store s3:/bucket/store` (one slash) was taken for a local path: the push went into a folder
    named "s3:" in the working folder, and the team's store never saw it. A known scheme followed by
    ':' without '//' is refused, saying how to write it either way."""
    import os

    from ckpt_store.storage.errors import StoreLocationError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(StoreLocationError, match="slash") as e:
        open_backend(url)
    assert "://" in str(e.value.hint) and "./" in str(e.value.hint)
    assert os.listdir(tmp_path) == []
    open_backend(f"./{url}")  # a local folder of that name, said plainly, is one
    open_backend("c:/x")  # (one letter: a Windows drive, not a scheme)


def test_a_store_made_meanwhile_by_another_process_is_opened_not_refused(tmp_path, monkeypatch):
    """Creating a store refuses a folder holding anything else; a folder that became a store between
    the check for its config and the listing (another rank or process initialising it at once, then
    pushing) was refused as 'not empty'."""
    import os

    import ckpt

    root = tmp_path / "st"
    real = os.listdir

    def racing(path):
        if os.path.realpath(path) == os.path.realpath(root) and not (root / CONFIG_PATH).exists():
            init_config(open_backend(str(root)))  # the other process: config first, then its objects
            (root / "objects").mkdir()
        return real(path)

    root.mkdir()
    monkeypatch.setattr(os, "listdir", racing)
    store = ckpt.Store.init(str(root))
    assert store.config == read_config(open_backend(str(root)))


def test_a_new_store_is_not_created_among_other_objects_anywhere(store_url):
    """As a local folder of someone's work, a bucket prefix (or memory:// path) already holding other
    objects does not become a store: its gc would run among them. An empty one, or a store, opens."""
    import ckpt
    from ckpt_store.storage.errors import StoreLocationError

    theirs = open_backend(store_url)
    theirs.write("results/run-1.csv", b"step,loss\n1,2.0\n")
    with pytest.raises(StoreLocationError, match="not empty and holds no store"):
        ckpt.Store.init(store_url)
    assert not theirs.exists(CONFIG_PATH)
    assert [e.path for e in theirs.list("")] == ["results/run-1.csv"]
    fresh = store_url.rstrip("/") + "/sub"
    ckpt.Store.init(fresh)  # below it: new, so empty
    ckpt.Store.init(fresh)  # and a store, so opened
