#!/usr/bin/env python3
"""Writes the plain (unauthenticated) frame vectors of kvwire protocol version 2 (SPEC.md §3)
field by field, with explicit little-endian packing and zlib.crc32, independently of the Rust
encoder. Run from this directory: python3 gen_plain.py (then auth/gen.py, which reads these)."""
import pathlib, struct, zlib

HERE = pathlib.Path(__file__).parent
VERSION = 2
TID = 0x0102030405060708
NONCE = 0x1112131415161718
LINE3 = "# line 1: header (magic, version, type, payload len); then one payload field per line; last line: crc32 (LE)"
LINE3_EMPTY = "# line 1: header (magic, version, type, payload len); last line: crc32 (LE)"


def u8(v): return struct.pack("<B", v)
def u16(v): return struct.pack("<H", v)
def u32(v): return struct.pack("<I", v)
def u64(v): return struct.pack("<Q", v)
def str16(s): return u16(len(s.encode())) , s.encode()


def write(name, ftype, comment, fields):
    """fields: payload fields in wire order, each bytes (one line; an empty one gets no line)."""
    payload = b"".join(fields)
    header = b"KVWR" + u16(VERSION) + u16(ftype) + u32(len(payload))
    crc = zlib.crc32(header + payload)
    lines = [f"# {comment}",
             f"# frame type {ftype:#06x}, payload {len(payload)} bytes, total {len(payload) + 16} bytes, crc32 {crc:#010x}",
             LINE3 if payload else LINE3_EMPTY,
             f"{header[:4].hex()} {header[4:6].hex()} {header[6:8].hex()} {header[8:12].hex()}"]
    lines += [f.hex() for f in fields if f]
    lines.append(u32(crc).hex())
    (HERE / f"{name}.hex").write_text("\n".join(lines) + "\n")


def ref():
    return [u64(TID), u64(NONCE)]


FINGERPRINT = b"llama-3-8b/tp2of8"
REF_TEXT = "transfer 0x0102030405060708 nonce 0x1112131415161718"


def hello_fields(node_id, role, digests, params, max_aux):
    return [u64(node_id), u8(role), u32(16), u16(2), u32(65536), u32(32768),
            u8(len(FINGERPRINT)), FINGERPRINT, u8(len(digests)), bytes(digests),
            u16(len(params)), params, u32(max_aux)]


write("hello", 0x0001,
      "HELLO from a SENDER: node 0x2122232425262728, 16 tokens/page, 2 buffers (65536, 32768 bytes/page), "
      "fingerprint \"llama-3-8b/tp2of8\", digests [XXH3_64, CRC32], transport params 01 02 03 04, max_aux 0",
      hello_fields(0x2122232425262728, 1, [1, 2], bytes([1, 2, 3, 4]), 0))
write("hello_ack", 0x0002,
      "HELLO_ACK from a RECEIVER: node 0x3132333435363738, same layout, digests [CRC32, XXH3_64], "
      "no transport params, max_aux 4096",
      hello_fields(0x3132333435363738, 2, [2, 1], b"", 4096))

n, d = str16("tokens per page: local 16, peer 32")
write("hello_reject", 0x0003,
      "HELLO_REJECT LAYOUT_MISMATCH (0x0003), detail \"tokens per page: local 16, peer 32\"",
      [u16(0x0003), n, d])
# No plain HELLO_CONFIRM vector: an unsealed HELLO_CONFIRM is never valid on a connection
# (SPEC.md §3.6, §4.8), so the only HELLO_CONFIRM vector is the sealed auth/hello_confirm.hex
# (auth/gen.py builds it from the type and the empty payload). An older run wrote one here.
(HERE / "hello_confirm.hex").unlink(missing_ok=True)

write("reserve", 0x0010,
      f"RESERVE {REF_TEXT}, 40 tokens, digest XXH3_64, page digests on, deadline 5000 ms, pages [7, 3, 0x12345], access de ad be ef 00 01",
      [u64(TID), u64(NONCE), u32(40), u8(1), u8(1), u32(5000), u32(3), u32(7), u32(3), u32(0x12345),
       u16(6), bytes.fromhex("deadbeef0001")])

n, d = str16("prompt needs 9 pages, pool has 8")
write("reject", 0x0011,
      f"REJECT {REF_TEXT}, PROMPT_EXCEEDS_POOL (0x0100), detail \"prompt needs 9 pages, pool has 8\"",
      ref() + [u16(0x0100), n, d])

write("commit", 0x0012,
      f"COMMIT {REF_TEXT}, 40 tokens, 3 pages, 294912 bytes, XXH3_64, buffer digests [00..0f, 10..1f] (raw bytes), "
      "6 page digests 0xa0a1a2a3a4a5a6a0 + i (2 buffers x 3 pages, buffer-major), aux digest 20..2f (raw bytes), empty aux",
      ref() + [u32(40), u32(3), u64(3 * (65536 + 32768)), u8(1), u16(2), bytes(range(0x00, 0x10)), bytes(range(0x10, 0x20)),
               u32(6)] + [u64(0xa0a1a2a3a4a5a6a0 + i) for i in range(6)] + [bytes(range(0x20, 0x30)), u32(0), b""])

AUX = u32(128000) + bytes(range(0x70, 0x78))
write("commit_aux", 0x0012,
      f"COMMIT {REF_TEXT}, 16 tokens, 1 page, 98304 bytes, CRC32, buffer digests [00..0f, 10..1f] (raw bytes), "
      "no page digests, aux digest 30..3f (raw bytes), aux of 12 bytes: u32 128000 (a first output token) then 70..77",
      ref() + [u32(16), u32(1), u64(65536 + 32768), u8(2), u16(2), bytes(range(0x00, 0x10)), bytes(range(0x10, 0x20)),
               u32(0), bytes(range(0x30, 0x40)), u32(len(AUX)), AUX])

write("verified", 0x0013, f"VERIFIED {REF_TEXT}", ref())

n, d = str16("digest mismatch in buffer 1, page ordinal 2")
write("nack", 0x0014,
      f"NACK {REF_TEXT}, DIGEST_MISMATCH (0x0301), buffer 1, page 2, detail \"digest mismatch in buffer 1, page ordinal 2\"",
      ref() + [u16(0x0301), u32(1), u32(2), n, d])

n, d = str16("cancelled by engine \u2014 client gone")
write("abort", 0x0015,
      f"ABORT {REF_TEXT}, CANCELLED (0x0401), 2 pages completed, detail \"cancelled by engine \u2014 client gone\" (contains U+2014, 3 bytes in UTF-8)",
      ref() + [u16(0x0401), u32(2), n, d])

write("abort_ack", 0x0016, f"ABORT_ACK {REF_TEXT}", ref())

write("ping", 0x0020, "PING, token 0x0102030405060708 (heartbeat, either direction)", [u64(0x0102030405060708)])
write("pong", 0x0021, "PONG, token 0x0102030405060708 (the answer to ping.hex)", [u64(0x0102030405060708)])
