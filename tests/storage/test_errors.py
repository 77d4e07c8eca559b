"""storage/errors.py: the error root and the storage errors."""

from __future__ import annotations

import pickle

import pytest

from ckpt.errors import InvalidSourceError, TensorMismatchError, UnsafeInputError
from ckpt_store.storage.errors import (
    CkptError,
    CorruptObjectError,
    ObjectNotFoundError,
    StorageIOError,
    StoreNotFoundError,
)


@pytest.mark.parametrize("error", [
    CkptError("m", hint="h"), InvalidSourceError("'w'", "has dtype torch.complex128", hint="cast it"),
    UnsafeInputError("x.pt", "pickle"), ObjectNotFoundError("chunk", "ab" * 32), CorruptObjectError("chunk", "cd" * 32, "bad hash"),
    StoreNotFoundError("/nowhere"), StorageIOError("disk full", retryable=False, errno=28), TensorMismatchError("shape", hint="h"),
], ids=lambda e: type(e).__name__)
def test_errors_survive_pickling_as_themselves(error):
    """DCP sends a rank's failure to the others pickled. Errors whose __init__ takes other arguments than
    the message (InvalidSourceError, ObjectNotFoundError, CorruptObjectError) did not unpickle: the other
    ranks got 'TypeError: InvalidSourceError.__init__() missing 1 required positional argument'."""
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error) and back.args == error.args
    assert back.__dict__ == error.__dict__
