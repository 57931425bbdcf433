#!/usr/bin/env python3
"""Writes the authenticated-frame vectors (SPEC.md §3.11, §4.8) with Python's hmac/hashlib/zlib,
independently of the Rust implementation. Run from this directory: python3 gen.py"""
import hashlib, hmac, struct, zlib, pathlib

HERE = pathlib.Path(__file__).parent
PSK = bytes(range(0x40, 0x60))          # 32 bytes 40 41 .. 5f
NC = bytes(range(0xc0, 0xe0))           # client nonce c0 .. df
NS = bytes(range(0xa0, 0xc0))           # server nonce a0 .. bf

def H(key, *parts):
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()

def plain(name):
    """Payload of a plain vector file (header and CRC dropped)."""
    text = (HERE.parent / f"{name}.hex").read_text()
    b = bytes.fromhex("".join(l for l in text.splitlines() if not l.strip().startswith("#")).replace(" ", ""))
    n = struct.unpack_from("<I", b, 8)[0]
    return struct.unpack_from("<H", b, 6)[0], b[12:12 + n]

def header(ftype, n):
    return b"KVWR" + struct.pack("<HHI", 2, ftype | 0x8000, n)

prk = H(PSK, b"kvwire v1 conn", NC, NS)
K_C2S = H(prk, b"kvwire v1 c2s")
K_S2C = H(prk, b"kvwire v1 s2c")

def write(name, comment, fields, tag, ftype):
    body = b"".join(f for _, f in fields)
    frame = body + tag
    crc = zlib.crc32(frame)
    lines = [f"# {c}" for c in comment]
    lines.append(f"# frame type {ftype | 0x8000:#06x}, total {len(frame) + 4} bytes, crc32 {crc:#010x}")
    lines.append("# line 1: header; then the inner payload; then the auth trailer; then the tag; last line: crc32 (LE)")
    for label, f in fields:
        lines.append(f.hex() if label != "header" else
                     f"{f[:4].hex()} {f[4:6].hex()} {f[6:8].hex()} {f[8:12].hex()}")
    lines.append(tag.hex())
    lines.append(struct.pack("<I", crc).hex())
    (HERE / f"{name}.hex").write_text("\n".join(lines) + "\n")
    return tag

keys = f"PSK 40..5f (32 bytes), client nonce c0..df, server nonce a0..bf"

# HELLO: tag = HMAC(PSK, "kvwire v1 hello" || header || body || Nc)
t, body = plain("hello")
hdr = header(t, len(body) + 64)
hello_tag = H(PSK, b"kvwire v1 hello", hdr, body, NC)
write("hello", ["authenticated HELLO: hello.hex's body, then the client nonce, then the tag under the PSK", keys],
      [("header", hdr), ("body", body), ("nonce", NC)], hello_tag, t)

# HELLO_ACK: tag = HMAC(K_s2c, "kvwire v1 hello-ack" || hello_tag || header || body || Ns)
t, body = plain("hello_ack")
hdr = header(t, len(body) + 64)
ack_tag = H(K_S2C, b"kvwire v1 hello-ack", hello_tag, hdr, body, NS)
write("hello_ack", ["authenticated HELLO_ACK: hello_ack.hex's body, then the server nonce, then the tag under the server-to-client key (binding auth/hello.hex's tag)", keys],
      [("header", hdr), ("body", body), ("nonce", NS)], ack_tag, t)

def sealed(name, plain_name, key, seq, what):
    t, body = plain(plain_name) if plain_name else (0x0004, b"")
    hdr = header(t, len(body) + 40)
    s = struct.pack("<Q", seq)
    tag = H(key, hdr, body, s)
    fields = [("header", hdr)] + ([("body", body)] if body else []) + [("seq", s)]
    write(name, [what, keys], fields, tag, t)

sealed("hello_confirm", None, K_C2S, 0, "sealed HELLO_CONFIRM (empty payload), client to server, sequence number 0")
sealed("reserve", "reserve", K_S2C, 0, "sealed RESERVE (reserve.hex's payload), server (receiver) to client, sequence number 0")
sealed("commit", "commit", K_C2S, 1, "sealed COMMIT (commit.hex's payload), client (sender) to server, sequence number 1")
sealed("verified", "verified", K_S2C, 1, "sealed VERIFIED (verified.hex's payload), server to client, sequence number 1")
sealed("ping", "ping", K_S2C, 2, "sealed PING (ping.hex's payload), server to client, sequence number 2")
sealed("pong", "pong", K_C2S, 2, "sealed PONG (pong.hex's payload), client to server, sequence number 2")
