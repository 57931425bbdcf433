"""Prefill and decode in separate OS processes over TCP, with numpy KV buffers: every test
checks bytes and typed reasons, not just states."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvwire
from kvwire import KVPoll, KVReceiver, KVSender

import common
from common import Peer, SENTINEL, wait_state

FINAL = {KVPoll.Success, KVPoll.Failed}


@pytest.fixture
def psk():
    return kvwire.gen_psk()


@pytest.fixture
def prefill(psk):
    p = Peer("prefill", "--psk", psk.hex())
    yield p
    p.close()


def decode_manager(psk, **kw):
    return common.manager("decode", psk, fill=SENTINEL, **kw)


def test_chunked_transfer_every_byte_at_the_chosen_pages(prefill, psk):
    mgr, kv, aux = decode_manager(psk)
    rooms = {}
    rng = np.random.default_rng(7)
    perm = rng.permutation(common.PAGES)
    # Three requests of 7, 12 and 1 pages, scattered destination pages (int32 and int64),
    # sent from scattered source pages in chunks, each with an aux record.
    sizes = [7, 12, 1]
    at = 0
    for i, n in enumerate(sizes):
        room = 0x7000_0000_0000_0000 + i  # bootstrap rooms are large random ids
        dst = perm[at:at + n].astype(np.int32 if i % 2 else np.int64)
        at += n
        r = KVReceiver(mgr, prefill.hello["address"], room)
        r.send_metadata(dst, aux_index=i + 1)
        rooms[room] = (r, [int(x) for x in dst], i + 1)
    src_perm = [int(x) for x in np.random.default_rng(9).permutation(common.PAGES)]
    at = 0
    for room, (r, dst, aux_index) in rooms.items():
        n = len(dst)
        src = src_perm[at:at + n]
        at += n
        chunks = [n] if n == 1 else [n // 3 or 1, n - (n // 3 or 1) - 1, 1]
        chunks = [c for c in chunks if c]
        rep = prefill.call(op="send", room=room, src=src, chunks=chunks, aux_index=aux_index)
        assert rep["error"] is None, rep
    for room, (r, dst, aux_index) in rooms.items():
        assert r.wait(10) == KVPoll.Success, r.error
        assert r.verified_pages() == dst
        assert common.check_landed(kv, aux, room, dst, aux_index) == []
        assert r.aux() == common.aux_record(room)
        rep = prefill.call(op="wait", room=room)
        assert rep["state"] == KVPoll.Success, rep
    # Pages no request chose were never written; kvwire holds nothing afterwards.
    used = {p for (_, dst, _) in rooms.values() for p in dst}
    assert common.untouched(kv, [p for p in range(common.PAGES) if p not in used])
    assert mgr.held_pages() == []


def test_over_three_lanes_every_byte_lands(psk):
    """Both managers with three lanes of the run's transport (SPEC §3.11.1): tcp_streams=3
    over TCP (§9.1; the decode requiring same-host pulls, copied on two pull threads, §9.3),
    ib_queue_pairs=3 over RDMA (§9.2, the decode end busy-polling its completion queues, the
    prefill end sleeping on its completion channel): six requests spread over the
    connection's lanes, every byte at its pages, nothing held afterwards."""
    if common.TRANSPORT == "tcp":
        prefill = Peer("prefill", "--psk", psk.hex(), "--tcp-streams", "3")
        lanes = dict(tcp_streams=3, same_host="require", pull_threads=2)
    else:
        prefill = Peer("prefill", "--psk", psk.hex(), "--ib-queue-pairs", "3")
        lanes = dict(ib_queue_pairs=3, ib_busy_poll=True)
    try:
        mgr, kv, aux = decode_manager(psk, **lanes)
        perm = [int(x) for x in np.random.default_rng(3).permutation(common.PAGES)]
        rooms = {}
        for i in range(6):
            room = 0x7100_0000_0000_0000 + i
            dst = perm[4 * i:4 * i + 4]
            r = KVReceiver(mgr, prefill.hello["address"], room)
            r.send_metadata(dst, aux_index=i + 1)
            rooms[room] = (r, dst, i + 1)
        for room, (r, dst, aux_index) in rooms.items():
            src = perm[-4 * (aux_index + 1):][:4]
            rep = prefill.call(op="send", room=room, src=src, aux_index=aux_index)
            assert rep["error"] is None, rep
        for room, (r, dst, aux_index) in rooms.items():
            assert r.wait(10) == KVPoll.Success, r.error
            assert common.check_landed(kv, aux, room, dst, aux_index) == []
        assert mgr.held_pages() == []
    finally:
        prefill.close()


@pytest.mark.parametrize("setting,value", [
    ("ib_ack_timeout", 0), ("ib_ack_timeout", 32), ("ib_ack_timeout", 300),
    ("ib_queue_pairs", 0), ("ib_queue_pairs", 147), ("ib_queue_pairs", 70000),
    ("ib_stripe_pages", -1), ("ib_stripe_pages", 2**32),
])
def test_an_rdma_setting_out_of_range_is_a_config_error(setting, value):
    """ib_ack_timeout is the verbs exponent, 1 to 31; ib_queue_pairs is 1 to 146 (what a
    HELLO can list); ib_stripe_pages is a page count (0: never striped): anything else is refused with ConfigError naming the value, in any build
    (values are checked before the transport is looked for), rather than truncated, sent to
    the NIC or left to fail every handshake."""
    name = setting.removeprefix("ib_")
    with pytest.raises(kvwire.ConfigError, match=f"{name} = {value}"):
        common.manager("decode", None, insecure_no_auth=True, transport="rdma",
                       **{setting: value})


def test_prefill_rejects_a_prompt_over_its_pool_and_decode_gets_the_original_error(psk):
    # The prefill pool (8 pages, 128 tokens: its served context) is smaller than the decode
    # pool (64): admission rejects the 20-page prompt (PROMPT_EXCEEDS_CONTEXT, kvwire checks
    # the context before the pool, and a pool never holds less than the context); the decode
    # node's reservation is answered with REJECT carrying that code, and none of its pages
    # is written.
    small = Peer("prefill", "--psk", psk.hex(), "--pages", "8")
    try:
        mgr, kv, aux = decode_manager(psk)
        dst = list(range(40, 60))
        r = KVReceiver(mgr, small.hello["address"], 42)
        r.send_metadata(np.array(dst), aux_index=0)
        rep = small.call(op="send", room=42, src=list(range(8)) * 2 + [0, 1, 2, 3], num_pages=20)
        assert rep["state"] == KVPoll.Failed
        assert rep["error"]["kind"] == "Rejected"
        assert rep["error"]["code_name"] == "PROMPT_EXCEEDS_CONTEXT"
        assert rep["error"]["retryable"] is False
        s, _ = wait_state(r, FINAL, 10)
        assert s == KVPoll.Failed
        e = r.error
        assert isinstance(e, kvwire.Rejected) and isinstance(e, kvwire.TransferError)
        assert e.code_name == "PROMPT_EXCEEDS_CONTEXT" and e.code == 0x101
        assert "320 tokens" in str(e) and "128 tokens" in str(e)  # the prefill's own numbers travelled
        assert not e.retryable
        with pytest.raises(kvwire.Rejected):
            r.failure_exception()
        assert common.untouched(kv, dst)
        assert mgr.held_pages() == []
    finally:
        small.close()


def test_prompt_over_the_decode_context_is_rejected_on_both_sides(prefill, psk):
    # Equal pools of 64 pages (1024 tokens, each node's served context); a 1025-token prompt.
    # The decode node refuses it before anything is reserved (PROMPT_EXCEEDS_CONTEXT: it
    # checks its own context, then its pool) and tells the prefill; the prefill's admission
    # refuses it too.
    mgr, kv, aux = decode_manager(psk)
    r = KVReceiver(mgr, prefill.hello["address"], 43)
    r.send_metadata(np.arange(common.PAGES), num_tokens=common.PAGES * common.PAGE_SIZE + 1)
    assert r.poll() == KVPoll.Failed
    assert isinstance(r.error, kvwire.Rejected)
    assert r.error.code_name == "PROMPT_EXCEEDS_CONTEXT"
    assert "1025 tokens" in str(r.error) and "1024 tokens" in str(r.error)
    rep = prefill.call(op="send", room=43, src=list(range(common.PAGES)) + [0],
                       num_pages=common.PAGES + 1, num_tokens=common.PAGES * common.PAGE_SIZE + 1)
    assert rep["state"] == KVPoll.Failed
    # The decode's refusal reached the prefill before its engine admitted the request: the
    # request fails with the decode's code (PeerAborted) before `init`, which then changes
    # nothing; had `init` come first, the prefill's own admission would name the same cause.
    assert rep["error"]["kind"] in ("PeerAborted", "Rejected"), rep
    assert rep["error"]["code_name"] == "PROMPT_EXCEEDS_CONTEXT", rep
    assert rep["error"]["retryable"] is False
    assert common.untouched(kv, list(range(common.PAGES)))


def test_decode_abort_reaches_the_prefill_before_its_final_chunk(prefill, psk):
    mgr, kv, aux = decode_manager(psk)
    dst = [5, 17, 29, 41]
    r = KVReceiver(mgr, prefill.hello["address"], 44)
    r.send_metadata(np.array(dst))
    rep = prefill.call(op="send", room=44, src=[1, 2, 3, 4], chunks=[2, 2], stop_after=1)
    assert rep["state"] == KVPoll.WaitingForInput, rep
    wait_state(r, {KVPoll.Transferring}, 5)
    r.abort()
    assert r.poll() == KVPoll.Failed
    assert isinstance(r.error, kvwire.Aborted) and r.error.code_name == "CANCELLED"
    deadline = time.monotonic() + 5
    while True:
        rep = prefill.call(op="poll", room=44)
        if rep["state"] == KVPoll.Failed or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert rep["state"] == KVPoll.Failed
    assert rep["error"]["kind"] == "PeerAborted", rep
    assert rep["error"]["code_name"] == "CANCELLED"
    # Fenced, then released: kvwire holds none of the decode pages.
    deadline = time.monotonic() + 5
    while mgr.held_pages() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert mgr.held_pages() == []


def test_prefill_abort_reaches_the_decode(prefill, psk):
    mgr, kv, aux = decode_manager(psk)
    dst = [60, 3, 33]
    r = KVReceiver(mgr, prefill.hello["address"], 45)
    r.send_metadata(np.array(dst))
    rep = prefill.call(op="send", room=45, src=[7, 8, 9], chunks=[1, 2], stop_after=1)
    assert rep["state"] == KVPoll.WaitingForInput
    rep = prefill.call(op="abort", room=45)
    assert rep["state"] == KVPoll.Failed and rep["error"]["kind"] == "Aborted"
    s, took = wait_state(r, FINAL, 5)
    assert s == KVPoll.Failed
    assert isinstance(r.error, kvwire.PeerAborted), r.error
    assert r.error.code_name == "CANCELLED" and not r.error.retryable
    assert mgr.held_pages() == []


def test_prefill_killed_fails_the_decode_with_peer_lost(psk):
    p = Peer("prefill", "--psk", psk.hex())
    mgr, kv, aux = decode_manager(psk)
    dst = [9, 10, 11]
    r = KVReceiver(mgr, p.hello["address"], 46)
    r.send_metadata(np.array(dst))
    rep = p.call(op="send", room=46, src=[1, 2, 3], chunks=[1, 2], stop_after=1)
    assert rep["state"] == KVPoll.WaitingForInput
    assert wait_state(r, {KVPoll.Transferring}, 5)[0] == KVPoll.Transferring
    p.kill()
    s, took = wait_state(r, FINAL, 10)
    assert s == KVPoll.Failed
    assert isinstance(r.error, kvwire.PeerLost), r.error  # PeerUnresponsive is a PeerLost
    assert r.error.retryable
    # Not how soon (benchmarks measure that): the error is the connection's loss, which no
    # transfer deadline gives.
    print(f"decode failed {took:.2f} s after the prefill was killed")
    assert mgr.held_pages() == []


def test_decode_killed_fails_the_prefill_with_peer_lost(psk):
    mgr, kv, aux = common.manager("prefill", psk)
    d = Peer("decode", "--psk", psk.hex())
    try:
        dst = [20, 21, 22, 23]
        rep = d.call(op="recv", room=47, address=mgr.address, dst=dst)
        assert rep["state"] == KVPoll.Transferring, rep
        s = KVSender(mgr, None, 47)
        assert wait_state(s, {KVPoll.WaitingForInput}, 5)[0] == KVPoll.WaitingForInput
        s.init(4)
        s.send(np.array([0, 1]))
        d.kill()
        st, took = wait_state(s, FINAL, 10)
        assert st == KVPoll.Failed
        e = s.error
        lost = isinstance(e, kvwire.PeerLost) or (isinstance(e, kvwire.Unconfirmed) and e.cause in ("PeerLost", "PeerUnresponsive"))
        assert lost, e
        assert e.retryable
        print(f"prefill failed {took:.2f} s after the decode was killed")
        with pytest.raises(kvwire.TransferError):
            s.failure_exception()
    finally:
        d.close()


def test_wrong_pre_shared_key_is_refused(prefill):
    mgr, kv, aux = decode_manager(kvwire.gen_psk())  # not the prefill's key
    r = KVReceiver(mgr, prefill.hello["address"], 48)
    r.send_metadata(np.array([1, 2]))
    s, _ = wait_state(r, FINAL, 10)
    assert s == KVPoll.Failed
    assert isinstance(r.error, kvwire.Unauthenticated), r.error
    assert r.error.code_name in ("AUTH_FAILED", "AUTH_MISMATCH")
    assert common.untouched(kv, [1, 2])
    # And with no key at all on the decode side: refused too.
    mgr2, kv2, _ = common.manager("decode", None, fill=SENTINEL)
    r2 = KVReceiver(mgr2, prefill.hello["address"], 49)
    s, _ = wait_state(r2, FINAL, 10)
    assert s == KVPoll.Failed and isinstance(r2.error, kvwire.Unauthenticated), r2.error
    assert r2.error.code_name == "AUTH_MISMATCH"


def test_the_byte_check_catches_one_flipped_byte():
    # The checks above can fail: one byte off in one page, or in the aux slot, is reported.
    kv, aux = common.buffers()
    common.fill_source(kv, aux, 5, [3, 4], 1)
    assert common.check_landed(kv, aux, 5, [3, 4], 1) == []
    kv[2][4][4095] ^= 1
    aux[1][1][7] ^= 0x80
    found = common.check_landed(kv, aux, 5, [3, 4], 1)
    assert len(found) == 2
    assert found[0] == "page 4 (ordinal 1) buffer 2"
    assert found[1].startswith("aux slot 1")


def test_nobody_listening_fails_typed_and_a_later_receiver_connects(psk):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mgr, kv, aux = decode_manager(psk)
    r = KVReceiver(mgr, f"127.0.0.1:{port}", 60)
    st, _ = wait_state(r, FINAL, 10)
    assert st == KVPoll.Failed and isinstance(r.error, kvwire.ConnectFailed), r.error
    assert r.error.retryable
    # The prefill comes up there later: a new receiver connects (the failure is not cached).
    p = Peer("prefill", "--psk", psk.hex(), env={"KVWIRE_TEST_LISTEN": f"127.0.0.1:{port}"})
    try:
        r2 = KVReceiver(mgr, p.hello["address"], 61)
        r2.send_metadata(np.array([4, 5]))
        rep = p.call(op="send", room=61, src=[0, 1])
        assert rep["error"] is None, rep
        assert r2.wait(10) == KVPoll.Success, r2.error
        assert common.check_landed(kv, aux, 61, [4, 5], None) == []
    finally:
        p.close()


def test_a_reservation_that_arrives_long_before_init_is_held(prefill, psk):
    # The decode node reserves; the prefill's scheduler calls init 5.5 s later (past kvwire's
    # default 5 s for a reservation naming no known request): still delivered.
    mgr, kv, aux = decode_manager(psk)
    r = KVReceiver(mgr, prefill.hello["address"], 62)
    r.send_metadata(np.array([30, 31]), aux_index=7)
    assert wait_state(r, {KVPoll.Transferring}, 5)[0] == KVPoll.Transferring
    time.sleep(5.5)
    rep = prefill.call(op="send", room=62, src=[40, 41], aux_index=7)
    assert rep["error"] is None, rep
    assert r.wait(10) == KVPoll.Success, r.error
    assert common.check_landed(kv, aux, 62, [30, 31], 7) == []


def test_poll_returns_at_once_while_a_transfer_is_open(prefill, psk):
    mgr, kv, aux = decode_manager(psk)
    r = KVReceiver(mgr, prefill.hello["address"], 63)
    r.send_metadata(np.array([1]))
    wait_state(r, {KVPoll.Transferring}, 5)
    start = time.perf_counter()
    for _ in range(10_000):
        assert r.poll() == KVPoll.Transferring  # nobody sends: it stays open
    # A poll that waited for anything (nobody sends) would hold this loop for its timeout
    # 10,000 times; how fast a poll is, is for the benchmarks.
    print(f"{(time.perf_counter() - start) / 10_000 * 1e6:.1f} us per poll")
    r.abort()
