"""Shared by the vLLM tests and their engine processes (vllm_peer.py): one vLLM engine's
scheduler side and worker side, built from vLLM 0.33.0's own code on the CPU.

* the VllmConfig of a tiny local model (a config.json, nothing downloaded), with the
  KVTransferConfig docs/vllm.md gives (``kv_connector_module_path="kvwire.vllm"``);
* the KV cache config and cache tensors from vLLM's own planner (``get_kv_cache_configs``,
  ``resolve_kv_cache_layout``) and allocator (``allocate_kv_cache``), on the CPU;
* the worker connector from vLLM's ``ensure_kv_transfer_initialized`` (vLLM's
  ``KVConnectorFactory`` imports kvwire.vllm by module path), the scheduler connector from
  vLLM's own ``Scheduler``;
* each step: ``Scheduler.schedule()``, the model runner's connector lifecycle
  (``KVConnectorModelRunnerMixin._get_kv_connector_output``: bind metadata, start_load_kv,
  wait_for_save, get_transfer_results, get_block_ids_with_load_errors), a fake forward that
  writes each scheduled token's KV, and ``Scheduler.update_from_output``.

The KV of a token is a function of its id and position only (:func:`token_kv`), so every
block can be compared with what it must hold, and a recomputed block equals a loaded one.

Without vllm the tests skip with the reason, or fail where KVWIRE_REQUIRE_VLLM=1
(scripts/vllm-tests.sh sets it)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, List, Optional

from ports import free_port  # noqa: F401  (the tests call vc.free_port)

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCK_SIZE = 16
LAYERS = 2
KV_HEADS = 2
HEAD_SIZE = 32
NUM_BLOCKS = 64
MAX_MODEL_LEN = 256
SENTINEL = -7.0            # what a decode's blocks hold before anything landed
MODEL_DIR = os.path.join(os.environ.get("TMPDIR", "/tmp"), "kvwire-vllm-tiny-model")
DOCS = os.path.join(HERE, "..", "..", "docs", "vllm.md")


def require_vllm():
    """Imports kvwire.vllm with the pinned vLLM: skips (printed reason) without it, or fails
    the test where KVWIRE_REQUIRE_VLLM=1."""
    import pytest

    from kvwire import vllm as kv

    if kv.HAVE_VLLM and kv.vllm_version() == kv.TESTED_VLLM:
        return kv
    why = (
        f"vllm=={kv.TESTED_VLLM} is not importable here (installed: {kv.vllm_version()}; "
        f"{kv._IMPORT_ERROR!r}); scripts/vllm-tests.sh installs it"
    )
    if os.environ.get("KVWIRE_REQUIRE_VLLM") == "1":
        pytest.fail(f"KVWIRE_REQUIRE_VLLM=1 but {why}")
    pytest.skip(why)


def tiny_model() -> str:
    """A tiny Llama config written locally (nothing is downloaded, no weights)."""
    os.makedirs(MODEL_DIR, exist_ok=True)
    path = os.path.join(MODEL_DIR, "config.json")
    if not os.path.exists(path):
        cfg = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
            "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": KV_HEADS,
            "num_hidden_layers": LAYERS, "vocab_size": 256, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
            "head_dim": HEAD_SIZE,
        }
        with open(path + ".tmp", "w") as f:
            json.dump(cfg, f)
        os.replace(path + ".tmp", path)
    return MODEL_DIR


def doc_transfer_config(role: str) -> Dict[str, Any]:
    """The --kv-transfer-config docs/vllm.md gives for `role` (kv_producer / kv_consumer)."""
    with open(DOCS) as f:
        for line in f:
            if "--kv-transfer-config" in line and f'"kv_role":"{role}"' in line.replace(" ", ""):
                raw = line.split("--kv-transfer-config", 1)[1].strip()
                raw = raw.split("'")[1]
                return json.loads(raw)
    raise AssertionError(f"docs/vllm.md has no --kv-transfer-config for {role}")


def vllm_config(role: str, kv_port: int, *, max_model_len: int = MAX_MODEL_LEN, policy: str = "recompute",
                extra: Optional[Dict[str, Any]] = None, layout: str = "LBHNC", engine_id: Optional[str] = None):
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
                             VllmConfig)

    kvc = doc_transfer_config(role)
    assert kvc["kv_connector"] == "KvwireConnector" and kvc["kv_connector_module_path"] == "kvwire.vllm", kvc
    kvc.update(kv_port=kv_port, kv_load_failure_policy=policy)
    if engine_id:
        kvc["engine_id"] = engine_id
    kvc["kv_connector_extra_config"] = dict(kvc.get("kv_connector_extra_config") or {}, host="127.0.0.1",
                                            **(extra or {}))
    mc = ModelConfig(model=tiny_model(), skip_tokenizer_init=True, max_model_len=max_model_len,
                     dtype="float32", enforce_eager=True)
    cc = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False)
    cc.kv_cache_layout = layout
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=max_model_len,
                         is_encoder_decoder=False)
    return VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc,
                      kv_transfer_config=KVTransferConfig(**kvc), device_config=DeviceConfig("cpu"))


def token_kv(token: int, pos: int, layer: int, heads: int, content: int):
    """The KV one token leaves in one layer: [heads, content] floats, from (token, pos, layer)."""
    import torch

    base = float((token * 131 + pos * 7 + layer * 1009) % 65521)
    return base + torch.arange(heads * content, dtype=torch.float32).reshape(heads, content) / 256.0


class Engine:
    """One vLLM engine (scheduler + one worker) in this process."""

    def __init__(self, role: str, kv_port: int, *, kv: str = "packed", layout: str = "LBHNC",
                 max_model_len: int = MAX_MODEL_LEN, policy: str = "recompute",
                 extra: Optional[Dict[str, Any]] = None, fill: float = 0.0, num_blocks: int = NUM_BLOCKS) -> None:
        import torch
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_initialized
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
        from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        self.role = role
        self.vc = vllm_config(role, kv_port, max_model_len=max_model_len, policy=policy, extra=extra, layout=layout)
        specs = {
            f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
                block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
            for i in range(LAYERS)
        }
        self.layer_names = list(specs)
        lay = resolve_kv_cache_layout(self.vc, [[layout]], list(specs.values()))
        groups = get_global_kv_cache_groups(self.vc, [specs])
        page = BLOCK_SIZE * KV_HEADS * HEAD_SIZE * 2 * 4
        (self.kv_cache_config,) = get_kv_cache_configs(self.vc, [specs], [num_blocks * page * LAYERS], groups)
        self.kv_cache_config.kv_cache_layout = self.vc.cache_config.kv_cache_layout
        sched_cfg = generate_scheduler_kv_cache_config([self.kv_cache_config])
        self.vc.cache_config.num_gpu_blocks = sched_cfg.num_blocks  # as EngineCore sets it
        self.num_blocks = self.kv_cache_config.num_blocks
        if kv == "packed":  # vLLM 0.33's own caches: [B, H, N, 2*D] per layer, K and V packed
            self.kv_caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), lay)
        else:  # the split shape of vLLM < 0.26 and of backends that keep K and V apart
            self.kv_caches = {n: torch.zeros(2, self.num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
                              for n in self.layer_names}
        for t in self.kv_caches.values():
            t.fill_(fill)
        self.kv = kv
        # A worker's distributed state, as vLLM's CPU worker sets it up (one rank, gloo).
        from vllm.config import set_current_vllm_config
        from vllm.distributed.parallel_state import (ensure_model_parallel_initialized,
                                                     init_distributed_environment)

        with set_current_vllm_config(self.vc):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
            ensure_model_parallel_initialized(1, 1)
            ensure_kv_transfer_initialized(self.vc, self.kv_cache_config)
        self.connector = get_kv_transfer_group()
        self.connector.register_kv_caches(self.kv_caches)
        self.sched = Scheduler(self.vc, sched_cfg, StructuredOutputManager(self.vc), block_size=BLOCK_SIZE)
        # EngineCore._set_kv_connector_handshake_metadata: each worker's handshake metadata,
        # keyed (pp_rank, tp_rank) as gpu_worker.get_kv_connector_handshake_metadata keys it.
        meta = self.connector.get_handshake_metadata()
        if meta is not None:
            self.sched.get_kv_connector().set_xfer_handshake_metadata_pp_aware({(0, 0): meta})
        self.tokens: Dict[str, List[int]] = {}
        self.computed: Dict[str, int] = {}     # tokens this engine computed itself, per request
        self.prompt_len: Dict[str, int] = {}

    # -- requests --------------------------------------------------------------------------
    def add(self, req_id: str, prompt: List[int], max_tokens: int, params: Optional[Dict[str, Any]] = None) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                            extra_args={"kv_transfer_params": params} if params is not None else None)
        self.tokens[req_id] = list(prompt)
        self.prompt_len[req_id] = len(prompt)
        self.computed[req_id] = 0
        self.sched.add_request(Request(req_id, list(prompt), sp, None))

    def validate(self, prompt: List[int], max_tokens: int) -> Optional[str]:
        """vLLM's own input validation of a prompt (what the API server runs before the engine
        sees a request): None if accepted, else vLLM's message."""
        from vllm.v1.engine.input_processor import InputProcessor

        ip = InputProcessor(self.vc)
        try:
            ip._validate_prompt_len(len(prompt), "decoder")
        except Exception as e:  # VLLMValidationError
            return f"{type(e).__name__}: {e}"
        return None

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.sched.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    # -- one step ----------------------------------------------------------------------------
    def _forward(self, so: Any) -> Dict[str, int]:
        """Writes the KV of every scheduled token into its block slot; returns sampled tokens."""
        sampled = {}
        for rid, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            start = req.num_computed_tokens - n
            (blocks,) = self.sched.kv_cache_manager.get_block_ids(rid)
            toks = self.tokens[rid]
            for pos in range(start, start + n):
                self._write(blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE, toks[pos], pos)
            self.computed[rid] += n
            if start + n >= len(toks):
                sampled[rid] = 10 + (sum(toks) + len(toks)) % 200
        return sampled

    def _write(self, block: int, slot: int, token: int, pos: int) -> None:
        for li, name in enumerate(self.layer_names):
            t = self.kv_caches[name]
            if self.kv == "packed":  # [B, H, N, C]
                t[block, :, slot, :] = token_kv(token, pos, li, KV_HEADS, 2 * HEAD_SIZE)
            else:  # [2, B, N, H, D]
                v = token_kv(token, pos, li, KV_HEADS, 2 * HEAD_SIZE)
                t[0, block, slot] = v[:, :HEAD_SIZE]
                t[1, block, slot] = v[:, HEAD_SIZE:]

    def bad_blocks(self, req_id: str, upto: Optional[int] = None) -> List[int]:
        """Indices (in the request's block list) of blocks whose KV for tokens [0, upto) is
        not what those tokens leave; upto defaults to the prompt."""
        (blocks,) = self.sched.kv_cache_manager.get_block_ids(req_id)
        toks = self.tokens[req_id]
        upto = self.prompt_len[req_id] if upto is None else upto
        bad = set()
        for pos in range(upto):
            i = pos // BLOCK_SIZE
            for li, name in enumerate(self.layer_names):
                t = self.kv_caches[name]
                want = token_kv(toks[pos], pos, li, KV_HEADS, 2 * HEAD_SIZE)
                got = t[blocks[i], :, pos % BLOCK_SIZE, :]
                if not bool((got == want).all()):
                    bad.add(i)
        return sorted(bad)

    def blocks_of(self, req_id: str) -> List[int]:
        (blocks,) = self.sched.kv_cache_manager.get_block_ids(req_id)
        return list(blocks)

    def step(self) -> Dict[str, Any]:
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        so = self.sched.schedule()
        with set_forward_context(None, self.vc), \
                KVConnectorModelRunnerMixin._get_kv_connector_output(so) as kvout:
            sampled = self._forward(so)
        req_ids = list(so.num_scheduled_tokens)
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[sampled[r]] if r in sampled else [] for r in req_ids],
            kv_connector_output=kvout,
        )
        ev: Dict[str, Any] = {
            "scheduled": {r: int(n) for r, n in so.num_scheduled_tokens.items()},
            "finished_sending": sorted(kvout.finished_sending or ()),
            "finished_recving": sorted(kvout.finished_recving or ()),
            "failed_recving": sorted(kvout.failed_recving or ()),
            "invalid_block_ids": sorted(kvout.invalid_block_ids or ()),
            "outputs": [],
            "loaded": {},
        }
        ev["failed_blocks"] = {
            rid: self.blocks_of(rid)[: -(-self.prompt_len[rid] // BLOCK_SIZE)]
            for rid in ev["failed_recving"] if rid in self.sched.requests
        }
        # A load reported now has not been touched by any forward yet: compare its blocks.
        for rid in ev["finished_recving"]:
            if rid not in ev["failed_recving"] and rid in self.sched.requests:
                ev["loaded"][rid] = {"bad": self.bad_blocks(rid), "blocks": self.blocks_of(rid)}
        outs = self.sched.update_from_output(so, mro)
        for eco in outs.values():
            for o in eco.outputs:
                for t in o.new_token_ids:
                    self.tokens[o.request_id].append(int(t))
                ev["outputs"].append({
                    "req_id": o.request_id,
                    "new_token_ids": [int(t) for t in o.new_token_ids],
                    "finish_reason": str(o.finish_reason) if o.finish_reason is not None else None,
                    "kv_transfer_params": o.kv_transfer_params,
                })
        return ev

    def state(self, req_id: Optional[str] = None) -> Dict[str, Any]:
        w = self.connector.worker
        out: Dict[str, Any] = {
            "free_blocks": int(self.sched.kv_cache_manager.block_pool.get_num_free_blocks()),
            "requests": sorted(self.sched.requests),
            "senders": sorted(w._senders),
            "recvs": sorted(w._recvs),
            "recv_errors": {r: {"kind": type(e).__name__, "code_name": e.code_name, "message": str(e)}
                            for r, e in w.recv_errors.items()},
            "held_pages": sorted(self.connector.kvwire_manager.held_pages()),
            "has_requests": bool(self.sched.has_requests()),
        }
        if req_id is not None and req_id in self.sched.requests:
            r = self.sched.requests[req_id]
            out["status"] = str(r.status)
            out["num_computed_tokens"] = int(r.num_computed_tokens)
            out["computed_here"] = self.computed.get(req_id)
        return out

    def untouched(self, blocks: List[int], fill: float = SENTINEL) -> bool:
        for t in self.kv_caches.values():
            sel = t[blocks] if self.kv == "packed" else t[:, blocks]
            if not bool((sel == fill).all()):
                return False
        return True


def peer_argv(*args: str) -> List[str]:
    return [sys.executable, os.path.join(HERE, "vllm_peer.py"), *args]


class Peer:
    """A vLLM engine in its own process (vllm_peer.py), driven by JSON lines."""

    def __init__(self, *args: str, env: Optional[Dict[str, str]] = None) -> None:
        import subprocess

        e = dict(os.environ)
        e.update(env or {})
        self.proc = subprocess.Popen(peer_argv(*args), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=None, env=e, text=True, bufsize=1)
        self._hello: Optional[Dict[str, Any]] = None

    @property
    def hello(self) -> Dict[str, Any]:
        if self._hello is None:
            self._hello = self._read(180.0)
        return self._hello

    def _read(self, timeout: float) -> Dict[str, Any]:
        import select

        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            import signal
            import time

            if self.proc.poll() is None:  # its threads' stacks, to stderr
                self.proc.send_signal(signal.SIGUSR1)
                time.sleep(1.0)
            raise TimeoutError("vLLM peer process did not answer in time")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM peer process ended (exit {self.proc.wait()})")
        return json.loads(line)

    def call(self, timeout: float = 180.0, **cmd: Any) -> Dict[str, Any]:
        """Sends one command; waits `timeout` s beyond the command's own `timeout` for the answer
        (a loaded 2-core CI host has taken over 60 s to answer)."""
        self.hello
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        res = self._read(timeout + float(cmd.get("timeout", 0)))
        if "error" in res:
            raise RuntimeError(f"peer: {res['error']}\n{res.get('trace', '')}")
        return res

    def kill(self) -> None:
        import signal

        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        import subprocess

        if self.proc.poll() is None:
            try:
                self.call(timeout=10.0, op="exit")
            except Exception:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
