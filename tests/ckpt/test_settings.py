"""ckpt/settings.py: every CKPT_* variable parses strictly; a bad value is a ConfigError naming it."""

from __future__ import annotations

import pytest

from ckpt.errors import CkptError, ConfigError
from ckpt.settings import Settings


@pytest.mark.parametrize("var, value, says", [
    ("CKPT_WORKERS", "abc", "CKPT_WORKERS='abc' is not a whole number"),
    ("CKPT_WORKERS", "1.5", "CKPT_WORKERS='1.5' is not a whole number"),
    ("CKPT_WORKERS", "-2", "CKPT_WORKERS=-2: workers must be a whole number of at least 1"),
    ("CKPT_WORKERS", "0", "CKPT_WORKERS=0: workers"),
    ("CKPT_IO_WORKERS", "", "CKPT_IO_WORKERS='' is not a whole number"),
    ("CKPT_RETRIES", "-1", "CKPT_RETRIES=-1: retries"),
    ("CKPT_RETRY_DELAY", "nan", "CKPT_RETRY_DELAY='nan' is not a finite number"),
    ("CKPT_RETRY_DELAY", "-0.5", "CKPT_RETRY_DELAY=-0.5"),
    ("CKPT_MIN_SAVING", "2", "CKPT_MIN_SAVING=2.0: min_saving must be a number from 0.0 to 1.0"),
    ("CKPT_CHUNK_SIZE", "1024", "CKPT_CHUNK_SIZE=1024: chunk_size must be a whole number from 65536"),
    ("CKPT_MAX_DELTA_DEPTH", "-1", "CKPT_MAX_DELTA_DEPTH=-1"),
    ("CKPT_ZSTD_LEVEL", "23", "CKPT_ZSTD_LEVEL=23"),
    ("CKPT_FSYNC", "maybe", "CKPT_FSYNC='maybe' is not a boolean"),
    ("CKPT_CONDITIONAL_WRITES", "2", "CKPT_CONDITIONAL_WRITES='2' is not a boolean"),
    ("CKPT_REQUEST_DEADLINE", "0", "CKPT_REQUEST_DEADLINE=0.0: request_deadline must be a number of at least 0.1"),
])
def test_bad_environment_values_name_the_variable(monkeypatch, var, value, says):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as e:
        Settings.from_env()
    assert says in str(e.value)
    assert isinstance(e.value, CkptError) and isinstance(e.value, ValueError)  # old `except ValueError` still works


@pytest.mark.parametrize("var, value, field, expected", [
    ("CKPT_WORKERS", " 3 ", "workers", 3),
    ("CKPT_FSYNC", "off", "fsync", False),
    ("CKPT_FSYNC", "YES", "fsync", True),
    ("CKPT_RETRY_DELAY", "0", "retry_delay", 0.0),
    ("CKPT_ZSTD_LEVEL", "-3", "zstd_level", -3),
    ("CKPT_REQUEST_DEADLINE", "2.5", "request_deadline", 2.5),
])
def test_good_environment_values(monkeypatch, var, value, field, expected):
    monkeypatch.setenv(var, value)
    assert getattr(Settings.from_env(), field) == expected


def test_keyword_overrides_are_checked_and_named(monkeypatch):
    monkeypatch.setenv("CKPT_WORKERS", "abc")
    with pytest.raises(ConfigError, match="CKPT_WORKERS"):  # a bad variable fails even if a keyword overrides it
        Settings.from_env(workers=2)
    monkeypatch.delenv("CKPT_WORKERS")
    with pytest.raises(ConfigError, match=r"^workers=0: workers must be"):
        Settings.from_env(workers=0)
    with pytest.raises(ConfigError, match="chunk_size=1024"):
        Settings.from_env(chunk_size=1024)
    with pytest.raises(ConfigError, match="unknown setting"):
        Settings.from_env(wokers=2)
    with pytest.raises(ConfigError, match="workers"):
        Settings.from_env(workers=1.5)
    assert Settings.from_env(chunk_size=1 << 20, min_saving=0).chunk_size == 1 << 20
