#!/usr/bin/env bash
# Runs upstream's e2e.test (built by build.sh from $K8S_LAB/src) against the real nodes
# with the Service proxy named by PROXY (switched with nodes.sh proxy), one junit report
# per run under $K8S_LAB/e2e/<label>/.
#
#   e2e.sh PROXY FOCUS [SKIP] [LABEL]     e.g. e2e.sh kproxy '\[sig-network\] Services'
#   PROCS=N e2e.sh …                      N specs at a time (the ginkgo CLI, as hack/ginkgo-e2e.sh)
#   KPROXY_ARGS="--flag …" e2e.sh kproxy …  flags appended to `kproxy run` (deploy.sh)
#
# e2e-table.py turns two such reports into docs/e2e.md's side-by-side table.
set -euo pipefail
: "${K8S_LAB:?set K8S_LAB}"
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${NODES_BIN:-$K8S_LAB/bin-nodes}
proxy=${1:?PROXY: kube-proxy | kproxy} focus=${2:?FOCUS regexp}
skip=${3:-'\[Disruptive\]|\[Serial\]|\[Feature:|\[Flaky\]|LoadBalancer|SCTP|IPv6|DualStack'}
label=${4:-$proxy}
out=$K8S_LAB/e2e/$label
ONLY="e2e.test ginkgo" "$HERE/build.sh"
"$HERE/nodes.sh" proxy "$proxy"
rm -rf "$out"; mkdir -p "$out"
printf '%s\n' "proxy=$proxy" "focus=$focus" "skip=$skip" "e2e.test=$("$BIN/e2e.test" --version 2>/dev/null || true)" \
  "procs=${PROCS:-1}" "kproxy_args=${KPROXY_ARGS:-}" "started=$(date -u +%FT%TZ)" >"$out/run.txt"
# --num-nodes: specs that skip below a node count read it ("Requires at least 2 nodes (not -1)").
nodes=$(kubectl --kubeconfig "$K8S_LAB/kubeconfig" get nodes -o name | grep -c '^node/kpn-n' || true)
args=(--kubeconfig="$K8S_LAB/kubeconfig" --provider=local --report-dir="$out" --num-nodes="$nodes"
      --allowed-not-ready-nodes=0 --minStartupPods=0 --dump-logs-on-failure=false)
set +e
if [ "${PROCS:-1}" -gt 1 ]; then
  "$BIN/ginkgo" --procs="$PROCS" --focus="$focus" --skip="$skip" --timeout=6h --no-color -v \
    "$BIN/e2e.test" -- "${args[@]}" >"$out/e2e.log" 2>&1
else
  "$BIN/e2e.test" "${args[@]}" --ginkgo.focus="$focus" --ginkgo.skip="$skip" \
    --ginkgo.timeout=6h --ginkgo.no-color --ginkgo.v >"$out/e2e.log" 2>&1
fi
rc=$?
set -e
echo "finished=$(date -u +%FT%TZ) exit=$rc" >>"$out/run.txt"
grep -E '^(Ran|PASS|FAIL)' "$out/e2e.log" | tail -3 || true
echo "e2e.sh: $out (exit $rc)"
