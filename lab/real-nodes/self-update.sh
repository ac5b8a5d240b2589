#!/usr/bin/env bash
# kproxy updating itself: a DaemonSet rolling update to a new image (kproxy:0.1.0 →
# TAG, the same binary under a new tag, imported into every node) while load.py, in node
# kpn-n1, sends traffic through the probe Service's cluster IP and through the NodePort of
# every node. Prints load.py's counts: failed new connections and broken established ones.
#
#   self-update.sh [TAG]      (after nodes.sh up && nodes.sh proxy kproxy)
#   IMPORT=TAR self-update.sh TAG   TAG is another build's image, imported from TAR into
#                                   every node (upgrade.sh: across versions)
#   COMMAND='["kproxy","run",…]' self-update.sh TAG   the container's command changes in the
#                                   same rollout (upgrade.sh NEW_ARGS: tables that differ)
set -euo pipefail
: "${K8S_LAB:?set K8S_LAB}"
HERE=$(cd "$(dirname "$0")" && pwd)
STATE=$K8S_LAB/nodes
export KUBECONFIG=$K8S_LAB/kubeconfig
log() { echo "[self-update $(date -u +%H:%M:%S)] $*" >&2; }
[ "$(cat "$STATE/proxy" 2>/dev/null)" = kproxy ] || { log "the nodes do not run kproxy: nodes.sh proxy kproxy"; exit 1; }
current=$(kubectl -n kube-system get ds kproxy -o jsonpath='{.spec.template.spec.containers[0].image}')
tag=${1:-}
if [ -z "$tag" ]; then [ "$current" = kproxy:0.1.1 ] && tag=kproxy:0.1.0 || tag=kproxy:0.1.1; fi
for d in "$STATE"/n[1-9]*/; do
  if [ -n "${IMPORT:-}" ]; then
    ctr -a "$d/containerd.sock" -n k8s.io images import "$IMPORT" >/dev/null
  else
    ctr -a "$d/containerd.sock" -n k8s.io images tag --force docker.io/library/kproxy:0.1.0 "docker.io/library/$tag" >/dev/null
  fi
done
cip=$(kubectl get svc kpn-probe -o jsonpath='{.spec.clusterIP}')
np=$(kubectl get svc kpn-probe -o jsonpath='{.spec.ports[0].nodePort}')
targets=(--target "$cip:80")
for ip in $(kubectl get nodes -o jsonpath='{.items[*].status.addresses[?(@.type=="InternalIP")].address}'); do
  targets+=(--target "$ip:$np")
done
stop=$STATE/load.stop
rm -f "$stop"
# The load ends with this script, also when the rollout fails or times out.
trap 'touch "$stop"' EXIT
ip netns exec kpn-n1 python3 "$HERE/load.py" "${targets[@]}" --stop-file "$stop" >"$STATE/load.json" &
load=$!
sleep 3
t0=$(date +%s.%N)
log "kubectl set image ds/kproxy kproxy=$tag (from $current) under load"
if [ -n "${COMMAND:-}" ]; then
  log "and its command $COMMAND"
  kubectl -n kube-system patch ds kproxy --type=json -p "[{\"op\":\"replace\",\"path\":\"/spec/template/spec/containers/0/image\",\"value\":\"$tag\"},{\"op\":\"replace\",\"path\":\"/spec/template/spec/containers/0/command\",\"value\":$COMMAND}]" >/dev/null
else
  kubectl -n kube-system set image ds/kproxy "kproxy=$tag" >/dev/null
fi
kubectl -n kube-system rollout status ds/kproxy --timeout=300s >/dev/null
log "rolled out in $(echo "$(date +%s.%N) - $t0" | bc) s"
sleep 3
touch "$stop"
wait "$load"
cat "$STATE/load.json"
