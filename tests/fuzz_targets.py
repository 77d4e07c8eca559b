"""Fuzz targets: every parser of bytes that come from a store or a user's file.

Each target takes arbitrary bytes and must either return normally or raise a
:class:`CkptError` (the documented error class); anything else — another exception,
a hang, an allocation the size of a claim in the input — is a bug. Used two ways:

* ``tests/test_fuzz.py`` drives them with hypothesis (random bytes and mutations of
  valid seeds), run by the default test suite;
* with atheris (coverage-guided, libFuzzer), when it is installed::

      python tests/fuzz_targets.py manifest -runs=20000

  The process exits non-zero on the first input that breaks the contract.
"""

from __future__ import annotations

import atexit
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ckpt_store.storage.errors import CkptError  # noqa: E402


def _manifest(data: bytes) -> None:
    from ckpt.format.manifest import Manifest

    m = Manifest.from_json(data)
    m.chunk_lengths()  # derived views must be as safe as the parse


def _ref(data: bytes) -> None:
    from ckpt_store.storage.refs import RefEntry

    RefEntry.from_json(data, "fuzzed ref entry")


def _config(data: bytes) -> None:
    from ckpt_store.storage.config import StoreConfig

    StoreConfig.from_json(data)


def _chunk(data: bytes) -> None:
    from ckpt.codecs.chunk import decode_chunk

    length = struct.unpack("<Q", data[8:16])[0] if len(data) >= 16 else 0
    base = bytes(min(length, 1 << 16))
    decode_chunk(data, "0" * 64, min(length, 1 << 16), max_length=1 << 16, base=base)


def _safetensors(data: bytes) -> None:
    from ckpt.format.safetensors_header import parse_header

    parse_header(data[:8], lambda n: data[8 : 8 + n], len(data), "fuzzed.safetensors")


_HF_DIR: list[str] = []


def _hf_index(data: bytes) -> None:
    """A real HF directory (one real shard) whose index file is the fuzzed bytes."""
    from ckpt.store.sources import open_source

    if not _HF_DIR:
        d = tempfile.mkdtemp(prefix="ckpt-fuzz-hf-")
        atexit.register(shutil.rmtree, d, True)  # (one per process: no folder left in /tmp per run)
        header = b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
        with open(os.path.join(d, "model-00001-of-00001.safetensors"), "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header + bytes(8))
        _HF_DIR.append(d)
    with open(os.path.join(_HF_DIR[0], "model.safetensors.index.json"), "wb") as f:
        f.write(data)
    open_source(_HF_DIR[0]).close()


def _ref_name(data: bytes) -> None:
    from ckpt_store.storage.refs import validate_ref_name

    name = data.decode("utf-8", "replace")
    validate_ref_name(name)
    # Accepted: it must be safe as a path below refs/.
    assert "\0" not in name and not name.startswith("/") and ".." not in name.split("/"), name
    assert len(name) <= 255 and "\\" not in name


def _tensor_name(data: bytes) -> None:
    from ckpt.format.names import check_tensor_name

    name = data.decode("utf-8", "replace")
    check_tensor_name(name)
    assert "\0" not in name, name


TARGETS: dict[str, Callable[[bytes], None]] = {
    "manifest": _manifest,
    "ref": _ref,
    "config": _config,
    "chunk": _chunk,
    "safetensors": _safetensors,
    "hf-index": _hf_index,
    "ref-name": _ref_name,
    "tensor-name": _tensor_name,
}


def run(target: str, data: bytes) -> None:
    """Call ``target`` on ``data``: a CkptError is an accepted outcome, anything else propagates."""
    try:
        TARGETS[target](data)
    except CkptError:
        pass


def seeds(target: str) -> list[bytes]:
    """Valid inputs for ``target``, for mutation-based fuzzing."""
    from ckpt_store.storage.config import StoreConfig
    from ckpt_store.storage.refs import RefEntry

    header = b'{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},' \
             b'"b":{"dtype":"BF16","shape":[1,2],"data_offsets":[8,12]}}'
    ids = ["ab" * 32, "cd" * 32, "ef" * 32, "12" * 32]
    manifest = (
        '{"chunk_size":16,"created":1.5,"extra":{"step":3},"files":[{"chunks":["' + ids[0] + '"],"head_size":16,'
        '"kind":"safetensors","metadata":null,"path":"model.safetensors","size":40}],"format":"ckpt-manifest",'
        '"lineage":{"base":null,"merge":null,"parent":null},"message":"m","metadata":{},"source":"safetensors",'
        '"tensors":[{"chunks":["' + ids[1] + '","' + ids[2] + '"],"codecs":[1,3],"delta_bases":[[],["' + ids[3] + '"]],'
        '"dtype":"F32","file":"model.safetensors","name":"w","nbytes":24,"shape":[2,3]}],"version":1}'
    ).encode()
    from ckpt.codecs.chunk import encode_chunk

    data = struct.pack("<4f", 1.0, -0.0, float("inf"), 1e-40)
    return {
        "manifest": [manifest],
        "ref": [RefEntry("a/b", 3, ids[0], 1.5, "w" * 32).to_json(), RefEntry("a", 1, None, 2.0, "x", alias=True).to_json()],
        "config": [StoreConfig("s" * 32, 1.5).to_json()],
        "chunk": [encode_chunk(data * 64).blob, encode_chunk(data * 64, elem=4, base=bytes(256), base_id="0" * 64).blob],
        "safetensors": [struct.pack("<Q", len(header)) + header + bytes(12)],
        "hf-index": [b'{"metadata":{"total_size":8},"weight_map":{"a":"model-00001-of-00001.safetensors"}}'],
        "ref-name": [b"run7/step-400", b"llama-ft/legal", b"a/../b", b"/etc/passwd"],
        "tensor-name": [b"model.layers.0.weight", b"a\x00b", b"../x"],
    }[target]


def main() -> None:  # pragma: no cover - the atheris entry point
    import atheris

    target = sys.argv.pop(1)
    with atheris.instrument_imports():
        import ckpt.codecs.chunk  # noqa: F401
        import ckpt.format.manifest  # noqa: F401
        import ckpt.format.safetensors_header  # noqa: F401
        import ckpt.store.sources  # noqa: F401
        import ckpt_store.storage.config  # noqa: F401
        import ckpt_store.storage.refs  # noqa: F401
    corpus = tempfile.mkdtemp(prefix=f"ckpt-fuzz-{target}-")
    for i, s in enumerate(seeds(target)):
        with open(os.path.join(corpus, f"seed{i}"), "wb") as f:
            f.write(s)
    atheris.Setup([sys.argv[0], *sys.argv[1:], corpus], lambda data: run(target, data))
    atheris.Fuzz()


if __name__ == "__main__":
    main()
