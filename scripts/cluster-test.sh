#!/usr/bin/env bash
# The chaos cluster's short seeded run (scripts/cluster/run.py): 3 prefill and 3 decode kvwire
# engines in their own processes through the Python package, a real etcd, a router, a workload
# whose bytes are known, the nemesis (kill -9 and restart, SIGSTOP/SIGCONT, a proxy flipping
# bytes or cutting connections, etcd stopped; as root, each node in a network namespace of its
# own: link down/up, one-way packet loss, CPU capped at 5 %), and the checker; exits non-zero
# on any violation. Writes target/cluster/seed<N>.json and .svg (the timeline). Needs the
# package built (scripts/python-tests.sh), etcd (etcd-server) and, as root, iptables;
# KVWIRE_REQUIRE_NETNS=1 (CI as root) fails where the namespaces cannot be made.
#
#   bash scripts/cluster-test.sh                  # seed 1, 45 s
#   CLUSTER_SEED=7 CLUSTER_SECONDS=900 bash scripts/cluster-test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVWIRE_PY_VENV:-target/python-venv}
if ! "$VENV/bin/python" -c 'import kvwire; assert kvwire._native.Engine.has_etcd()' 2>/dev/null; then
  KVWIRE_PY_FEATURES=etcd KVWIRE_PY_BUILD_ONLY=1 bash scripts/python-tests.sh
fi
if ! command -v etcd >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ]; then
    echo "cluster-test: etcd is not installed (apt-get install etcd-server)" >&2
    exit 1
  fi
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null
fi
if [ "$(id -u)" = 0 ] && ! command -v iptables-legacy >/dev/null 2>&1 && ! command -v iptables >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables >/dev/null
fi
seed=${CLUSTER_SEED:-1}
seconds=${CLUSTER_SECONDS:-45}
mkdir -p target/cluster
exec "$VENV/bin/python" scripts/cluster/run.py --seed "$seed" --seconds "$seconds" \
  --report "target/cluster/seed$seed.json"
