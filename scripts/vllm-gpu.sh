#!/usr/bin/env bash
# kvwire as vLLM's KV connector on a GPU: a prefill `vllm serve` (kv_producer) and a decode
# `vllm serve` (kv_consumer) with kvwire.vllm.KvwireConnector on one GPU, a small P/D proxy in
# front (the request to the prefill with do_remote_decode and max_tokens=1, then to the decode with
# the kv_transfer_params the prefill answered), and a plain (non-disaggregated) server with the
# same model; the same prompts go through the proxy and to the plain server, greedy, and their
# output tokens must be equal. Then a prompt longer than --max-model-len goes through the proxy: it
# must be refused, and both servers stay healthy.
#
# STATUS: PREPARED, NOT RUN. It has never been run on a GPU (the development machines have none,
# and no GPU machine was available to this work). Expected today: both disaggregated servers
# refuse to start with kvwire.vllm.UnsupportedLayout ("KV cache in cuda:0 memory; kvwire's Python
# binding registers host memory only"): the Rust core handles device buffers (MemoryKind, feature
# cuda) but kvwire's Python KVArgs cannot say a pointer is device memory yet, and the connector
# will not hand a device pointer to host code. The script reports that and exits 1. Its server
# flags are checked on the CPU by `KVWIRE_GPU_DRY_RUN=1 bash scripts/vllm-gpu.sh`, which parses each
# command with vLLM's own `vllm serve` argument parser and resolves the connector class through
# vLLM's KVConnectorFactory, and launches nothing.
#
# Needs: one CUDA GPU; a virtual environment with vllm==0.33.0 (python/requirements-vllm.txt) and
# kvwire's wheel (scripts/vllm-tests.sh builds both). Nothing is downloaded: the model is a tiny
# Llama config written locally with random weights (`--load-format dummy`, `--seed 0`, so every
# server builds the same weights) and no tokenizer (`--skip-tokenizer-init`: prompts are token ids).
#
#   bash scripts/vllm-gpu.sh                       # venv target/vllm-venv
#   KVWIRE_VLLM_VENV=/path/to/venv bash scripts/vllm-gpu.sh
#   KVWIRE_GPU_DRY_RUN=1 bash scripts/vllm-gpu.sh  # parse the commands only (CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)

VENV=${KVWIRE_VLLM_VENV:-target/vllm-venv}
PY="$VENV/bin/python"
WORK=$(mktemp -d /tmp/kvwire-vllm-gpu.XXXXXX)
LOGS="$WORK/logs"
mkdir -p "$WORK/model" "$LOGS"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done
  sleep 2
  for p in "${pids[@]}"; do kill -KILL -- "-$p" 2>/dev/null || true; done
}
trap cleanup EXIT

"$PY" - "$WORK/model" <<'PY'
import json, sys
cfg = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 4, "vocab_size": 512, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False,
}
json.dump(cfg, open(f"{sys.argv[1]}/config.json", "w"))
json.dump({"bos_token_id": 1, "eos_token_id": 2}, open(f"{sys.argv[1]}/generation_config.json", "w"))
PY

MAXLEN=1024
KVPORT=31579
COMMON=("$WORK/model" --load-format dummy --seed 0 --skip-tokenizer-init --dtype float16
        --block-size 16 --max-model-len "$MAXLEN" --enforce-eager --gpu-memory-utilization 0.2
        --host 127.0.0.1)
# The launch commands of docs/vllm.md, on one host and one GPU.
PREFILL=("${COMMON[@]}" --port 31100 --kv-transfer-config
  "{\"kv_connector\":\"KvwireConnector\",\"kv_connector_module_path\":\"kvwire.vllm\",\"kv_role\":\"kv_producer\",\"kv_port\":$KVPORT,\"kv_connector_extra_config\":{\"host\":\"127.0.0.1\"}}")
DECODE=("${COMMON[@]}" --port 31200 --no-enable-prefix-caching --kv-transfer-config
  "{\"kv_connector\":\"KvwireConnector\",\"kv_connector_module_path\":\"kvwire.vllm\",\"kv_role\":\"kv_consumer\",\"kv_load_failure_policy\":\"recompute\",\"kv_connector_extra_config\":{\"host\":\"127.0.0.1\"}}")
PLAIN=("${COMMON[@]}" --port 31300)

if [ -n "${KVWIRE_GPU_DRY_RUN:-}" ]; then
  "$PY" - <<'PY' "${PREFILL[@]}" --- "${DECODE[@]}" --- "${PLAIN[@]}"
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.common.cli_args import make_arg_parser  # what `vllm serve` parses with
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.platforms import current_platform
if not current_platform.device_type:  # a machine without a GPU: the dry run only parses
    type(current_platform).device_type = "cpu"
argv, cmds = sys.argv[1:], [[]]
for a in argv:
    cmds.append([]) if a == "---" else cmds[-1].append(a)
for name, cmd in zip(("prefill", "decode", "plain"), cmds):
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd)
    kvc = args.kv_transfer_config
    cls = None
    if kvc is not None:
        kvc = kvc if isinstance(kvc, KVTransferConfig) else KVTransferConfig(**(json.loads(kvc) if isinstance(kvc, str) else kvc))
        cls = KVConnectorFactory.get_connector_class(kvc)
    print(f"{name}: port={args.port} load_format={args.load_format} block_size={args.block_size} "
          f"role={getattr(kvc, 'kv_role', None)} connector={cls.__module__ + '.' + cls.__name__ if cls else None}")
PY
  echo "vllm-gpu: dry run: the commands parse and vLLM resolves the connector (nothing launched)"
  exit 0
fi

command -v nvidia-smi >/dev/null && nvidia-smi -L || { echo "vllm-gpu: no GPU (nvidia-smi)" >&2; exit 1; }
"$PY" -c 'import kvwire.vllm as k; k.check_version(); print("kvwire.vllm for vllm", k.TESTED_VLLM)'

export KVWIRE_PSK
KVWIRE_PSK=$("$PY" -c 'import kvwire; print(kvwire.gen_psk().hex())')

launch() {  # name, then the command; each in its own process group, logs in $LOGS
  local name=$1; shift
  setsid "$@" >"$LOGS/$name.log" 2>&1 &
  pids+=($!)
  echo "started $name (pid $!): $*"
}
launch prefill "$VENV/bin/vllm" serve "${PREFILL[@]}"
launch decode "$VENV/bin/vllm" serve "${DECODE[@]}"
launch plain "$VENV/bin/vllm" serve "${PLAIN[@]}"

wait_ready() {  # url, seconds
  local deadline=$(( $(date +%s) + $2 ))
  until curl -sf "$1" >/dev/null; do
    if grep -l "UnsupportedLayout" "$LOGS"/prefill.log "$LOGS"/decode.log >/dev/null 2>&1; then
      echo "vllm-gpu: a server refused to start (kvwire.vllm.UnsupportedLayout):" >&2
      grep -h "UnsupportedLayout" "$LOGS"/prefill.log "$LOGS"/decode.log | tail -n 2 >&2
      exit 1
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
      echo "vllm-gpu: $1 not ready after $2 s; logs:" >&2
      tail -n 40 "$LOGS"/*.log >&2
      exit 1
    fi
    sleep 2
  done
}
wait_ready http://127.0.0.1:31100/health 600
wait_ready http://127.0.0.1:31200/health 600
wait_ready http://127.0.0.1:31300/health 600

# The proxy: the two legs of vLLM's P/D proxy examples, in-process (no extra server).
set +e
"$PY" - "$MAXLEN" "$WORK/model" <<'PY'
import json, random, sys, urllib.error, urllib.request

maxlen = int(sys.argv[1])
model = sys.argv[2]  # the served model name: the path given to vllm serve

def post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")

def body(ids, n, extra=None):
    b = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True,
         "return_token_ids": True}
    b.update(extra or {})
    return b

def disaggregated(ids, n=16):
    s, r = post(31100, body(ids, 1, {"kv_transfer_params": {"do_remote_decode": True}}))
    if s != 200:
        return s, r
    return post(31200, body(ids, n, {"kv_transfer_params": r.get("kv_transfer_params")}))

def tokens(r):
    c = r["choices"][0]
    return c.get("token_ids") or c.get("text")

rng = random.Random(7)
lengths = [1, 15, 16, 17, 31, 33, 100, 257, 500, maxlen - 32]
bad = 0
for n in lengths:
    ids = [rng.randrange(3, 512) for _ in range(n)]
    s1, pd = disaggregated(ids)
    s2, plain = post(31300, body(ids, 16))
    if s1 != 200 or s2 != 200:
        print(f"prompt {n}: HTTP {s1} / {s2}: {pd!r:.300} / {plain!r:.300}")
        bad += 1
        continue
    a, b = tokens(pd), tokens(plain)
    ok = a == b
    bad += not ok
    print(f"prompt {n:5d} tokens: {'same' if ok else 'DIFFERENT'} output {a!r:.60}{'' if ok else ' vs ' + repr(b)[:60]}")
s, r = disaggregated([5] * (maxlen + 64))
print(f"prompt {maxlen + 64} tokens (over max_model_len): HTTP {s}")
if s == 200:
    print("  an over-long prompt was decoded")
    bad += 1
sys.exit(1 if bad else 0)
PY
rc=$?
set -e
for u in 31100 31200; do
  curl -sf "http://127.0.0.1:$u/health" >/dev/null || { echo "vllm-gpu: server on $u unhealthy after the run" >&2; rc=1; }
done
grep -h -i "kvwire" "$LOGS"/prefill.log "$LOGS"/decode.log | tail -n 20 || true
echo "vllm-gpu: exit $rc after $(( $(date +%s) - start )) s (logs in $LOGS)"
exit $rc
