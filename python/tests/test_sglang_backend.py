"""kvwire under SGLang's own code (the pinned sglang 0.5.23, scripts/sglang-tests.sh installs it).

The prefill engine is this process, each decode engine its own process (sglang_peer.py);
both build SGLang's real ServerArgs (parsed from the launch command in docs/sglang.md), KVArgs,
MetadataBuffers and Req, take kvwire's classes from SGLang's get_kv_class, and replay the
scheduler's calls with the arguments prefill.py / decode.py pass (file:line in comments).
Every test compares bytes: KV pages, state slots and the aux record that landed, or the
sentinel bytes of pages nothing may have touched.

Tests that need the core's routing by the decode's reservation (no `dest`), the WaitingForInput
that waits for it, and the decode's refusal reaching the prefill are marked `core_routing`
in their docstrings."""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import kvwire
import common
import sglang_common as sc
from ports import free_port

PSK = kvwire.gen_psk()


@pytest.fixture(scope="module")
def ks():
    ks = sc.require_sglang()
    os.environ["KVWIRE_PSK"] = PSK.hex()  # every manager (and peer) reads it, as a server does
    ks.install()
    return ks


class Prefill:
    """This process's prefill server: its bootstrap server (disagg_service.py:42-47) and one
    prefill rank's manager (prefill.py:358-367), built from SGLang's real ServerArgs."""

    def __init__(self, ks, pages: int = sc.PAGES, states: bool = True) -> None:
        from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class

        self.ks = ks
        self.server_args = sc.server_args("prefill", free_port())
        self.backend = TransferBackend(self.server_args.disaggregation_transfer_backend)  # scheduler.py:1513
        self.bootstrap = get_kv_class(self.backend, KVClassType.BOOTSTRAP_SERVER)(
            host=self.server_args.host, port=self.server_args.disaggregation_bootstrap_port
        )
        self.addr = f"{self.server_args.host}:{self.server_args.disaggregation_bootstrap_port}"
        self.eng = sc.Engine(pages=pages, states=states)
        self.mgr = get_kv_class(self.backend, KVClassType.MANAGER)(
            self.eng.kv_args(ks), DisaggregationMode.PREFILL, self.server_args, False
        )

    def sender(self, room: int):
        from sglang.srt.disaggregation.utils import KVClassType, get_kv_class

        # prefill.py:401-413 (create_sender)
        return get_kv_class(self.backend, KVClassType.SENDER)(
            mgr=self.mgr, bootstrap_addr=self.addr, bootstrap_room=room,
            req_has_disagg_prefill_dp_rank=False,
        )

    def run(self, room, src, aux_index, state_src, chunks=None, prompt_tokens=None, first_token=7, timeout=20.0):
        """The prefill scheduler's side of one request after the decode reserved: poll to
        WaitingForInput (prefill.py:529 pop_bootstrapped), pop_decode_prefix_len and init
        (prefill.py:437-442 finalize_bootstrap), set_buf and send chunk by chunk
        (prefill.py:1550-1780 _send_kv_chunk), poll to the verdict (prefill.py:1170-1235)."""
        s = self.sender(room)
        state, _ = sc.wait(s, {0, 2}, timeout)
        if state != 2:
            return s
        assert s.pop_decode_prefix_len() == 0
        prompt_tokens = prompt_tokens or len(src) * sc.PAGE_SIZE
        req = sc.make_req(room, prompt_tokens, first_token)
        req.metadata_buffer_index = aux_index
        num_pages = sc.kv_to_page_num(prompt_tokens)  # prefill.py:447 _num_pages_to_send
        s.init(num_pages, req.metadata_buffer_index)
        self.eng.fill_request(room, src, state_src)
        chunks = chunks or [len(src)]
        start = 0
        for i, n in enumerate(chunks):
            last = i == len(chunks) - 1
            if last:
                self.eng.meta.set_buf(req)  # prefill.py:1573
            pages = np.array(src[start:start + n], dtype=np.int64)
            if not s.should_send_kv_chunk(len(pages), last):  # prefill.py:1765
                continue
            state_indices = [None if x is None else np.array(x, np.int32) for x in state_src] if last else None
            tokens = min(prompt_tokens, (start + n) * sc.PAGE_SIZE) - start * sc.PAGE_SIZE
            s.send(pages, state_indices, num_kv_tokens=tokens)  # prefill.py:1776
            start += n
        sc.wait(s, {0, 4}, timeout)
        return s

    def close(self) -> None:
        self.mgr.close()
        self.bootstrap.close()


@pytest.fixture(scope="module")
def prefill(ks):
    p = Prefill(ks)
    yield p
    p.close()


@pytest.fixture(scope="module")
def decode(ks):
    d = sc.DecodePeer()
    yield d
    d.close()


def recv(peer, prefill, room, dst, aux_index, state_dst=None, **kw):
    r = peer.call(timeout=180, op="recv", room=room, bootstrap_addr=prefill.addr, dst=dst,
                  aux_index=aux_index, state_dst=state_dst, **kw)
    assert "exception" not in r, r
    return r


def expect_verified(peer, room, dst, aux_index, state_dst, first_token=7):
    w = peer.call(timeout=180, op="wait", room=room, dst=dst, aux_index=aux_index, state_dst=state_dst)
    assert w["state"] == 4, w
    assert w["bad"] == [], w["bad"]
    assert w["aux"] == {"output_id": first_token, "cached_tokens": 3, "bootstrap_room": room}, w["aux"]
    assert w["raised"] is None
    return w


# -- the backend as SGLang finds it ----------------------------------------------------------


def test_sglang_selects_kvwire_classes_with_its_own_signatures(ks):
    """get_kv_class(TransferBackend("kvwire"), ...) gives kvwire's classes; each implements
    every abstract method of SGLang's base class with the base's parameters (names, order,
    defaults), read from SGLang's code, not copied by hand."""
    from sglang.srt.disaggregation.base import conn as base
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    b = TransferBackend("kvwire")
    pairs = {
        KVClassType.MANAGER: base.BaseKVManager,
        KVClassType.SENDER: base.BaseKVSender,
        KVClassType.RECEIVER: base.BaseKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: base.BaseKVBootstrapServer,
    }
    assert get_kv_class(b, KVClassType.KVARGS) is base.KVArgs
    for kind, parent in pairs.items():
        cls = get_kv_class(b, kind)
        assert cls.__module__ == "kvwire.sglang" and issubclass(cls, parent), (kind, cls)
        assert not inspect.isabstract(cls), (cls, cls.__abstractmethods__)
        for name in parent.__abstractmethods__:
            want = [(p.name, p.default) for p in inspect.signature(getattr(parent, name)).parameters.values()]
            got = [(p.name, p.default) for p in inspect.signature(getattr(cls, name)).parameters.values()
                   if p.kind is not inspect.Parameter.VAR_KEYWORD]
            assert got == want, f"{cls.__name__}.{name}{got} != SGLang's {want}"
    # The modules that imported get_kv_class by name (prefill.py, decode.py, disagg_service.py)
    # see kvwire too.
    import sglang.srt.disaggregation.decode as decode_mod
    import sglang.srt.disaggregation.prefill as prefill_mod
    import sglang.srt.managers.disagg_service as service_mod

    for mod in (prefill_mod, decode_mod, service_mod):
        assert mod.get_kv_class(b, KVClassType.SENDER) is ks.KvwireKVSender, mod.__name__
    # And the other backends are untouched.
    from sglang.srt.disaggregation.fake import FakeKVSender

    assert get_kv_class(TransferBackend.FAKE, KVClassType.SENDER) is FakeKVSender


def test_docs_launch_commands_select_kvwire(ks):
    """SGLang's own argument parser accepts docs/sglang.md's prefill and decode commands (the
    ServerArgs every manager in these tests is built from), and the router command there points
    at the prefill's bootstrap port."""
    p = sc.server_args("prefill")
    assert (p.disaggregation_transfer_backend, p.disaggregation_mode) == ("kvwire", "prefill")
    port = p.disaggregation_bootstrap_port
    d = sc.server_args("decode")
    assert (d.disaggregation_transfer_backend, d.disaggregation_mode) == ("kvwire", "decode")
    router = [l for l in open(sc.DOCS) if l.startswith("python -m sglang_router.launch_router ")]
    assert len(router) == 1 and f"--prefill http://{sc.doc_command('prefill')[sc.doc_command('prefill').index('--host') + 1]}:" in router[0]
    assert f" {port} --decode " in router[0], router


def test_install_refuses_an_untested_sglang(ks, monkeypatch):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda n: "0.5.22" if n == "sglang" else real(n))
    with pytest.raises(ks.SGLangVersionError) as e:
        ks.install()
    assert "0.5.22" in str(e.value) and ks.TESTED_SGLANG in str(e.value)
    assert isinstance(e.value, kvwire.ConfigError)


PLUGIN_CHECK = r"""
import sys
from sglang.srt.plugins import load_plugins
load_plugins()  # what sglang.launch_server / `sglang serve` / each scheduler process run first
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
try:
    b = TransferBackend("kvwire")
except ValueError as e:
    print("NOT-REGISTERED", e)
    sys.exit(3)
print("REGISTERED", get_kv_class(b, KVClassType.MANAGER).__qualname__)
"""


def test_sglang_plugin_registers_kvwire_in_a_fresh_process(ks):
    """SGLang's plugin loader (entry point group sglang.srt.plugins, declared by kvwire's
    wheel) registers the backend in a process that never imported kvwire: how a launched
    server and its spawned scheduler processes get it. KVWIRE_SGLANG_PLUGIN=0 turns it off."""
    env = dict(os.environ, SGLANG_PLUGINS="")
    env.pop("SGLANG_PLUGINS")
    p = subprocess.run([sys.executable, "-c", PLUGIN_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "REGISTERED KvwireKVManager" in p.stdout, (p.stdout, p.stderr[-3000:])
    env["KVWIRE_SGLANG_PLUGIN"] = "0"
    p = subprocess.run([sys.executable, "-c", PLUGIN_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 3 and "NOT-REGISTERED" in p.stdout, (p.stdout, p.stderr[-3000:])


# -- the scheduler's calls across two processes ----------------------------------------------


def test_scheduler_sequence_moves_kv_state_and_aux(prefill, decode):
    """Chunked prefill (two sends, the final one with the state indices), a Mamba-like and an
    SWA-like state component, SGLang's MetadataBuffers as the aux record: every byte of every
    KV page and state slot, and the first token, cached tokens and bootstrap room the decode
    scheduler reads back (decode.py:2614-2630)."""
    for n, room in enumerate([2**62 + 17, 5, 2**63 - 2]):
        src = [4, 9, 13, 2, 60, 33][: 3 + n]
        dst = [40, 1, 22, 7, 59, 3][: 3 + n]
        state_src, state_dst = [[1 + n], [5, 6 + n]], [[8 - n], [30, 2 + n]]
        aux_index = 2 + n
        r = recv(decode, prefill, room, dst, aux_index, state_dst)
        assert r["state"] == 3 and r["prefill_dp_rank"] == 0, r  # Transferring once reserved
        prompt = len(src) * sc.PAGE_SIZE - 5  # a partial last page
        s = prefill.run(room, src, aux_index, state_src, chunks=[2, len(src) - 2], prompt_tokens=prompt)
        assert s.poll() == 4, s.error
        s.failure_exception()  # nothing to raise
        m = s.get_transfer_metric()
        want = len(src) * sc.KV_BUFFERS * sc.KV_PAGE_BYTES + 1 * (384 + 1024) + 2 * 512 * 4
        assert m.transfer_total_bytes == want and m.transfer_latency_s is not None, m
        s.clear()
        expect_verified(decode, room, dst, aux_index, state_dst)


def test_state_component_without_indices_is_not_transferred(prefill, decode):
    """SGLang passes None for a component a request has nothing of (prefill.py:1708-1710):
    neither side moves it, the KV and the other component are verified."""
    room = 991
    src, dst = [10, 11], [12, 13]
    r = recv(decode, prefill, room, dst, 1, [None, [3]])
    assert r["state"] == 3, r
    s = prefill.run(room, src, 1, [None, [9]])
    assert s.poll() == 4, s.error
    expect_verified(decode, room, dst, 1, [None, [3]])


def test_prefill_waits_for_the_decode_reservation(prefill, decode):
    """core_routing: the prefill's poll stays Bootstrapping while the decode is connected but
    has not reserved (SGLang starts prefill compute on WaitingForInput, prefill.py:529), and
    turns WaitingForInput once it has."""
    room = 4242
    r = recv(decode, prefill, room, [20, 21], 4, [[2], [16]], no_metadata=True)
    assert r["state"] == 2, r  # decode: connected, nothing reserved
    s = prefill.sender(room)
    time.sleep(0.3)
    assert s.poll() == 1, "prefill reports WaitingForInput before the decode reserved"
    decode.call(op="abort", room=room)


def test_restarted_prefill_is_reached_at_once(prefill, decode, ks):
    """A prefill rank that comes back (a new engine registering as the same rank while its
    predecessor's record is still there) is the one a decode's next request reaches, at
    once: each receiver resolves its prefill rank at init, newest registration first."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    p2 = Prefill.__new__(Prefill)
    p2.ks, p2.server_args, p2.backend, p2.addr = ks, prefill.server_args, prefill.backend, prefill.addr
    p2.eng = sc.Engine()
    p2.bootstrap = None
    p2.mgr = ks.KvwireKVManager(p2.eng.kv_args(ks), DisaggregationMode.PREFILL, p2.server_args, False)
    registered = time.monotonic()
    try:
        room, src, dst = 88_001, [1, 2, 3], [41, 42, 43]
        r = recv(decode, p2, room, dst, 7, [[2], [20]])
        took = time.monotonic() - registered  # resolved, connected and reserved
        assert r["state"] == 3 and took < 1.0, (r, took)
        s = p2.run(room, src, 7, [[3], [4]])
        assert s.poll() == 4, s.error
        expect_verified(decode, room, dst, 7, [[2], [20]])
    finally:
        p2.mgr.close()  # deregisters: the next tests reach the first prefill again


def test_release_and_resume_memory_occupation(ks, decode):
    """SGLang's release_memory_occupation (prefill.py:560-564) frees the KV memory after
    kv_manager.deregister_buffer_to_engine() returns: kvwire stops touching it first (a
    transfer still open fails on both sides, the decode's pages keep their bytes), and after
    resume_memory_occupation the same memory transfers again."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

    p = Prefill(ks)
    try:
        q = SimpleNamespace(queue=[], kv_manager=p.mgr)
        room, dst = 99_001, [44, 45]
        recv(decode, p, room, dst, 3, [[5], [21]])
        before = decode.call(op="snapshot")["digest"]
        s = p.sender(room)
        assert sc.wait(s, {0, 2})[0] == 2
        s.init(2, 3)
        start = time.monotonic()
        PrefillBootstrapQueue.release_memory_occupation(q)
        assert time.monotonic() - start < 10
        assert s.poll() == 0, "a transfer outlived the release of its memory"
        w = decode.call(op="wait", room=room, dst=dst, aux_index=3, wait_s=10)
        assert w["state"] == 0, w
        assert decode.call(op="snapshot")["digest"] == before

        PrefillBootstrapQueue.resume_memory_occupation(q)
        room = 99_002
        recv(decode, p, room, [46, 47], 3, [[6], [22]])
        s = p.run(room, [9, 10], 3, [[1], [2]])
        assert s.poll() == 4, s.error
        expect_verified(decode, room, [46, 47], 3, [[6], [22]])
    finally:
        p.close()


# -- the incident: an over-long prompt ------------------------------------------------------


def test_over_long_prompt_refused_at_admission_by_sglang_and_kvwire(prefill, decode):
    """The seed's incident through SGLang's path. (1) SGLang's own PrefillBootstrapQueue.add
    refuses a prompt over its pool before any sender exists (prefill.py:474-482); (2) the
    bug's placeholder -- a one-page transfer for a request the decode reserved whole pages
    for -- is refused by kvwire on both sides and writes nothing; (3) a request over the
    prefill's kvwire pool is rejected at kvwire's admission with PROMPT_EXCEEDS_POOL, the
    decode told the same code. The decode's destination pages keep their sentinel bytes."""
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    # (1) SGLang's admission, with kvwire's classes behind it.
    q = PrefillBootstrapQueue.__new__(PrefillBootstrapQueue)
    streamed = []

    class Streamer:
        def stream_output(self, reqs, *a):
            streamed.extend(reqs)

    class Scheduler:
        output_streamer = Streamer()

    q.scheduler, q.queue, q.max_input_len = Scheduler(), [], sc.PAGES * sc.PAGE_SIZE
    q.transfer_backend, q.kv_manager, q.bootstrap_port = prefill.backend, prefill.mgr, prefill.server_args.disaggregation_bootstrap_port
    long_req = sc.make_req(77, sc.PAGES * sc.PAGE_SIZE + 1, 0)
    q.add(long_req, num_kv_heads=2)
    assert q.queue == [] and getattr(long_req, "disagg_kv_sender", None) is None
    assert isinstance(long_req.finished_reason, FINISH_ABORT) and streamed == [long_req]
    ok_req = sc.make_req(78, 3 * sc.PAGE_SIZE, 0)
    q.add(ok_req, num_kv_heads=2)  # the same queue admits a request that fits, with kvwire's sender
    assert q.queue == [ok_req] and type(ok_req.disagg_kv_sender).__name__ == "KvwireKVSender"
    ok_req.disagg_kv_sender.abort()

    # (2) The placeholder: the decode reserved 4 pages, the prefill sends one.
    before = decode.call(op="snapshot")["digest"]
    room, dst = 31337, [24, 25, 26, 27]
    r = recv(decode, prefill, room, dst, 0, [[4], [9]])
    assert r["state"] == 3, r
    s = prefill.sender(room)
    assert sc.wait(s, {0, 2})[0] == 2
    s.init(1, 0)
    prefill.eng.fill_request(room, [50], [[1], [2]])
    s.send(np.array([50], np.int64), [np.array([1], np.int32), np.array([2], np.int32)], num_kv_tokens=1)
    assert sc.wait(s, {0, 4})[0] == 0, "a one-page placeholder passed for a four-page reservation"
    w = decode.call(op="wait", room=room, dst=dst, aux_index=0, state_dst=[[4], [9]])
    assert w["state"] == 0 and w["raised"] is not None, w
    assert decode.call(op="untouched", dst=dst, state_dst=[[4], [9]])["untouched"]
    assert decode.call(op="snapshot")["digest"] == before, "the decode's memory changed"

    # (3) Longer than the prefill's own kvwire pool (and so than its context, which defaults to
    # the pool where --context-length is not set): rejected at admission, the code travels.
    room, dst = 31338, list(range(0, sc.PAGES))
    r = recv(decode, prefill, room, dst, 0, None)
    s = prefill.sender(room)
    assert sc.wait(s, {0, 2})[0] == 2
    s.init(sc.PAGES + 1, 0)
    assert sc.wait(s, {0, 4})[0] == 0
    assert s.error.code_name == "PROMPT_EXCEEDS_CONTEXT" and not s.error.retryable, s.error
    with pytest.raises(kvwire.Rejected):
        s.failure_exception()
    w = decode.call(op="wait", room=room, dst=dst, aux_index=0, wait_s=5)
    assert w["state"] == 0 and w["error"]["code_name"] == "PROMPT_EXCEEDS_CONTEXT", w
    assert decode.call(op="snapshot")["digest"] == before, "the decode's memory changed"


# -- refusals ---------------------------------------------------------------------------------


def test_decode_refusal_reaches_the_prefill_at_once(prefill, ks):
    """core_routing: a decode whose pool cannot take the request refuses its reservation; the
    prefill's sender fails within 1 s, not retryable, with the decode's original code."""
    small = sc.DecodePeer("--pages", "8")
    try:
        room, dst = 8080, list(range(8)) + [0]
        s = prefill.sender(room)
        r = recv(small, prefill, room, dst, 0, [[1], [2]])
        # 9 pages into a pool of 8 (whose context is the pool's 128 tokens): refused there.
        code = r["error"]["code_name"]
        assert r["state"] == 0 and code in ("PROMPT_EXCEEDS_CONTEXT", "PROMPT_EXCEEDS_POOL"), r
        # The prefill scheduler's loop (prefill.py:507-545 pop_bootstrapped): poll; on
        # WaitingForInput, finalize_bootstrap calls init. From the decode's refusal on, the
        # sender must read Failed within a second.
        start, inited, state = time.monotonic(), False, None
        while time.monotonic() - start < 5.0:
            state = s.poll()
            if state == 0:
                break
            if state == 2 and not inited:
                s.init(len(dst), 0)
                inited = True
            time.sleep(0.002)
        took = time.monotonic() - start
        assert state == 0 and took < 1.0, (state, took, inited, s.error)
        assert s.error.code_name == code and not s.error.retryable, repr(s.error)
    finally:
        small.close()


def test_other_layout_refused_at_connect_naming_both(prefill, ks):
    """A decode with another attention TP size (and so another head slice) is refused at the
    connection's handshake; the error names both layouts."""
    other = sc.DecodePeer("--tp-size", "2", "--heads", "1,2", "--no-states")
    try:
        r = other.call(timeout=180, op="recv", room=606, bootstrap_addr=prefill.addr, dst=[1, 2], aux_index=0)
        if r.get("state") != 0:
            r = other.call(timeout=30, op="wait", room=606, dst=[1, 2], aux_index=0)
        assert r["state"] == 0, r
        msg = r["error"]["message"]
        assert r["error"]["kind"] in ("LayoutMismatch", "HandshakeRefused"), r
        assert "tp1 h2/2" in msg and "tp2 h1/2" in msg, msg
    finally:
        other.close()


def test_unsupported_layouts_refused_at_construction(ks, prefill, monkeypatch):
    """What kvwire would not move correctly is refused when SGLang builds the manager, with the
    feature named: a state whose indices are not whole items, a decode radix cache, a
    data-parallel prefill, KV buffers of different page counts."""
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.utils import DisaggregationMode

    eng = sc.Engine()
    a = eng.kv_args(ks)
    a.state_types = [StateType.DSA_TAIL, StateType.SWA]
    with pytest.raises(ks.UnsupportedLayout, match="dsa_tail"):
        ks.KvwireKVManager(a, DisaggregationMode.DECODE, sc.server_args("decode"), False)
    with pytest.raises(ks.UnsupportedLayout, match="decode radix cache"):
        ks.KvwireKVManager(eng.kv_args(ks), DisaggregationMode.DECODE,
                           sc.server_args("decode", 0, "--disaggregation-decode-enable-radix-cache"), False)
    with pytest.raises(ks.UnsupportedLayout, match="data-parallel prefill"):
        ks.KvwireKVManager(eng.kv_args(ks), DisaggregationMode.PREFILL,
                           sc.server_args("prefill", free_port(), "--dp-size", "2"), False)
    a = eng.kv_args(ks)
    a.kv_data_lens = list(a.kv_data_lens)
    a.kv_data_lens[1] //= 2
    with pytest.raises(ks.UnsupportedLayout, match="different item counts"):
        ks.KvwireKVManager(a, DisaggregationMode.DECODE, sc.server_args("decode"), False)
    # A server whose KV pools are in GPU memory (a CUDA device present, --device cuda): its
    # pointers are refused, never read as host memory.
    with monkeypatch.context() as m:
        m.setattr(ks, "_cuda_available", lambda: True)
        with pytest.raises(ks.UnsupportedLayout, match="KV in GPU memory"):
            ks.KvwireKVManager(eng.kv_args(ks), DisaggregationMode.DECODE,
                               sc.server_args("decode", 0, "--device", "cuda"), False)


def test_decode_prefix_and_host_destination_fail_the_request(prefill, decode):
    """A decode prefix (decode_prefix_len > 0) and a host destination are refused on the
    request (typed InvalidRequest, Failed), nothing reserved or written."""
    for room, kw in ((7001, {"decode_prefix_len": 16}), (7002, {"destination": "host"})):
        r = recv(decode, prefill, room, [30, 31], 0, None, **kw)
        assert r["state"] == 0 and r["error"]["kind"] == "InvalidRequest", r
        assert decode.call(op="untouched", dst=[30, 31])["untouched"]  # pages no test writes


def test_one_prefill_two_decodes_no_dest(prefill, decode, ks):
    """core_routing: one prefill, two decodes connected, requests of both interleaved; the
    prefill's senders name no destination (SGLang never passes one): each request reaches the
    decode that reserved it, every byte verified."""
    second = sc.DecodePeer()
    try:
        rooms = []
        for i in range(6):
            peer = (decode, second)[i % 2]
            room = 50_000 + i
            src, dst = [i, i + 20, i + 40], [63 - i, 45 - i, 30 + i]
            state_src, state_dst = [[i % 9], [i, i + 10]], [[(i + 3) % 9], [31 - i, 12 + i]]
            recv(peer, prefill, room, dst, i % sc.AUX_SLOTS, state_dst)
            rooms.append((peer, room, src, dst, state_src, state_dst))
        for peer, room, src, dst, state_src, state_dst in reversed(rooms):
            s = prefill.run(room, src, rooms.index((peer, room, src, dst, state_src, state_dst)) % sc.AUX_SLOTS, state_src)
            assert s.poll() == 4, (room, s.error)
        for i, (peer, room, src, dst, state_src, state_dst) in enumerate(rooms):
            expect_verified(peer, room, dst, i % sc.AUX_SLOTS, state_dst)
    finally:
        second.close()


def test_pool_smaller_than_the_context_length_refused_at_start(ks):
    """The incident's first bug: a server whose KV pool cannot hold one prompt of its
    advertised context length (--context-length) does not start."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    eng = sc.Engine(states=False)
    pool_tokens = sc.PAGES * sc.PAGE_SIZE
    with pytest.raises(kvwire.ConfigError) as e:
        ks.KvwireKVManager(eng.kv_args(ks), DisaggregationMode.DECODE,
                           sc.server_args("decode", 0, "--context-length", str(pool_tokens + 1)), False)
    assert str(pool_tokens + 1) in str(e.value), e.value
    m = ks.KvwireKVManager(eng.kv_args(ks), DisaggregationMode.DECODE,
                           sc.server_args("decode", 0, "--context-length", str(pool_tokens)), False)
    m.close()


def _gloo_world():
    """A one-process gloo group: what SGLang's poll_and_all_reduce* reduce over (a world of
    one leaves the polls as they are, utils.py:287-297)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return dist.group.WORLD


def test_sglang_prefill_queue_and_send_kv_chunk_drive_kvwire(ks):
    """SGLang's own queue code over kvwire. Prefill: PrefillBootstrapQueue.add creates the
    sender (prefill.py:401-413), pop_bootstrapped polls it and finalize_bootstrap calls init
    (prefill.py:507-560, 430-443), and the scheduler's send_kv_chunk turns the request's token
    slots into page indices and sends them in two chunks (prefill.py:1501-1787). Decode:
    DecodeTransferQueue.pop_transferred polls the receiver and commits the first token
    (decode.py:2832-2980). Only the GPU pools are stand-ins (a req_to_token row, a page size).
    Every byte is compared."""
    from types import SimpleNamespace

    import torch
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue, SchedulerDisaggregationPrefillMixin
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator

    group = _gloo_world()
    p = Prefill(ks, states=False)
    d = sc.DecodePeer("--no-states")
    try:
        failures = []
        alloc = SimpleNamespace(page_size=sc.PAGE_SIZE, translate_kv_indices_for_transfer=lambda x: x)
        q = PrefillBootstrapQueue.__new__(PrefillBootstrapQueue)
        q.scheduler = SimpleNamespace(
            attn_cp_cpu_group=group, attn_tp_cpu_group=group, processed_tokens_counter=0,
            token_to_kv_pool_allocator=alloc, handle_bootstrap_failure=failures.append,
            output_streamer=SimpleNamespace(stream_output=lambda *a: None),
        )
        q.queue, q.pp_size, q.scheduler_stage_metrics = [], 1, None
        q.max_input_len = sc.PAGES * sc.PAGE_SIZE
        q.transfer_backend, q.kv_manager = p.backend, p.mgr
        q.bootstrap_port = p.server_args.disaggregation_bootstrap_port
        q.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(sc.AUX_SLOTS)

        room, src, dst, tokens, first = 777_001, [17, 3, 44, 8], [9, 50, 2, 61], 4 * sc.PAGE_SIZE - 7, 123
        req = sc.make_req(room, tokens, first, "127.0.0.1", q.bootstrap_port)
        q.add(req, num_kv_heads=2)
        assert q.queue == [req] and isinstance(req.disagg_kv_sender, ks.KvwireKVSender)
        aux_index = None
        r = recv(d, p, room, dst, 5, None)  # the decode reserves (its metadata slot 5)
        assert r["state"] == 3, r
        # The scheduler calls pop_bootstrapped every iteration; while the sender is Bootstrapping
        # that path is optimistic prefill (runtime config this test does not publish), so the
        # call below is the first iteration after the decode's reservation reached the prefill.
        assert sc.wait(req.disagg_kv_sender, {0, 2})[0] == 2
        deadline = time.monotonic() + 10
        popped = []
        while not popped and time.monotonic() < deadline:
            popped = q.pop_bootstrapped()
            time.sleep(0.01)
        assert popped == [req] and failures == [], (popped, failures)
        aux_index = req.metadata_buffer_index
        assert aux_index >= 0 and req.start_send_idx == 0

        # The scheduler's state that _send_kv_chunk reads; the token->KV-slot row of the request.
        row = torch.tensor([pg * sc.PAGE_SIZE + j for pg in src for j in range(sc.PAGE_SIZE)], dtype=torch.int64)
        req.kv.req_pool_idx = 0
        sched = SimpleNamespace(
            token_to_kv_pool_allocator=alloc, enable_staging=False, kv_checksum_computer=None,
            disagg_metadata_buffers=p.eng.meta, disagg_prefill_bootstrap_queue=q,
            req_to_token_pool=SimpleNamespace(req_to_token=row.unsqueeze(0)),
            disagg_prefill_pending_chunk_rids=set(),
        )
        sched._send_kv_chunk = lambda *a, **k: SchedulerDisaggregationPrefillMixin._send_kv_chunk(sched, *a, **k)
        p.eng.fill_request(room, src, [])
        # A chunked prefill's first extend ends mid-page (prefill.py:1125 sends it), the last one
        # at the prompt's end (prefill.py:1073: send_kv_chunk(req, last_chunk=True)).
        req.extend_end = 2 * sc.PAGE_SIZE + 5
        SchedulerDisaggregationPrefillMixin.send_kv_chunk(sched, req, last_chunk=False, end_idx=req.extend_end)
        assert req.start_send_idx == 2 * sc.PAGE_SIZE  # the partial page waits for the next chunk
        req.extend_end = tokens
        SchedulerDisaggregationPrefillMixin.send_kv_chunk(sched, req, last_chunk=True)
        s = req.disagg_kv_sender
        assert sc.wait(s, {0, 4})[0] == 4, s.error
        # The decode's DecodeTransferQueue.pop_transferred commits it: the first token and the
        # cached-token count arrive in the request through SGLang's own metadata path.
        w = d.call(timeout=180, op="pop_transferred", room=room, dst=dst, aux_index=5)
        assert w["committed"] == [f"rid-{room}"] and w["bad"] == [], w
        assert w["output_ids"] == [first] and w["cached_tokens"] == 3 and w["slot_freed"], w
    finally:
        d.close()
        p.close()


def test_prefill_registers_when_the_bootstrap_server_comes_up_later(ks):
    """SGLang's prefill server starts its bootstrap server (tokenizer manager) while its
    scheduler processes build their managers (engine.py:1221-1345): a manager built first
    keeps registering until the server is up, and a decode then finds it."""
    import threading

    from sglang.srt.disaggregation.utils import DisaggregationMode

    port = free_port()
    sa = sc.server_args("prefill", port)
    servers = []
    t = threading.Timer(1.5, lambda: servers.append(ks.KvwireKVBootstrapServer(host="127.0.0.1", port=port)))
    t.start()
    eng = sc.Engine(states=False)
    start = time.monotonic()
    m = ks.KvwireKVManager(eng.kv_args(ks), DisaggregationMode.PREFILL, sa, False)
    try:
        took = time.monotonic() - start
        assert servers and took >= 1.0, took
        dm = ks.KvwireKVManager(sc.Engine(states=False).kv_args(ks), DisaggregationMode.DECODE, sc.server_args("decode"), False)
        assert dm.try_ensure_parallel_info(f"127.0.0.1:{port}")
        assert dm.prefill_info_table[f"127.0.0.1:{port}"].dp_size == 1
        dm.close()
    finally:
        t.join()
        m.close()
        for s in servers:
            s.close()
