"""The wire form of a diff's new_block_ids ({handle: [block ids appended]}): one byte string of
unsigned LEB128 varints, about 1 byte per growing request plus a few per run of blocks.

The pool hands out blocks from the head of its free queue, so the blocks a step appends are
mostly consecutive ids; and requests grow one block at a time. So the map is sent as its handles
(sorted, as gaps) with their block counts, then every block id, in the same order, as runs:

    varint n                                      number of handles
    n x  varint (gap << 1 | more)                 gap = handle - previous handle - 1 (first:
         [varint count]      only when more = 1     previous = -1); more = 1 when the handle
                                                    does not get exactly one block
    runs until count blocks are covered:
         varint (zigzag(start - expected) << 1 | long)   expected = end of the previous run
         [varint length - 2]  only when long = 1           (first: 0); long = 1 for 2+ blocks

    zigzag(d) = 2d for d >= 0, -2d - 1 for d < 0

Example: handles 3, 4 and 9 each take one block, 700, 701 and 702 -> n=3, gaps 3, 0, 4 (each
shifted left), one long run: zigzag(700) << 1 | 1, length 3 - 2 -> 7 bytes.
"""
from __future__ import annotations

# Limits that keep garbage from allocating much: a varint is at most 64 bits, and a step appends
# at most this many blocks (2**20 blocks of 16 tokens is far past any step's token budget).
MAX_BLOCK_IDS = 1 << 20
_MAX_VARINT_BYTES = 10


def pack_new_blocks(new_block_ids: dict[int, list[int]]) -> bytes:
    """Encode {handle: [block ids]} (non-negative ints) as described above."""
    out = bytearray()
    _put(out, len(new_block_ids))
    prev = -1
    ids: list[int] = []
    for handle in sorted(new_block_ids):
        blocks = new_block_ids[handle]
        if len(blocks) == 1:
            gap = (handle - prev - 1) << 1
            if gap < 0x80:
                out.append(gap)               # the common case: one byte per handle
            else:
                _put(out, gap)
            ids.append(blocks[0])
        else:
            _put(out, (handle - prev - 1) << 1 | 1)
            _put(out, len(blocks))
            ids += blocks
        prev = handle
    _put_runs(out, ids)
    return bytes(out)


def _put_runs(out: bytearray, ids: list[int]) -> None:
    expected, i, n = 0, 0, len(ids)
    while i < n:
        start = ids[i]
        j = i + 1
        while j < n and ids[j] == ids[j - 1] + 1:
            j += 1
        d = start - expected
        _put(out, ((d << 1) if d >= 0 else (-d << 1) - 1) << 1 | (j - i > 1))
        if j - i > 1:
            _put(out, j - i - 2)
        expected, i = ids[j - 1] + 1, j


def _put(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)


def unpack_new_blocks(data: bytes) -> dict[int, list[int]]:
    """Decode pack_new_blocks' bytes. Raises ValueError (naming what is wrong) for bytes that
    are not a well-formed encoding (truncated, trailing bytes, runs that do not add up)."""
    values = _varints(data)
    try:
        n, pos = values[0], 1
        if n > len(values):
            raise ValueError(f"new_block_ids: {n} handles in {len(values)} varints")
        counts, handle = {}, -1
        for _ in range(n):
            v = values[pos]
            handle += (v >> 1) + 1
            counts[handle] = values[pos + 1] if v & 1 else 1
            pos += 1 + (v & 1)
        total = sum(counts.values())
        if total > MAX_BLOCK_IDS:
            raise ValueError(f"new_block_ids: {total} blocks, at most {MAX_BLOCK_IDS}")
        ids, pos = _read_runs(values, pos, total)
    except IndexError:
        raise ValueError("new_block_ids: truncated") from None
    if pos != len(values):
        raise ValueError(f"new_block_ids: {len(values) - pos} varints after the last run")
    out, i = {}, 0
    for handle, count in counts.items():
        out[handle] = ids[i:i + count]
        i += count
    return out


def _read_runs(values: list[int], pos: int, total: int) -> tuple[list[int], int]:
    ids: list[int] = []
    expected = 0
    while len(ids) < total:
        v = values[pos]
        z, length = v >> 1, values[pos + 1] + 2 if v & 1 else 1
        pos += 1 + (v & 1)
        start = expected + ((z >> 1) if not z & 1 else -((z + 1) >> 1))
        if start < 0 or len(ids) + length > total:
            raise ValueError(f"new_block_ids: run of {length} at {start} does not fit "
                             f"{total} non-negative block ids")
        ids += range(start, start + length)
        expected = start + length
    return ids, pos


def _varints(data: bytes) -> list[int]:
    """Every varint in `data`, in order."""
    out: list[int] = []
    value = shift = 0
    for byte in data:
        if byte < 0x80 and not shift:
            out.append(byte)                  # the common one-byte varint
            continue
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            if value >> 64:
                raise ValueError(f"new_block_ids: varint {value} does not fit 64 bits")
            out.append(value)
            value = shift = 0
        else:
            shift += 7
            if shift >= 7 * _MAX_VARINT_BYTES:
                raise ValueError(f"new_block_ids: varint longer than {_MAX_VARINT_BYTES} bytes")
    if shift:
        raise ValueError("new_block_ids: truncated varint")
    return out
