"""kvwire.vllm.KvwireConnector under vLLM 0.33.0's own code (scripts/vllm-tests.sh installs it).

Each engine is its own process (vllm_peer.py): vLLM's real Scheduler, KV cache planner and
allocator (CPU tensors), vLLM's KVConnectorFactory loading kvwire.vllm by module path from the
--kv-transfer-config in docs/vllm.md, the model runner's connector lifecycle each step, vLLM's
engine-core loop condition (Scheduler.has_requests), and a fake forward writing each token's KV
(a function of token and position, so every block can be compared). The prefill (kv_producer)
and the decode (kv_consumer) talk over kvwire (TCP, pre-shared key) with no other channel than
the kv_transfer_params the test passes along, as vLLM's P/D proxy does."""

from __future__ import annotations

import inspect
import os
import socket
import threading
import time
from typing import Any, Dict, List, Optional

import pytest

import kvwire
import vllm_common as vc

PSK = kvwire.gen_psk()
os.environ["KVWIRE_PSK"] = PSK.hex()  # every engine process reads it, as a server does


@pytest.fixture(scope="module")
def kv():
    return vc.require_vllm()


def blocks_for(n: int) -> int:
    return -(-n // vc.BLOCK_SIZE)


def prompt(n: int, seed: int) -> List[int]:
    return [3 + (seed * 37 + i * 11) % 250 for i in range(n)]


def start(role: str, kv_port: int, *args: str, extra: Optional[Dict[str, Any]] = None) -> vc.Peer:
    import json

    a = ["--role", role, "--kv-port", str(kv_port), *args]
    if extra:
        a += ["--extra", json.dumps(extra)]
    if role == "kv_consumer":
        a += ["--fill", str(vc.SENTINEL)]
    return vc.Peer(*a)


def pair(p_args=(), d_args=(), p_extra=None, d_extra=None):
    port = vc.free_port()
    P = start("kv_producer", port, *p_args, extra=p_extra)
    D = start("kv_consumer", port, *d_args, extra=d_extra)
    for peer in (P, D):
        assert peer.hello["ready"], peer.hello
    return P, D


def handoff(P: vc.Peer, rid: str, toks: List[int]) -> Dict[str, Any]:
    """The proxy's first leg: the request on the prefill with do_remote_decode and max_tokens=1;
    returns the kv_transfer_params vLLM answered with."""
    P.call(op="add", req_id=rid, prompt=toks, max_tokens=1, params={"do_remote_decode": True})
    r = P.call(op="wait", until=f"finished:{rid}", timeout=30)
    assert r["done"], r
    (o,) = [o for e in r["events"] for o in e["outputs"] if o["req_id"] == rid and o["finish_reason"]]
    params = o["kv_transfer_params"]
    assert params and params["do_remote_prefill"] and params["transfer"] == "kvwire", params
    return params


def kv_bytes(toks: List[int], first: int) -> List[bytes]:
    """The bytes tokens first..first+7 leave in layer 0, head 0 (K and V): what the prefill's
    stream carries for them, wherever the frames around them fall."""
    return [vc.token_kv(toks[p], p, 0, vc.KV_HEADS, 2 * vc.HEAD_SIZE)[0].numpy().tobytes()
            for p in range(first, first + 8)]


def scheduled(events, rid: str) -> List[int]:
    return [e["scheduled"][rid] for e in events if rid in e["scheduled"]]


# -- a proxy between the decode and the prefill's kvwire engine, to damage the stream ----------


class StreamProxy:
    """Listens on `port` and forwards to `target`; in the prefill -> decode direction it flips
    one byte in the middle of the first of the byte strings `flip` it sees (tokens' KV, so the
    damage is in page data, not in a frame header), closes both sides at `cut_at`, or stops
    forwarding at `stall_at`."""

    def __init__(self, port: int, target: str, flip=None, cut_at=None, stall_at=None) -> None:
        self.target = target
        self.flip, self.cut_at, self.stall_at = flip, cut_at, stall_at
        self.flipped = self.cut = self.stalled = False
        self.ls = socket.socket()
        self.ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.ls.bind(("127.0.0.1", port))
        self.ls.listen(8)
        self.socks: List[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.ls.accept()
            except OSError:
                return
            h, p = self.target.rsplit(":", 1)
            u = socket.create_connection((h, int(p)))
            self.socks += [c, u]
            threading.Thread(target=self._pump, args=(c, u, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c, True), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket, damage: bool) -> None:
        n = 0
        tail = b""
        try:
            while True:
                d = a.recv(65536)
                if not d:
                    break
                if damage and self.stall_at is not None and n + len(d) > self.stall_at:
                    self.stalled = True
                    b.sendall(d[: max(0, self.stall_at - n)])
                    while True:  # hold the rest: the transfer stays in flight
                        if not a.recv(65536):
                            return
                if damage and self.cut_at is not None and n + len(d) > self.cut_at:
                    b.sendall(d[: max(0, self.cut_at - n)])
                    self.cut = True
                    for s in self.socks:
                        try:
                            s.shutdown(socket.SHUT_RDWR)
                        except OSError:
                            pass
                    return
                if damage and self.flip is not None and not self.flipped:
                    # The previous read's tail too, so a pattern across two reads is seen; the
                    # byte flipped (a pattern's middle) must be in this read, not yet forwarded.
                    buf = tail + d
                    for pat in self.flip:
                        i = buf.find(pat)
                        at = i + len(pat) // 2 - len(tail)
                        if i >= 0 and at >= 0:
                            d = bytearray(d)
                            d[at] ^= 0x5A
                            d = bytes(d)
                            self.flipped = True
                            break
                    tail = buf[-1024:]
                n += len(d)
                b.sendall(d)
        except OSError:
            pass

    def close(self) -> None:
        self.ls.close()
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass


# -- loading by module path ------------------------------------------------------------------


def test_factory_loads_the_connector_from_its_module_path(kv):
    """vLLM's own KVConnectorFactory, given the --kv-transfer-config of docs/vllm.md, imports
    kvwire.vllm and returns KvwireConnector; it implements every abstract method of vLLM's
    KVConnectorBase_V1 with vLLM's parameter names, and VllmConfig accepts the config."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    for role in ("kv_producer", "kv_consumer"):
        cfg = KVTransferConfig(**vc.doc_transfer_config(role))
        cls = KVConnectorFactory.get_connector_class(cfg)
        assert cls is kv.KvwireConnector
    assert issubclass(kv.KvwireConnector, KVConnectorBase_V1)
    assert not inspect.isabstract(kv.KvwireConnector)
    for name in KVConnectorBase_V1.__abstractmethods__ | {"request_finished", "get_block_ids_with_load_errors",
                                                          "get_transfer_results", "register_kv_caches",
                                                          "update_connector_output", "has_pending_push_work"}:
        ours = getattr(kv.KvwireConnector, name)
        assert ours is not getattr(KVConnectorBase_V1, name), f"{name} is not implemented"
        want = [p for p in inspect.signature(getattr(KVConnectorBase_V1, name)).parameters if p not in ("kwargs",)]
        got = [p for p in inspect.signature(ours).parameters if p not in ("kwargs",)]
        assert got == want, (name, got, want)
    cfg = vc.vllm_config("kv_consumer", vc.free_port())  # VllmConfig resolves the class itself
    assert cfg.kv_transfer_config.kv_connector_module_path == "kvwire.vllm"


def test_other_vllm_versions_are_refused_naming_both(kv, monkeypatch):
    """On a vLLM other than 0.33.0 the connector refuses to start, naming both versions."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    cfg = vc.vllm_config("kv_consumer", vc.free_port())
    monkeypatch.setattr(kv, "vllm_version", lambda: "0.32.1")
    with pytest.raises(kv.VLLMVersionError) as e:
        kv.KvwireConnector(cfg, KVConnectorRole.SCHEDULER, None)
    assert "0.33.0" in str(e.value) and "0.32.1" in str(e.value)
    assert isinstance(e.value, kvwire.errors.ConfigError)


# -- transfers -------------------------------------------------------------------------------


def test_transfers_land_and_every_block_is_compared(kv):
    """Three requests (partial last blocks, one over several steps' worth of blocks) handed off
    by vLLM's prefill scheduler and loaded by the decode's: each load is reported only when
    every block holds the prompt's KV (compared before any forward touched it), the decode
    computes one prompt token itself (vLLM recomputes the last for its logits), and both
    engines end with every block free and nothing held by kvwire."""
    P, D = pair()
    try:
        free_p, free_d = P.hello["free_blocks"], D.hello["free_blocks"]
        for i, n in enumerate((17, 50, 130)):
            toks = prompt(n, i)
            params = handoff(P, f"p{i}", toks)
            assert params["remote_num_tokens"] == n and len(params["remote_block_ids"]) == blocks_for(n)
            D.call(op="add", req_id=f"d{i}", prompt=toks, max_tokens=4, params=params)
            r = D.call(op="wait", until=f"finished:d{i}", timeout=30)
            assert r["done"], r
            loaded = [e["loaded"][f"d{i}"] for e in r["events"] if f"d{i}" in e["loaded"]]
            assert len(loaded) == 1, r["events"]
            assert loaded[0]["bad"] == [], f"blocks that differ after load: {loaded[0]}"
            assert len(loaded[0]["blocks"]) >= blocks_for(n)
            assert not any(e["invalid_block_ids"] or e["failed_recving"] for e in r["events"])
            # The decode computed the last prompt token and three decode tokens, nothing else.
            assert scheduled(r["events"], f"d{i}") == [1, 1, 1, 1]
        r = P.call(op="wait", until="idle", timeout=15)
        assert r["done"]
        sp, sd = P.call(op="state"), D.call(op="state")
        assert sp["free_blocks"] == free_p and sp["held_pages"] == [] and sp["senders"] == []
        assert sd["free_blocks"] == free_d and sd["held_pages"] == [] and sd["recvs"] == []
    finally:
        P.close()
        D.close()


@pytest.mark.parametrize("damage", ["flip", "cut"])
def test_damaged_transfer_is_a_load_error_and_vllm_recomputes(kv, damage):
    """A byte flipped in the prefill's stream (the digest of the memory that landed differs) or
    the stream cut mid-transfer: the decode reports the request in failed_recving and its
    blocks through get_block_ids_with_load_errors, and vLLM (kv_load_failure_policy=recompute)
    recomputes the whole prompt instead of decoding from the blocks; the recomputed blocks hold
    the right KV and the prefill frees its blocks."""
    kv_port, listen, adv = vc.free_port(), vc.free_port(), vc.free_port()
    P = start("kv_producer", kv_port, extra={"listen": f"127.0.0.1:{listen}", "advertise": f"127.0.0.1:{adv}"})
    D = start("kv_consumer", kv_port)
    n = 130
    toks = prompt(n, 7)
    proxy = StreamProxy(adv, f"127.0.0.1:{listen}", flip=kv_bytes(toks, 70) if damage == "flip" else None,
                        cut_at=40_000 if damage == "cut" else None)
    try:
        assert P.hello["ready"] and D.hello["ready"], (P.hello, D.hello)
        params = handoff(P, "p", toks)
        D.call(op="add", req_id="d", prompt=toks, max_tokens=3, params=params)
        r = D.call(op="wait", until="finished:d", timeout=30)
        assert r["done"], r
        assert proxy.flipped if damage == "flip" else proxy.cut
        ev = r["events"]
        failed = [e for e in ev if "d" in e["failed_recving"]]
        assert len(failed) == 1, ev
        # Exactly the blocks reserved for the prompt are reported as load errors.
        assert failed[0]["invalid_block_ids"] == sorted(failed[0]["failed_blocks"]["d"]), failed[0]
        assert len(failed[0]["failed_blocks"]["d"]) == blocks_for(n)
        assert "d" not in failed[0]["loaded"]
        errs = D.call(op="state")["recv_errors"]
        if damage == "flip":
            assert errs["d"]["kind"] == "DigestMismatch", errs
        else:
            assert errs["d"]["kind"] in ("PeerLost", "PeerUnresponsive", "ConnectFailed", "WriteFailed",
                                         "ProtocolViolation", "Timeout"), errs
        # vLLM recomputed: the whole prompt scheduled on the decode, then the decode tokens.
        assert scheduled(ev, "d") == [n, 1, 1], scheduled(ev, "d")
        assert [o["finish_reason"] for e in ev for o in e["outputs"] if o["req_id"] == "d"][-1] == "length"
        r = P.call(op="wait", until="idle", timeout=15)
        assert r["done"] and P.call(op="state")["held_pages"] == []
        assert D.call(op="state")["held_pages"] == []
    finally:
        proxy.close()
        P.close()
        D.close()


def test_verification_failure_fails_the_request_under_fail_policy(kv):
    """kv_load_failure_policy=fail (vLLM's default): the same verification failure makes vLLM
    finish the request with an error; the decode never computes or decodes a token of it."""
    kv_port, listen, adv = vc.free_port(), vc.free_port(), vc.free_port()
    P = start("kv_producer", kv_port, extra={"listen": f"127.0.0.1:{listen}", "advertise": f"127.0.0.1:{adv}"})
    D = start("kv_consumer", kv_port, "--policy", "fail")
    toks = prompt(130, 9)
    proxy = StreamProxy(adv, f"127.0.0.1:{listen}", flip=kv_bytes(toks, 70))
    try:
        assert P.hello["ready"] and D.hello["ready"]
        params = handoff(P, "p", toks)
        D.call(op="add", req_id="d", prompt=toks, max_tokens=3, params=params)
        r = D.call(op="wait", until="finished:d", timeout=30)
        assert r["done"], r
        outs = [o for e in r["events"] for o in e["outputs"] if o["req_id"] == "d"]
        assert outs[-1]["finish_reason"] == "error" and all(not o["new_token_ids"] for o in outs), outs
        assert scheduled(r["events"], "d") == []
        assert D.call(op="state")["recv_errors"]["d"]["kind"] == "DigestMismatch"
        sd = D.call(op="state")
        assert sd["free_blocks"] == D.hello["free_blocks"] and sd["held_pages"] == []
    finally:
        proxy.close()
        P.close()
        D.close()


# -- aborts ------------------------------------------------------------------------------------


def test_decode_abort_mid_transfer_frees_blocks_on_both_sides(kv):
    """vLLM aborts a request on the decode while its load is in flight (the prefill's stream is
    held mid-transfer): kvwire aborts the transfer (fence, then release), vLLM frees the decode's
    blocks only once the worker reported it, no load error is reported for it, and the prefill
    learns at once (well before its reservation_wait_s) and frees its blocks."""
    kv_port, listen, adv = vc.free_port(), vc.free_port(), vc.free_port()
    P = start("kv_producer", kv_port, extra={"listen": f"127.0.0.1:{listen}", "advertise": f"127.0.0.1:{adv}",
                                             "reservation_wait_s": 60})
    D = start("kv_consumer", kv_port)
    proxy = StreamProxy(adv, f"127.0.0.1:{listen}", stall_at=30_000)
    try:
        assert P.hello["ready"] and D.hello["ready"]
        toks = prompt(130, 11)
        params = handoff(P, "p", toks)
        D.call(op="add", req_id="d", prompt=toks, max_tokens=3, params=params)
        deadline = time.monotonic() + 20
        while not proxy.stalled and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proxy.stalled
        st = D.call(op="state", req_id="d")
        assert st["status"] == "WAITING_FOR_REMOTE_KVS" and st["held_pages"], st
        t0 = time.monotonic()
        D.call(op="abort", req_id="d")
        r = D.call(op="wait", until="recv:d", timeout=15)
        assert r["done"], r
        assert not any(e["invalid_block_ids"] or e["failed_recving"] for e in r["events"])
        sd = D.call(op="state")
        assert sd["free_blocks"] == D.hello["free_blocks"] and sd["held_pages"] == [] and sd["requests"] == []
        r = P.call(op="wait", until="sent:p", timeout=15)
        assert r["done"] and time.monotonic() - t0 < 10, "the prefill did not learn of the abort at once"
        sp = P.call(op="state")
        assert sp["free_blocks"] == P.hello["free_blocks"] and sp["held_pages"] == []
    finally:
        proxy.close()
        P.close()
        D.close()


def test_decode_abort_before_allocation_releases_the_prefill(kv):
    """A request vLLM aborts on the decode before it allocated its blocks (the connector's
    request_finished sees it still marked do_remote_prefill): the prefill is told at once and
    frees its blocks; nothing was reserved or written on the decode."""
    P, D = pair(p_extra={"reservation_wait_s": 60})
    try:
        toks = prompt(50, 13)
        params = handoff(P, "p", toks)
        assert P.call(op="state")["free_blocks"] == P.hello["free_blocks"] - blocks_for(50)
        D.call(op="pause")
        D.call(op="add", req_id="d", prompt=toks, max_tokens=3, params=params)
        D.call(op="abort", req_id="d")
        D.call(op="resume")
        t0 = time.monotonic()
        r = P.call(op="wait", until="sent:p", timeout=20)
        assert r["done"] and time.monotonic() - t0 < 10, r
        assert P.call(op="state")["free_blocks"] == P.hello["free_blocks"]
        sd = D.call(op="state")
        assert sd["free_blocks"] == D.hello["free_blocks"] and sd["held_pages"] == [] and sd["recvs"] == []
    finally:
        P.close()
        D.close()


def test_prefill_abort_never_reaches_a_transfer(kv):
    """A request vLLM aborts on the prefill before it finished: request_finished hands nothing
    off (no kv_transfer_params), no kvwire sender exists, and its blocks are freed at once."""
    P = start("kv_producer", vc.free_port())
    try:
        assert P.hello["ready"]
        P.call(op="pause")
        P.call(op="add", req_id="p", prompt=prompt(50, 17), max_tokens=1, params={"do_remote_decode": True})
        P.call(op="abort", req_id="p")
        P.call(op="resume")
        r = P.call(op="wait", until="idle", timeout=10)
        assert r["done"]
        assert not any(o["kv_transfer_params"] for e in r["events"] for o in e["outputs"])
        sp = P.call(op="state")
        assert sp["senders"] == [] and sp["free_blocks"] == P.hello["free_blocks"] and sp["requests"] == []
    finally:
        P.close()


# -- the incident: an over-long prompt ---------------------------------------------------------


def test_over_long_prompt_never_reaches_a_transfer(kv):
    """The seed incident on vLLM's path: a prompt longer than the decode's max_model_len (the
    prefill, configured larger, accepted it). vLLM's own input validation on the decode rejects
    it; and where a request got past it anyway (the incident's rejection that did not stop the
    request), kvwire's admission refuses the reservation with PROMPT_EXCEEDS_CONTEXT: no byte is
    written into the decode's blocks (still the sentinel), vLLM fails the request (policy fail),
    and the prefill learns at once and frees its blocks."""
    P, D = pair(p_args=("--max-model-len", "512"), d_args=("--policy", "fail"),
                p_extra={"reservation_wait_s": 60})
    try:
        toks = prompt(300, 19)
        msg = D.call(op="validate", prompt=toks)["error_message"]
        assert msg and "longer than the maximum model length of 256" in msg, msg
        assert P.call(op="validate", prompt=toks)["error_message"] is None
        params = handoff(P, "p", toks)
        t0 = time.monotonic()
        D.call(op="add", req_id="d", prompt=toks, max_tokens=3, params=params)  # past validation
        r = D.call(op="wait", until="finished:d", timeout=20)
        assert r["done"], r
        failed = [e for e in r["events"] if "d" in e["failed_recving"]]
        assert failed and failed[0]["invalid_block_ids"], r["events"]
        blocks = failed[0]["failed_blocks"]["d"]
        assert D.call(op="untouched", blocks=blocks)["untouched"], "bytes landed in the decode's blocks"
        err = D.call(op="state")["recv_errors"]["d"]
        assert err["kind"] == "Rejected" and err["code_name"] == "PROMPT_EXCEEDS_CONTEXT", err
        outs = [o for e in r["events"] for o in e["outputs"] if o["req_id"] == "d"]
        assert outs[-1]["finish_reason"] == "error" and not any(o["new_token_ids"] for o in outs)
        r = P.call(op="wait", until="sent:p", timeout=20)
        assert r["done"] and time.monotonic() - t0 < 10, "the prefill did not learn of the refusal at once"
        assert P.call(op="state")["free_blocks"] == P.hello["free_blocks"]
    finally:
        P.close()
        D.close()


# -- layouts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("p_layout,d_layout", [
    (("packed", "LBHNC"), ("split", "LBHNC")),   # K/V packed (vLLM >= 0.26) vs separate K and V
    (("packed", "LBHNC"), ("packed", "LBNHC")),  # head-major vs token-major blocks: same bytes
])
def test_layout_mismatch_is_refused_at_connect_naming_both(kv, p_layout, d_layout):
    """A decode whose cache layout differs from the prefill's is refused when it connects, with
    kvwire's LayoutMismatch naming both layouts; nothing lands in its blocks and vLLM fails the
    request. The second case has the same bytes per block on both sides: only the fingerprint
    tells them apart."""
    P, D = pair(p_args=("--kv", p_layout[0], "--layout", p_layout[1]),
                d_args=("--kv", d_layout[0], "--layout", d_layout[1], "--policy", "fail"))
    try:
        fp_p, fp_d = P.hello["fingerprint"], D.hello["fingerprint"]
        assert fp_p != fp_d
        toks = prompt(50, 23)
        params = handoff(P, "p", toks)
        D.call(op="add", req_id="d", prompt=toks, max_tokens=3, params=params)
        r = D.call(op="wait", until="finished:d", timeout=20)
        assert r["done"], r
        err = D.call(op="state")["recv_errors"]["d"]
        assert err["kind"] == "LayoutMismatch", err
        for layout in (p_layout, d_layout):
            assert f"kv={layout[0]} {layout[1]}" in err["message"], (layout, err["message"])
        failed = [e for e in r["events"] if "d" in e["failed_recving"]]
        assert D.call(op="untouched", blocks=failed[0]["failed_blocks"]["d"])["untouched"]
        outs = [o for e in r["events"] for o in e["outputs"] if o["req_id"] == "d"]
        assert outs[-1]["finish_reason"] == "error"
    finally:
        P.close()
        D.close()


def test_prefill_that_dies_mid_transfer_is_a_load_error(kv):
    """The prefill process is killed while its stream is held mid-transfer (its connection to the
    decode stays open through the proxy, silent): kvwire's liveness check fails the load, the
    decode reports it as a load error and vLLM recomputes the prompt; the decode's blocks are
    all free afterwards and nothing stays held."""
    kv_port, listen, adv = vc.free_port(), vc.free_port(), vc.free_port()
    P = start("kv_producer", kv_port, extra={"listen": f"127.0.0.1:{listen}", "advertise": f"127.0.0.1:{adv}"})
    D = start("kv_consumer", kv_port)
    proxy = StreamProxy(adv, f"127.0.0.1:{listen}", stall_at=30_000)
    try:
        assert P.hello["ready"] and D.hello["ready"]
        n = 130
        toks = prompt(n, 29)
        params = handoff(P, "p", toks)
        D.call(op="add", req_id="d", prompt=toks, max_tokens=3, params=params)
        deadline = time.monotonic() + 20
        while not proxy.stalled and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proxy.stalled
        P.kill()
        r = D.call(op="wait", until="finished:d", timeout=30)
        assert r["done"], r
        failed = [e for e in r["events"] if "d" in e["failed_recving"]]
        assert len(failed) == 1 and failed[0]["invalid_block_ids"] == sorted(failed[0]["failed_blocks"]["d"])
        err = D.call(op="state")["recv_errors"]["d"]
        assert err["kind"] in ("PeerLost", "PeerUnresponsive", "Timeout"), err
        assert scheduled(r["events"], "d") == [n, 1, 1]
        sd = D.call(op="state")
        assert sd["free_blocks"] == D.hello["free_blocks"] and sd["held_pages"] == []
    finally:
        proxy.close()
        P.close()
        D.close()
