#!/usr/bin/env bash
# The real-node checks, opt-in like the other real-control-plane tests: with a running
# k8s-lab (K8S_LAB, API_PORT from its env.sh; start.sh start + kcm), root and the node
# tools, it brings the nodes up if they are not (and down again at the end), then checks
#   1. kproxy from deploy/ (kubectl apply) makes the probe Service work through its cluster
#      IP and every node's NodePort, from every node (deploy.sh fails otherwise);
#   2. the DaemonSet's rolling update to a new image under load breaks no established
#      connection and fails at most 1 new connection in 2,000 (the background rate
#      docs/real-nodes.md measured without any update);
#   3. `kproxy lab rollout`'s default scenario on the real kubelets (rollout.py, one run):
#      no new connection fails (keep-alive requests to a pod that exits at SIGTERM may);
#   4. upstream's e2e spec "LoadBalancers ExternalTrafficPolicy: Local should work for
#      type=LoadBalancer" passes with kproxy through the cloud nodes.sh starts (an ingress
#      IP, the load balancer in kpn-lb, the client's address preserved);
#   5. upstream kube-proxy (nftables) on the same nodes makes the same Service work.
# Without them it prints "SKIP: <what is missing>" and exits 0; a failed check exits 1.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
skip() { echo "SKIP: $*"; exit 0; }
[ -n "${K8S_LAB:-}" ] && [ -n "${API_PORT:-}" ] || skip "K8S_LAB/API_PORT unset (source a k8s-lab env.sh; ../shared/tools/k8s-lab/README.md)"
[ "$(id -u)" = 0 ] || skip "needs root"
for t in kubectl containerd ctr runc socat nft curl bc nsenter /usr/lib/cni/bridge; do
  command -v "$t" >/dev/null || skip "missing $t (see docs/real-nodes.md for the Debian packages)"
done
[ -d "$K8S_LAB/src/deps/github.com/openshift/kubernetes/cmd/kubelet" ] || skip "no Kubernetes tree in $K8S_LAB/src (k8s-lab setup.sh)"
kubectl --kubeconfig "$K8S_LAB/kubeconfig" get --raw /readyz >/dev/null 2>&1 || skip "no API server at $K8S_LAB/kubeconfig (start.sh start; start.sh kcm)"

started=
if [ ! -d "$K8S_LAB/nodes" ]; then
  "$HERE/nodes.sh" up
  started=1
  trap '"$HERE/nodes.sh" down' EXIT
fi
fail() { echo "FAIL: $*"; exit 1; }
echo "== 1. kproxy from deploy/"
"$HERE/nodes.sh" proxy kproxy || fail "kproxy from deploy/ did not make Services work on every node"
echo "== 2. DaemonSet self-update under load"
out=$("$HERE/self-update.sh" | tail -1)
echo "$out"
python3 - "$out" <<'PY' || fail "self-update broke traffic"
import json, sys
t = json.loads(sys.argv[1])["targets"]
new = sum(v["new_ok"] + v["new_failed"] for v in t.values())
failed = sum(v["new_failed"] for v in t.values())
broken = sum(v["est_broken"] for v in t.values())
est = sum(v["est_requests"] for v in t.values())
print(f"new connections {new}, failed {failed}; established requests {est}, broken {broken}")
assert new > 0 and est > 0, "no traffic went through"
assert broken == 0, f"{broken} established connections broken"
assert failed * 2000 <= new, f"{failed} of {new} new connections failed"
PY
echo "== 3. the rollout scenario on real kubelets"
"$HERE/rollout.py" --json "$K8S_LAB/nodes/rollout.json" || fail "rollout.py failed"
python3 - "$K8S_LAB/nodes/rollout.json" <<'PY' || fail "the rollout lost new connections"
import json, sys
r = json.load(open(sys.argv[1]))["runs"][0]
new_failed = sum(1 for f in r["failed_records"] if f["conn"] == "new")
print(f"rollout: {r['sent']} requests, {r['failed']} failed, {new_failed} of {r['new']} new connections")
assert r["new"] > 0 and r["keep_alive"] > 0, "no traffic went through"
assert new_failed == 0, f"{new_failed} new connections failed"
PY
echo "== 4. a LoadBalancer spec through the cloud"
kill -0 "$(cat "$K8S_LAB/nodes/n0/cloud.pid" 2>/dev/null)" 2>/dev/null ||
  fail "no cloud running (nodes.sh up with CLOUD=0?)"
"$HERE/e2e.sh" kproxy 'LoadBalancers ExternalTrafficPolicy: Local .*should work for type=LoadBalancer' \
  '\[Disruptive\]' test-lb
grep -q '^Ran 1 of ' "$K8S_LAB/e2e/test-lb/e2e.log" && grep -q '^SUCCESS! -- 1 Passed' "$K8S_LAB/e2e/test-lb/e2e.log" ||
  fail "the ESIPP LoadBalancer spec did not pass (see $K8S_LAB/e2e/test-lb/e2e.log)"
echo "== 5. upstream kube-proxy on the same nodes"
"$HERE/nodes.sh" proxy kube-proxy
"$HERE/deploy.sh" --check-only || fail "the probe Service does not work with kube-proxy"
"$HERE/nodes.sh" proxy none
echo "PASS${started:+ (nodes started and stopped by this test)}"
