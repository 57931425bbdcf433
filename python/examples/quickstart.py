"""The README's prefill/decode example, runnable in one process (both engines, an embedded
bootstrap server), with the landed bytes and aux record checked. Run by python/tests."""

import numpy as np, kvwire, threading
from kvwire import KVManager, KVSender, KVReceiver, KVPoll
psk = kvwire.gen_psk()
server = kvwire.BootstrapServer("127.0.0.1:0")
kv = [np.zeros((64, 4096), np.uint8) for _ in range(8)]
aux = [np.zeros((256, 8), np.uint8)]
kv_d = [np.zeros((64, 4096), np.uint8) for _ in range(8)]
aux_d = [np.zeros((256, 8), np.uint8)]
room, slot = 99, 3
src_pages = np.array([5, 6, 7, 8, 9, 10]); dst_pages = np.array([60, 2, 30, 4, 50, 1])
for b in kv: b[src_pages] = 7
aux[0][slot] = 42
prefill = KVManager.from_arrays("prefill", kv, aux, page_size=16, psk=psk,
                                listen="127.0.0.1:0", bootstrap=server.address, cluster="llama")
prefill.register(rank=0)
decode = KVManager.from_arrays("decode", kv_d, aux_d, page_size=16, psk=psk,
                               bootstrap=server.address, cluster="llama")
rx = KVReceiver(decode, None, bootstrap_room=room, prefill_rank=0)
rx.send_metadata(dst_pages, aux_index=slot)
tx = KVSender(prefill, None, bootstrap_room=room)
while tx.poll() == KVPoll.Bootstrapping: pass
tx.init(num_kv_indices=len(src_pages), aux_index=slot)
for chunk in np.array_split(src_pages, 3):
    tx.send(chunk)
while (s := rx.poll()) not in (KVPoll.Success, KVPoll.Failed): pass
rx.failure_exception()
assert all((b[dst_pages] == 7).all() for b in kv_d) and (aux_d[0][slot] == 42).all()
print("README example OK", s)
