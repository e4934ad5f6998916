"""Delta log entries written by hand from the protocol spec (PROTOCOL.md), for what delta-rs
cannot write: deletion vectors (inline and in ``u``-type files), column-mapping renames,
reader features, Spark-style partition values.

Written from the spec, not from any implementation:
- Z85 (ZeroMQ RFC 32) with Delta's alphabet; 4-byte big-endian blocks.
- ``RoaringBitmapArray`` "portable" format: little-endian magic 1681511377, u64 bucket count,
  then per bucket a u32 key (high 32 bits) and a standard 32-bit Roaring bitmap
  (RoaringFormatSpec: cookie, descriptive header, offsets, array/bitset/run containers).
- DV files: version byte 1, then per DV a big-endian u32 size, the bitmap, a big-endian CRC-32.
"""

from __future__ import annotations

import json
import os
import struct
import time
import uuid as uuidlib
import zlib
from collections.abc import Iterable

Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
PORTABLE_MAGIC = 1681511377
NATIVE_MAGIC = 1681511376
_NO_RUN_COOKIE = 12346
_RUN_COOKIE = 12347


def z85_encode(data: bytes) -> str:
    data = data + b"\0" * (-len(data) % 4)
    out = []
    for i in range(0, len(data), 4):
        value = int.from_bytes(data[i : i + 4], "big")
        chunk = []
        for _ in range(5):
            value, digit = divmod(value, 85)
            chunk.append(Z85[digit])
        out.append("".join(reversed(chunk)))
    return "".join(out)


def _roaring32(values: list[int], runs: bool) -> bytes:
    """A standard 32-bit Roaring bitmap of sorted ``values`` (all < 2**32)."""
    containers: dict[int, list[int]] = {}
    for v in values:
        containers.setdefault(v >> 16, []).append(v & 0xFFFF)
    keys = sorted(containers)
    bodies, is_run = [], []
    for key in keys:
        lows = containers[key]
        ranges = []
        for low in lows:
            if ranges and ranges[-1][1] == low - 1:
                ranges[-1][1] = low
            else:
                ranges.append([low, low])
        if runs and 2 + 4 * len(ranges) < min(2 * len(lows), 8192):
            body = struct.pack("<H", len(ranges))
            body += b"".join(struct.pack("<HH", a, b - a) for a, b in ranges)
            is_run.append(True)
        elif len(lows) <= 4096:
            body = struct.pack(f"<{len(lows)}H", *lows)
            is_run.append(False)
        else:
            words = [0] * 1024
            for low in lows:
                words[low >> 6] |= 1 << (low & 63)
            body = struct.pack("<1024Q", *words)
            is_run.append(False)
        bodies.append(body)
    size = len(keys)
    descriptive = b"".join(struct.pack("<HH", key, len(containers[key]) - 1) for key in keys)
    if any(is_run):
        bits = bytearray((size + 7) // 8)
        for i, r in enumerate(is_run):
            if r:
                bits[i // 8] |= 1 << (i % 8)
        head = struct.pack("<I", _RUN_COOKIE | ((size - 1) << 16)) + bytes(bits) + descriptive
        with_offsets = size >= 4
    else:
        head = struct.pack("<II", _NO_RUN_COOKIE, size) + descriptive
        with_offsets = True
    if with_offsets:
        start = len(head) + 4 * size
        offsets = []
        for body in bodies:
            offsets.append(struct.pack("<I", start))
            start += len(body)
        head += b"".join(offsets)
    return head + b"".join(bodies)


def roaring_bitmap_array(rows: Iterable[int], runs: bool = False) -> bytes:
    """Delta's serialized DV (portable format) for the deleted row indexes ``rows``."""
    buckets: dict[int, list[int]] = {}
    for r in sorted(set(rows)):
        buckets.setdefault(r >> 32, []).append(r & 0xFFFFFFFF)
    out = struct.pack("<IQ", PORTABLE_MAGIC, len(buckets))
    for key in sorted(buckets):
        out += struct.pack("<I", key) + _roaring32(buckets[key], runs)
    return out


def inline_dv(rows: Iterable[int], runs: bool = False) -> dict:
    rows = sorted(set(rows))
    data = roaring_bitmap_array(rows, runs)
    return {
        "storageType": "i",
        "pathOrInlineDv": z85_encode(data),
        "sizeInBytes": len(data),
        "cardinality": len(rows),
    }


def dv_file(table: str, dvs: list[list[int]], prefix: str = "", runs: bool = False) -> list[dict]:
    """One ``u``-type DV file holding several DVs; their descriptors, in order."""
    uid = uuidlib.uuid4()
    folder = os.path.join(table, prefix) if prefix else table
    os.makedirs(folder, exist_ok=True)
    blob, descriptors = bytearray(b"\x01"), []
    for rows in dvs:
        rows = sorted(set(rows))
        data = roaring_bitmap_array(rows, runs)
        descriptors.append(
            {
                "storageType": "u",
                "pathOrInlineDv": prefix + z85_encode(uid.bytes),
                "offset": len(blob),
                "sizeInBytes": len(data),
                "cardinality": len(rows),
            }
        )
        blob += struct.pack(">I", len(data)) + data + struct.pack(">I", zlib.crc32(data))
    with open(os.path.join(folder, f"deletion_vector_{uid}.bin"), "wb") as f:
        f.write(blob)
    return descriptors


# --- the log ---------------------------------------------------------------------------


def log_actions(table: str, version: int) -> list[dict]:
    with open(os.path.join(table, "_delta_log", f"{version:020d}.json")) as f:
        return [json.loads(line) for line in f if line.strip()]


def latest_version(table: str) -> int:
    names = os.listdir(os.path.join(table, "_delta_log"))
    return max(int(n[:20]) for n in names if n.endswith(".json") and n[:20].isdigit())


def current_adds(table: str) -> dict[str, dict]:
    """path -> add action of the live files, by replaying the JSON commits (no checkpoints)."""
    live: dict[str, dict] = {}
    for v in range(latest_version(table) + 1):
        for a in log_actions(table, v):
            if "remove" in a:
                live.pop(a["remove"]["path"], None)
            if "add" in a:
                live[a["add"]["path"]] = a["add"]
    return live


def current_metadata(table: str) -> dict:
    meta = None
    for v in range(latest_version(table) + 1):
        for a in log_actions(table, v):
            meta = a.get("metaData", meta)
    assert meta is not None
    return meta


def commit(table: str, actions: list[dict], operation: str = "HANDMADE") -> int:
    """Append one commit; returns its version."""
    version = latest_version(table) + 1
    now = int(time.time() * 1000)
    lines = [{"commitInfo": {"timestamp": now, "operation": operation, "engineInfo": "corpus"}}]
    lines += actions
    path = os.path.join(table, "_delta_log", f"{version:020d}.json")
    with open(path, "x") as f:
        f.write("\n".join(json.dumps(a, allow_nan=False) for a in lines) + "\n")
    return version


def remove_of(add: dict) -> dict:
    return {
        "remove": {
            "path": add["path"],
            "deletionTimestamp": int(time.time() * 1000),
            "dataChange": True,
            "extendedFileMetadata": True,
            "partitionValues": add.get("partitionValues") or {},
            "size": add["size"],
            **({"deletionVector": add["deletionVector"]} if add.get("deletionVector") else {}),
        }
    }


def with_dv(add: dict, dv: dict) -> dict:
    new = {k: v for k, v in add.items() if v is not None}
    new["deletionVector"] = dv
    new["dataChange"] = True
    return {"add": new}
