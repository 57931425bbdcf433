"""kvwire.sglang in SGLang's shape (the plain classes when SGLang is absent): a bootstrap
server, a prefill and a decode manager built from KVArgs by pointer, one request in two
chunks with its aux record, every byte checked."""

from __future__ import annotations

import os

import numpy as np

import kvwire
from kvwire import KVArgs, buffer_address
from kvwire.sglang import (
    KvwireKVBootstrapServer,
    KvwireKVManager,
    KvwireKVReceiver,
    KvwireKVSender,
)

import common


class Mode:  # SGLang's DisaggregationMode has .name / .value "prefill" / "decode"
    def __init__(self, v):
        self.value = v


def kv_args(kv, aux, rank=0):
    a = KVArgs(engine_rank=rank, page_size=common.PAGE_SIZE)
    for b in kv:
        p, n = buffer_address(b)
        a.kv_data_ptrs.append(p)
        a.kv_data_lens.append(n)
        a.kv_item_lens.append(b[0].nbytes)
    for b in aux:
        p, n = buffer_address(b)
        a.aux_data_ptrs.append(p)
        a.aux_data_lens.append(n)
        a.aux_item_lens.append(b[0].nbytes)
    return a


def test_sglang_flow(monkeypatch):
    monkeypatch.setenv("KVWIRE_PSK", kvwire.gen_psk().hex())
    server = KvwireKVBootstrapServer("127.0.0.1", 0)
    pkv, paux = common.buffers()
    dkv, daux = common.buffers(fill=common.SENTINEL)
    prefill = KvwireKVManager(kv_args(pkv, paux, rank=1), Mode("prefill"), None, bootstrap=server.address, keepalive=(pkv, paux))
    decode = KvwireKVManager(kv_args(dkv, daux, rank=1), Mode("decode"), None, keepalive=(dkv, daux))
    room = 2**62 + 11
    src, dst = [4, 9, 13, 2, 60], np.array([40, 1, 22, 7, 59], dtype=np.int32)
    common.fill_source(pkv, paux, room, src, 3)

    receiver = KvwireKVReceiver(decode, server.address, room)
    receiver.send_metadata(dst, aux_index=6)
    sender = KvwireKVSender(prefill, server.address, room)
    common.wait_state(sender, {2}, 10)
    assert sender.poll() == 2  # WaitingForInput
    sender.init(len(src), aux_index=3)
    sender.send(np.array(src[:3], dtype=np.int32))
    sender.send(np.array(src[3:], dtype=np.int32))
    assert common.wait_state(receiver, {0, 4}, 10)[0] == 4, receiver.t.error
    assert common.wait_state(sender, {0, 4}, 10)[0] == 4, sender.t.error
    receiver.failure_exception()  # nothing to raise
    bad = []
    for ordinal, p in enumerate(dst):
        for b in range(common.BUFFERS):
            if not np.array_equal(dkv[b][p], common.pattern(room, ordinal, b)):
                bad.append((p, b))
    assert bad == []
    assert bytes(daux[0][6]) + bytes(daux[1][6]) == common.aux_record(room)
    server.close()
