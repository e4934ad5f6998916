"""Deletion vectors of the Delta protocol, decoded: inline (``i``), relative (``u``)
and absolute (``p``) storage, portable RoaringBitmapArray with run containers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import SourceError
from ..storage import fs as _fs

_Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
_Z85_DECODE = {c: i for i, c in enumerate(_Z85)}
_DV_PORTABLE_MAGIC = 1681511377
_DV_NATIVE_MAGIC = 1681511376


def z85_decode(text: str) -> bytes:
    if len(text) % 5:
        raise ValueError(f"Z85 text of length {len(text)} is not a multiple of 5")
    out = bytearray()
    for i in range(0, len(text), 5):
        value = 0
        for c in text[i : i + 5]:
            value = value * 85 + _Z85_DECODE[c]
        out += value.to_bytes(4, "big")
    return bytes(out)


def _roaring32(buf: bytes, pos: int):
    """One standard 32-bit Roaring bitmap at ``pos``: (sorted uint32 values, end position)."""
    import numpy as np

    (cookie,) = np.frombuffer(buf, "<u4", 1, pos)
    cookie = int(cookie)
    if cookie & 0xFFFF == 12347:  # SERIAL_COOKIE: run containers possible
        size = (cookie >> 16) + 1
        run_bits = buf[pos + 4 : pos + 4 + (size + 7) // 8]
        p = pos + 4 + (size + 7) // 8
        has_offsets = size >= 4
    elif cookie == 12346:  # SERIAL_COOKIE_NO_RUNCONTAINER
        size = int(np.frombuffer(buf, "<u4", 1, pos + 4)[0])
        run_bits = b""
        p = pos + 8
        has_offsets = True
    else:
        raise ValueError(f"not a Roaring bitmap (cookie {cookie})")
    header = np.frombuffer(buf, "<u2", 2 * size, p).reshape(size, 2).astype(np.uint32)
    p += 4 * size + (4 * size if has_offsets else 0)
    parts = []
    for k in range(size):
        key, card = int(header[k, 0]), int(header[k, 1]) + 1
        if run_bits and run_bits[k // 8] >> (k % 8) & 1:
            n = int(np.frombuffer(buf, "<u2", 1, p)[0])
            runs = np.frombuffer(buf, "<u2", 2 * n, p + 2).reshape(n, 2).astype(np.uint32)
            p += 2 + 4 * n
            low = np.concatenate([np.arange(s, s + ln + 1, dtype=np.uint32) for s, ln in runs])
        elif card <= 4096:
            low = np.frombuffer(buf, "<u2", card, p).astype(np.uint32)
            p += 2 * card
        else:
            words = np.frombuffer(buf, "<u8", 1024, p)
            p += 8192
            low = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
            low = low.astype(np.uint32)
        parts.append((np.uint32(key) << np.uint32(16)) | low)
    values = np.concatenate(parts) if parts else np.zeros(0, np.uint32)
    return values, p


def decode_deletion_vector(data: bytes):
    """Delta's serialized RoaringBitmapArray -> sorted uint64 row indexes it deletes."""
    import numpy as np

    magic = int(np.frombuffer(data, "<u4", 1, 0)[0])
    parts = []
    if magic == _DV_PORTABLE_MAGIC:
        count = int(np.frombuffer(data, "<u8", 1, 4)[0])
        p = 12
        for _ in range(count):
            key = int(np.frombuffer(data, "<u4", 1, p)[0])
            low, p = _roaring32(data, p + 4)
            parts.append((np.uint64(key) << np.uint64(32)) | low.astype(np.uint64))
    elif magic == _DV_NATIVE_MAGIC:
        count = int(np.frombuffer(data, "<u4", 1, 4)[0])
        p = 8
        for key in range(count):
            size = int(np.frombuffer(data, "<u4", 1, p)[0])
            low, _ = _roaring32(data, p + 4)
            p += 4 + size
            parts.append((np.uint64(key) << np.uint64(32)) | low.astype(np.uint64))
    else:
        raise ValueError(f"unknown deletion vector format (magic number {magic})")
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.uint64)


def load_deletion_vector(table_uri: str, dv: Mapping[str, Any], fs=None):
    """The sorted row indexes a ``deletionVector`` descriptor deletes (reads its file if any)."""
    import struct
    import uuid
    import zlib
    from urllib.parse import unquote

    storage, where = dv["storageType"], dv["pathOrInlineDv"]
    size = int(dv["sizeInBytes"])
    if int(dv.get("cardinality", 1)) == 0:
        import numpy as np

        return np.zeros(0, np.uint64)
    try:
        if storage == "i":
            data = z85_decode(where)[:size]
        elif storage in ("u", "p"):
            if storage == "u":
                prefix, encoded = where[:-20], where[-20:]
                name = f"deletion_vector_{uuid.UUID(bytes=z85_decode(encoded))}.bin"
                path = _fs.join(table_uri, prefix, name) if prefix else _fs.join(table_uri, name)
            else:
                path = unquote(where)
            if fs is None:
                fs, _ = _fs.filesystem(table_uri)
            with fs.open(path.removeprefix("file://"), "rb") as f:
                f.seek(int(dv.get("offset") or 0))
                raw = f.read(size + 8)
            (stored_size,) = struct.unpack(">I", raw[:4])
            data = raw[4 : 4 + size]
            if stored_size != size or len(data) != size:
                raise ValueError(f"size {stored_size} in the file, {size} in the log")
            (crc,) = struct.unpack(">I", raw[4 + size : 8 + size])
            if crc != zlib.crc32(data):
                raise ValueError("checksum mismatch")
        else:
            raise ValueError(f"unknown storageType {storage!r}")
        rows = decode_deletion_vector(data)
    except Exception as e:
        raise SourceError(
            f"txn-delta source: cannot read deletion vector {dict(dv)} of {table_uri}: {e}"
        ) from e
    if "cardinality" in dv and len(rows) != int(dv["cardinality"]):
        raise SourceError(
            f"txn-delta source: deletion vector {dict(dv)} of {table_uri} holds {len(rows)} rows, "
            f"its descriptor says {dv['cardinality']}"
        )
    return rows
