"""The directory of a torch zip file (``torch.save``'s format), walked as torch's reader (miniz) walks it,
before torch loads the file: every entry must be stored as it is, within the file, as ``torch.save`` writes
it. Read record by record through a buffer of fixed size (:data:`_BLOCK`), so that a file listing a
million entries costs no more memory here than one listing three (``zipfile.ZipFile`` built a
``ZipInfo`` per entry: 433 MiB of peak memory for a 51 MB file of a million empty entries).

The walk follows miniz (``mz_zip_reader_read_central_dir``), not Python's ``zipfile``: the end record
is the last signature in the file's last 64 KiB with a whole record after it; a zip64 end record is used
wherever a locator precedes the end record; the directory is read at the offset it states. Where readers
could disagree on which directory is the file's, it is refused: ``zipfile`` shifts the directory to where
the end records imply (for data before an archive; newer miniz does too), so a file with two directories
of one size showed ``zipfile`` stored entries and torch a deflated one. The end records must follow the
directory, as ``torch.save`` writes them.

The number of entries is not capped: what torch.load (and the push after it) takes for them grows with the
file's own bytes, about tenfold (100,000 empty tensors: a 22 MB file, torch.load's
peak 215 MiB above the interpreter's, the push's 387 MiB), and a cap low enough to matter would refuse
real checkpoints of many small tensors. What grows faster than the file (a deflated entry) is refused."""

from __future__ import annotations

import os
import struct

from ckpt.errors import InvalidSourceError
from ckpt.store.source_files import show

_LOCAL = b"PK\x03\x04"  # how a torch zip file begins: torch.load reads any other file as its legacy format
_END = struct.Struct("<4sHHHHIIH")  # signature, disk, directory's disk, entries here, entries, size, offset, comment
_LOCATOR = struct.Struct("<4sIQI")  # signature, zip64 end record's disk, its offset, disks
_END64 = struct.Struct("<4sQHHIIQQQQ")  # signature, record size, versions, disk, directory's disk, entries here, entries, size, offset
_ENTRY = struct.Struct("<4s6H3I5H2I")  # signature, versions, flags, method, time, date, crc, sizes, lengths, disk, attrs, offset
_LOCAL_SIZE = 30
_U32 = 0xFFFFFFFF
_ZIP64_EXTRA = 1
_BLOCK = 256 << 10  # bytes of the directory read at a time (more than the largest record)
_MAX_RECORD = 46 + 3 * 0xFFFF  # an entry record: its fixed part, then a name, an extra field and a comment of 64 KiB at most


def check_stored_entries(fd: int, path: str) -> None:
    """Refuse a torch zip file (``fd``, open; its offset is left as it is) with an entry compressed:
    ``torch.save`` stores every entry as it is, but ``torch.load`` inflates a deflated one into fresh
    memory, so 256 KB of deflated zeros load as a 256 MiB tensor (deflate reaches ~1000 to 1). Refused
    too, naming what is wrong: a stored entry claiming more bytes than it stores, or bytes past the file's
    end (torch's reader refuses these itself, only as 'invalid header or archive is corrupted'), a
    directory that cannot be read, and one that readers could take for another (see this module). So a file's
    tensors take at most its size. A file that is no zip (torch's legacy format, or junk) is torch.load's
    to judge.

    Raises :class:`InvalidSourceError`."""
    size = os.fstat(fd).st_size
    if os.pread(fd, len(_LOCAL), 0) != _LOCAL:
        return
    try:
        _walk(fd, size, path)
    except _Damaged as e:
        raise InvalidSourceError(path, f"not a readable torch file: its zip directory {e}",
                                 hint="save it again with torch.save, and push that") from None
    except _Shrank:  # (every read is checked against the size first, as FileBytes.read says it)
        raise InvalidSourceError(path, "file shrank while it was being pushed") from None


class _Damaged(Exception):
    """The zip's directory cannot be read (the message says where)."""


class _Shrank(Exception):
    """A read came back short of bytes the file's size had: the file shrank meanwhile."""


def _read(fd: int, n: int, at: int) -> bytes:
    got = os.pread(fd, n, at)
    if len(got) != n:
        raise _Shrank
    return got


def _directory(fd: int, size: int) -> tuple[int, int, int]:
    """The directory's entry count, size and offset, from the end record (and the zip64 one)."""
    span = min(size, 0xFFFF + _END.size)  # a comment is at most 64 KiB
    tail = _read(fd, span, size - span)
    at = tail.rfind(b"PK\x05\x06", 0, span - _END.size + 4)  # the last one, with a whole record after it
    if at < 0:
        raise _Damaged("is missing (no end record)")
    end_at = ends_at = size - span + at  # ends_at: where the end records begin, right after the directory
    _, disk, cd_disk, here, count, cd_size, cd_at, _ = _END.unpack_from(tail, at)
    if end_at >= _LOCATOR.size + _END64.size:
        sig, _, end64_at, disks = _LOCATOR.unpack(_read(fd, _LOCATOR.size, end_at - _LOCATOR.size))
        if sig == b"PK\x06\x07":
            if end64_at > size - _END64.size:
                raise _Damaged("has a zip64 end record past the file's end")
            end64 = _END64.unpack(_read(fd, _END64.size, end64_at))
            if end64[0] == b"PK\x06\x06":
                _, length, _, _, disk, cd_disk, here, count, cd_size, cd_at = end64
                if length < _END64.size - 12 or disks != 1:
                    raise _Damaged("has a zip64 end record torch cannot read")
                if max(here, count, cd_size) > _U32:  # (miniz's limits)
                    raise _Damaged(f"lists {count} entries in {cd_size} bytes, more than torch reads")
                if end64_at + 12 + length != end_at - _LOCATOR.size:
                    raise _Damaged("has a zip64 end record apart from its locator")
                ends_at = end64_at
    if here != count or ((disk | cd_disk) != 0 and (disk, cd_disk) != (1, 1)):
        raise _Damaged("spans several disks")
    if cd_size < count * _ENTRY.size or cd_at + cd_size > size:
        raise _Damaged(f"claims {count} entries in {cd_size} bytes at byte {cd_at}, which the file does not hold")
    if cd_at + cd_size != ends_at:
        # As torch.save writes it, the end records follow the directory. Elsewhere, readers disagree on
        # where the directory is: torch's miniz reads it where the end record says, Python's zipfile (and
        # newer miniz) where the end record implies, taking the gap for data before the archive.
        raise _Damaged(f"ends at byte {cd_at + cd_size}, not where its end records begin ({ends_at})")
    return count, cd_size, cd_at


def _walk(fd: int, size: int, path: str) -> None:
    count, left, next_at = _directory(fd, size)
    buf, pos = b"", 0  # the directory's bytes from next_at - len(buf); the record being read starts at pos
    for _ in range(count):
        have = len(buf) - pos
        if have < _MAX_RECORD and have < left:  # (a block holds the largest record: then it holds this one)
            more = min(_BLOCK, left - have)
            buf, pos = buf[pos:] + _read(fd, more, next_at), 0
            next_at += more
        if left < _ENTRY.size or buf[pos:pos + 4] != b"PK\x01\x02":
            raise _Damaged("has a damaged entry record")
        (_, _, _, _, method, _, _, _, packed, unpacked, name_len, extra_len, note_len, _, _, _,
         local_at) = _ENTRY.unpack_from(buf, pos)
        whole = _ENTRY.size + name_len + extra_len + note_len
        if whole > left:
            raise _Damaged("has an entry record past its end")
        name_at = pos + _ENTRY.size
        if _U32 in (packed, unpacked, local_at):
            unpacked, packed, local_at = _zip64(buf[name_at + name_len:name_at + name_len + extra_len], unpacked, packed, local_at)
        if method != 0 or packed != unpacked or local_at + _LOCAL_SIZE + packed > size:
            name = show(buf[name_at:name_at + min(name_len, 200)].decode("utf-8", "replace"))
            _refuse(path, name, method, packed, unpacked, f"at byte {local_at}, past the file's end ({size} bytes)")
        pos += whole
        left -= whole


def _zip64(extra: bytes, *fields: int) -> tuple[int, ...]:
    """An entry's uncompressed size, compressed size and local header's offset (``fields``, in
    that order), each one whose 32-bit field is all ones read from the zip64 extra field, as miniz
    reads them; without such a field they stay as they are."""
    i = 0
    while i + 4 <= len(extra):
        kind, n = struct.unpack_from("<HH", extra, i)
        if i + 4 + n > len(extra):
            raise _Damaged("has an entry with a damaged extra field")
        if kind == _ZIP64_EXTRA:
            wide, at = [], i + 4
            for v in fields:
                if v == _U32:
                    if at + 8 > i + 4 + n:
                        raise _Damaged("has an entry with a damaged zip64 field")
                    v = struct.unpack_from("<Q", extra, at)[0]
                    at += 8
                wide.append(v)
            return tuple(wide)
        i += 4 + n
    return fields


def _refuse(path: str, name: str, method: int, packed: int, unpacked: int, past: str) -> None:
    if method != 0:
        why = (f"is compressed ({packed} bytes for {unpacked}), which torch.save never writes: loading it could "
               "take far more memory than the file holds")
    elif packed != unpacked:
        why = f"claims {unpacked} bytes but stores {packed}, which torch.save never writes"
    else:
        why = f"claims {packed} bytes {past}"
    raise InvalidSourceError(path, f"its entry {name} {why}",
                             hint="load it with torch.load where you trust it, save it again with torch.save or "
                                  "safetensors, and push that")
