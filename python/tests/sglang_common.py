"""Shared by the SGLang tests and their peer process (sglang_peer.py): SGLang's real objects
(ServerArgs, KVArgs, MetadataBuffers, Req) built the way the pinned sglang 0.5.23's
scheduler builds them, over numpy KV and state buffers whose every byte the tests compare.

Without sglang the tests skip with the reason, or fail where KVWIRE_REQUIRE_SGLANG=1
(scripts/sglang-tests.sh sets it)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

import common

PAGE_SIZE = 16             # tokens per page (KVArgs.page_size)
KV_BUFFERS = 4             # two layers, K and V
KV_PAGE_BYTES = 2048       # bytes per page per KV buffer
PAGES = 64                 # pages per KV buffer
AUX_SLOTS = 8              # MetadataBuffers size (requests in flight)
# Two state components, as a hybrid model registers them (setup_state_kv_args):
# a Mamba-like one (one slot per request, two tensors of different item sizes) and an
# SWA-like paged one (its own page indices, fewer pages than the full pool).
STATES = [("mamba", [(9, 384), (9, 1024)]), ("swa", [(32, 512)] * 4)]
SENTINEL = common.SENTINEL
MODEL_DIR = os.path.join(os.environ.get("TMPDIR", "/tmp"), "kvwire-sglang-tiny-model")


def require_sglang():
    """Imports kvwire.sglang with the pinned SGLang: skips (printed reason) without it, or
    fails the test where KVWIRE_REQUIRE_SGLANG=1."""
    import pytest

    from kvwire import sglang as ks

    if ks.HAVE_SGLANG and ks.sglang_version() == ks.TESTED_SGLANG:
        return ks
    why = (
        f"sglang=={ks.TESTED_SGLANG} is not importable here "
        f"(installed: {ks.sglang_version()}; {ks._IMPORT_ERROR!r}); scripts/sglang-tests.sh installs it"
    )
    if os.environ.get("KVWIRE_REQUIRE_SGLANG") == "1":
        pytest.fail(f"KVWIRE_REQUIRE_SGLANG=1 but {why}")
    pytest.skip(why)


def tiny_model() -> str:
    """A tiny model config written locally (nothing is downloaded)."""
    os.makedirs(MODEL_DIR, exist_ok=True)
    path = os.path.join(MODEL_DIR, "config.json")
    if not os.path.exists(path):
        import json

        cfg = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
        }
        with open(path + ".tmp", "w") as f:
            json.dump(cfg, f)
        os.replace(path + ".tmp", path)
    return MODEL_DIR


DOCS = os.path.join(common.HERE, "..", "..", "docs", "sglang.md")


def doc_command(mode: str) -> List[str]:
    """The `python -m sglang.launch_server` command of docs/sglang.md for `mode`, as argv."""
    import shlex

    with open(DOCS) as f:
        for line in f:
            if line.startswith("python -m sglang.launch_server ") and f"--disaggregation-mode {mode} " in line:
                return shlex.split(line)[3:]
    raise AssertionError(f"docs/sglang.md has no launch command for a {mode} server")


def server_args(mode: str, bootstrap_port: int = 0, *extra: str):
    """SGLang's real ServerArgs, parsed by SGLang's own prepare_server_args from the launch
    command docs/sglang.md gives (after kvwire.sglang.install() `--disaggregation-transfer-backend
    kvwire` is an accepted choice), with the tiny local model, loopback, this test's bootstrap
    port and `--device cpu`."""
    from sglang.srt.server_args import prepare_server_args

    argv = doc_command(mode)
    subst = {"--model-path": tiny_model(), "--host": "127.0.0.1"}
    if bootstrap_port:
        subst["--disaggregation-bootstrap-port"] = str(bootstrap_port)
    for i, a in enumerate(argv[:-1]):
        if a in subst:
            argv[i + 1] = subst.pop(a)
    for k, v in subst.items():
        argv += [k, v]
    assert "--page-size" in argv and argv[argv.index("--page-size") + 1] == str(PAGE_SIZE), argv
    return prepare_server_args(argv + ["--device", "cpu"] + list(extra))


class Engine:
    """One engine's memory: KV pages, state components, SGLang's MetadataBuffers."""

    def __init__(self, pages: int = PAGES, fill: int = 0, states: bool = True) -> None:
        import torch
        from sglang.srt.disaggregation.utils import MetadataBuffers

        self.kv = [np.full((pages, KV_PAGE_BYTES), fill, np.uint8) for _ in range(KV_BUFFERS)]
        self.states = []
        if states:
            for _, tensors in STATES:
                self.states.append([np.full((n, item), fill, np.uint8) for n, item in tensors])
        # SGLang's own aux buffers, on the CPU as its scheduler allocates them.
        self.meta = MetadataBuffers(AUX_SLOTS, hidden_size=16, hidden_states_dtype=torch.float32,
                                    max_sampling_mask_tokens=16)

    def kv_args(self, ks, rank: int = 0, heads: Tuple[int, int] = (2, 2), layer_ids=None):
        """SGLang's real KVArgs (get_kv_class(KVWIRE, KVARGS)), filled field by field as
        prefill.py's _init_kv_manager (lines 258-346) and decode.py's (609-764) fill it."""
        from sglang.srt.disaggregation.base.conn import StateType
        from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

        a = get_kv_class(TransferBackend.KVWIRE, KVClassType.KVARGS)()
        a.engine_rank = rank
        a.pp_rank = 0
        a.system_dp_rank = 0
        a.kv_cache_dtype_str = "bfloat16"
        a.kv_layout = None
        a.prefill_start_layer = 0
        a.prefill_end_layer = 2
        a.kv_data_ptrs = [b.__array_interface__["data"][0] for b in self.kv]
        a.kv_data_lens = [b.nbytes for b in self.kv]
        a.kv_item_lens = [b[0].nbytes for b in self.kv]
        a.num_draft_entries = 0
        a.kv_layer_ids = layer_ids if layer_ids is not None else [0, 0, 1, 1]
        a.kv_head_num, a.total_kv_head_num = heads
        a.page_size = PAGE_SIZE
        a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = self.meta.get_buf_infos()
        a.ib_device = None
        a.gpu_id = 0
        a.state_types = [StateType(t) for t, _ in STATES[: len(self.states)]]
        a.state_data_ptrs = [[b.__array_interface__["data"][0] for b in comp] for comp in self.states]
        a.state_data_lens = [[b.nbytes for b in comp] for comp in self.states]
        a.state_item_lens = [[b[0].nbytes for b in comp] for comp in self.states]
        a.state_layer_ids = [[0] * len(comp) for comp in self.states]
        a.state_dim_per_tensor = [[] for _ in self.states]
        return a

    def keepalive(self):
        return (self.kv, self.states, self.meta)

    # -- the bytes of a request --------------------------------------------------------------
    def fill_request(self, room: int, pages: List[int], state_idx: List[Optional[List[int]]]) -> None:
        for ordinal, p in enumerate(pages):
            for b in range(len(self.kv)):
                self.kv[b][p] = common.pattern(room, ordinal, b, KV_PAGE_BYTES)
        for c, idx in enumerate(state_idx):
            for ordinal, s in enumerate(idx or []):
                for t, buf in enumerate(self.states[c]):
                    buf[s] = state_pattern(room, c, ordinal, t, buf.shape[1])

    def check_request(self, room: int, pages: List[int], state_idx: List[Optional[List[int]]]) -> List[str]:
        bad = []
        for ordinal, p in enumerate(pages):
            for b in range(len(self.kv)):
                if not np.array_equal(self.kv[b][p], common.pattern(room, ordinal, b, KV_PAGE_BYTES)):
                    bad.append(f"KV page {p} (ordinal {ordinal}) buffer {b}")
        for c, idx in enumerate(state_idx):
            for ordinal, s in enumerate(idx or []):
                for t, buf in enumerate(self.states[c]):
                    if not np.array_equal(buf[s], state_pattern(room, c, ordinal, t, buf.shape[1])):
                        bad.append(f"state {c} ({STATES[c][0]}) slot {s} (ordinal {ordinal}) tensor {t}")
        return bad

    def untouched(self, pages: List[int], state_idx=(), fill: int = SENTINEL) -> bool:
        ok = all((self.kv[b][p] == fill).all() for p in pages for b in range(len(self.kv)))
        for c, idx in enumerate(state_idx):
            ok = ok and all((buf[s] == fill).all() for s in idx or [] for buf in self.states[c])
        return ok


def state_pattern(room: int, comp: int, ordinal: int, tensor: int, nbytes: int) -> np.ndarray:
    return common.pattern(room ^ (0x5A5A << 8), 1000 * (comp + 1) + ordinal, tensor, nbytes)


def make_req(room: int, prompt_tokens: int, first_token: int, bootstrap_host: str = "127.0.0.1", bootstrap_port: int = 0):
    """SGLang's real Req, as the tokenizer hands it to a disaggregated scheduler."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(f"rid-{room}", "", list(range(prompt_tokens)), SamplingParams(max_new_tokens=8),
              bootstrap_host=bootstrap_host, bootstrap_port=bootstrap_port, bootstrap_room=room)
    req.output_ids = [first_token]
    req.cached_tokens = 3
    return req


def kv_to_page_num(tokens: int) -> int:
    from sglang.srt.mem_cache.common import kv_to_page_num as k  # what prefill.py:447 calls

    return k(tokens, PAGE_SIZE)


def wait(t, states, timeout: float = 20.0):
    start = time.monotonic()
    while True:
        s = int(t.poll())
        if s in states or time.monotonic() - start > timeout:
            return s, time.monotonic() - start
        time.sleep(0.002)


def describe(e) -> Optional[Dict[str, Any]]:
    return common.describe(e)


class DecodePeer(common.Peer):
    """An SGLang decode engine in its own OS process (sglang_peer.py)."""

    def __init__(self, *args: str, env: Optional[Dict[str, str]] = None) -> None:
        import subprocess

        e = dict(os.environ)
        e.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(common.HERE, "sglang_peer.py"), *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, env=e, text=True, bufsize=1,
        )
        self.hello = self._read(180.0)
