#!/usr/bin/env bash
# kvwire as SGLang's transfer backend on a GPU: a prefill server and a decode server with
# `--disaggregation-transfer-backend kvwire` on one GPU, SGLang's router in front, and a plain
# (non-disaggregated) server with the same model; the same requests go through the router and to
# the plain server, greedy, and their output tokens must be equal. Then a prompt longer than the
# context length goes through the router: it must be refused, and both servers stay healthy.
#
# STATUS: PREPARED, NOT RUN. It has never been run on a GPU (the development machines have
# none). Its server flags are checked on the CPU by `KVWIRE_GPU_DRY_RUN=1 bash
# scripts/sglang-gpu.sh`, which parses each command with SGLang's own prepare_server_args and
# launches nothing.
#
# Needs: one CUDA GPU; a virtual environment with sglang==0.5.23 (python/requirements-sglang.txt),
# sglang-router, and kvwire's wheel (scripts/sglang-tests.sh builds both venv and wheel; add
# `pip install sglang-router`). Nothing is downloaded by this script: the model is a tiny Llama
# config written locally, with random weights (`--load-format dummy`, seeded, so every server
# builds the same weights) and no tokenizer (`--skip-tokenizer-init`: requests carry token ids).
#
#   bash scripts/sglang-gpu.sh                       # venv target/sglang-venv
#   KVWIRE_SGLANG_VENV=/path/to/venv bash scripts/sglang-gpu.sh
#   KVWIRE_GPU_DRY_RUN=1 bash scripts/sglang-gpu.sh  # parse the commands only (CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)

VENV=${KVWIRE_SGLANG_VENV:-target/sglang-venv}
PY="$VENV/bin/python"
WORK=$(mktemp -d /tmp/kvwire-sglang-gpu.XXXXXX)
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
    "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False,
}
json.dump(cfg, open(f"{sys.argv[1]}/config.json", "w"))
json.dump({"bos_token_id": 1, "eos_token_id": 2}, open(f"{sys.argv[1]}/generation_config.json", "w"))
PY

CONTEXT=1024
COMMON=(--model-path "$WORK/model" --load-format dummy --skip-tokenizer-init --dtype float32
        --page-size 16 --context-length "$CONTEXT" --cuda-graph-backend-decode disabled
        --cuda-graph-backend-prefill disabled --mem-fraction-static 0.2
        --host 127.0.0.1 --base-gpu-id 0)
# The launch commands of docs/sglang.md, on one host and one GPU.
PREFILL=("${COMMON[@]}" --port 31000 --nccl-port 31100 --disaggregation-mode prefill
         --disaggregation-transfer-backend kvwire --disaggregation-bootstrap-port 31998)
DECODE=("${COMMON[@]}" --port 31001 --nccl-port 31101 --disaggregation-mode decode
        --disaggregation-transfer-backend kvwire)
PLAIN=("${COMMON[@]}" --port 31002 --nccl-port 31102)
ROUTER=(--pd-disaggregation --prefill http://127.0.0.1:31000 31998 --decode http://127.0.0.1:31001
        --host 127.0.0.1 --port 31003)

if [ -n "${KVWIRE_GPU_DRY_RUN:-}" ]; then
  "$PY" - "${PREFILL[*]}" "${DECODE[*]}" "${PLAIN[*]}" <<'PY'
import shlex, sys
import kvwire.sglang
kvwire.sglang.install()
from sglang.srt.server_args import prepare_server_args
for name, line in zip(("prefill", "decode", "plain"), sys.argv[1:]):
    a = prepare_server_args(shlex.split(line))
    print(f"{name}: mode={a.disaggregation_mode} backend={a.disaggregation_transfer_backend} "
          f"load_format={a.load_format} page_size={a.page_size} port={a.port}")
PY
  echo "sglang-gpu: dry run: the commands parse (nothing launched)"
  exit 0
fi

command -v nvidia-smi >/dev/null && nvidia-smi -L || { echo "sglang-gpu: no GPU (nvidia-smi)" >&2; exit 1; }
"$PY" -c 'import sglang_router' 2>/dev/null || { echo "sglang-gpu: sglang-router is not installed in $VENV" >&2; exit 1; }
"$PY" -c 'import kvwire.sglang as k; k.install(); print("kvwire.sglang for sglang", k.TESTED_SGLANG)'

export KVWIRE_PSK
KVWIRE_PSK=$("$PY" -c 'import kvwire; print(kvwire.gen_psk().hex())')

launch() {  # name, then the command; each in its own process group, logs in $LOGS
  local name=$1; shift
  setsid "$@" >"$LOGS/$name.log" 2>&1 &
  pids+=($!)
  echo "started $name (pid $!): $*"
}
launch prefill "$PY" -m sglang.launch_server "${PREFILL[@]}"
launch decode "$PY" -m sglang.launch_server "${DECODE[@]}"
launch plain "$PY" -m sglang.launch_server "${PLAIN[@]}"

wait_ready() {  # url, seconds
  local deadline=$(( $(date +%s) + $2 ))
  until curl -sf "$1" >/dev/null; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      echo "sglang-gpu: $1 not ready after $2 s; logs:" >&2
      tail -n 40 "$LOGS"/*.log >&2
      exit 1
    fi
    sleep 2
  done
}
wait_ready http://127.0.0.1:31000/health 600
wait_ready http://127.0.0.1:31001/health 600
wait_ready http://127.0.0.1:31002/health 600
launch router "$PY" -m sglang_router.launch_router "${ROUTER[@]}"
wait_ready http://127.0.0.1:31003/health 120

set +e
"$PY" - "$CONTEXT" <<'PY'
import json, random, sys, urllib.error, urllib.request

context = int(sys.argv[1])

def generate(port, ids, n=16):
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")

rng = random.Random(7)
# Prompt lengths around page boundaries (16 tokens), one page, many pages, near the context.
lengths = [1, 15, 16, 17, 31, 33, 100, 257, 500, context - 32]
bad = 0
for n in lengths:
    ids = [rng.randrange(3, 512) for _ in range(n)]
    s1, pd = generate(31003, ids)   # router: prefill -> kvwire -> decode
    s2, plain = generate(31002, ids)
    if s1 != 200 or s2 != 200:
        print(f"prompt {n}: HTTP {s1} / {s2}: {pd!r:.300} / {plain!r:.300}")
        bad += 1
        continue
    a, b = pd["output_ids"], plain["output_ids"]
    ok = a == b
    bad += not ok
    print(f"prompt {n:5d} tokens: {'same' if ok else 'DIFFERENT'} output {a[:8]}...{'' if ok else ' vs ' + str(b[:8])}")
# Over-long: refused, never decoded over another request's pages.
s, body = generate(31003, [5] * (context + 64))
print(f"prompt {context + 64} tokens (over the context): HTTP {s}")
if s == 200 and isinstance(body, dict) and body.get("output_ids"):
    print("  an over-long prompt was decoded")
    bad += 1
sys.exit(1 if bad else 0)
PY
rc=$?
set -e
for u in 31000 31001; do
  curl -sf "http://127.0.0.1:$u/health" >/dev/null || { echo "sglang-gpu: server on $u unhealthy after the run" >&2; rc=1; }
done
grep -h -i "kvwire\|transfer failed" "$LOGS"/prefill.log "$LOGS"/decode.log | tail -n 20 || true
echo "sglang-gpu: exit $rc after $(( $(date +%s) - start )) s (logs in $LOGS)"
exit $rc
