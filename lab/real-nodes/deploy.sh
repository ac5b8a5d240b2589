#!/usr/bin/env bash
# Deploys kproxy on the real nodes as a user would: `kubectl apply` of deploy/rbac.yaml,
# deploy/configmap.yaml and deploy/daemonset.yaml, with only the edits docs/deploy.md
# ("Before you apply") asks of every user: the API server address in kubeconfig.conf
# (here the node's 127.0.0.1:$API_PORT bridge, see nodes.sh) and clusterCIDR (the nodes'
# pod CIDR). The image kproxy:0.1.0 is the one images.sh imported into every node.
# Prints the time from `kubectl apply` to every node's Services working (kproxy Ready on
# every node and a probe Service answering through its cluster IP and NodePort from every
# node), the figure docs/real-nodes.md reports.
#
#   deploy.sh               apply deploy/, time it
#   deploy.sh --check-only  only check that the probe Service works on every node (with
#                           whichever proxy runs)
#   KPROXY_PRIVILEGED=1     the kproxy container privileged too, as kube-proxy runs (deploy/
#                           sets the conntrack sysctls with a privileged init container instead)
#   KPROXY_ARGS="--flag …"  appended to `kproxy run` (e.g. --proxy-terminating-endpoints=false,
#                           kube-proxy's behaviour before 1.26)
set -euo pipefail
check_only=
[ "${1:-}" = --check-only ] && check_only=1
: "${K8S_LAB:?set K8S_LAB}" "${API_PORT:?set API_PORT}"
REPO=$(cd "$(dirname "$0")/../.." && pwd)
STATE=$K8S_LAB/nodes CLUSTER_CIDR=10.226.0.0/16
# Dual-stack nodes (nodes.sh, FAMILIES=dual|dual-ipv6): the pods' IPv6 range too, in the
# nodes' order of families, as a user lists both.
case $(cat "$STATE/families" 2>/dev/null) in
  dual) CLUSTER_CIDR+=,fd00:10:226::/48 ;;
  dual-ipv6) CLUSTER_CIDR=fd00:10:226::/48,$CLUSTER_CIDR ;;
esac
export KUBECONFIG=$K8S_LAB/kubeconfig
log() { echo "[deploy $(date -u +%H:%M:%S)] $*" >&2; }
now() { date +%s.%N; }
nodes=$(kubectl get nodes -o name | sed 's|node/||' | grep '^kpn-n' || true)
[ -n "$nodes" ] || { log "no kpn-n* nodes: lab/real-nodes/nodes.sh up first"; exit 1; }

# The user's edits, nothing else.
sed -e "s|server: https://control-plane.example.internal:6443|server: https://127.0.0.1:$API_PORT|" \
    -e "s|clusterCIDR: 10.244.0.0/16|clusterCIDR: $CLUSTER_CIDR|" "$REPO/deploy/configmap.yaml" >"$STATE/configmap.yaml"
grep -q "127.0.0.1:$API_PORT" "$STATE/configmap.yaml" || { log "deploy/configmap.yaml: server line not found"; exit 1; }
{ cat "$REPO/deploy/rbac.yaml"; echo ---; cat "$STATE/configmap.yaml"; echo ---; cat "$REPO/deploy/daemonset.yaml"; } >"$STATE/deploy.yaml"
# KPROXY_PRIVILEGED=1: the long-running container privileged as well (privileged and
# allowPrivilegeEscalation true, as kube-proxy runs).
if [ -n "${KPROXY_PRIVILEGED:-}" ]; then
  grep -q 'privileged: false' "$STATE/deploy.yaml" && grep -q 'allowPrivilegeEscalation: false' "$STATE/deploy.yaml" ||
    { log "deploy/daemonset.yaml: no 'privileged: false' / 'allowPrivilegeEscalation: false'"; exit 1; }
  sed -i -e 's/privileged: false/privileged: true/' -e 's/allowPrivilegeEscalation: false/allowPrivilegeEscalation: true/' "$STATE/deploy.yaml"
fi
if [ -n "${KPROXY_ARGS:-}" ]; then
  run='command: \[kproxy, run, --config, /var/lib/kproxy/config.yaml'
  grep -q "$run\]" "$STATE/deploy.yaml" || { log "deploy/daemonset.yaml: no '$run]'"; exit 1; }
  extra=$(printf ', %s' $KPROXY_ARGS)
  sed -i "s|$run\]|$run$extra]|" "$STATE/deploy.yaml"
fi

# A probe Service: agnhost netexec on every node (a DaemonSet), a NodePort Service.
cat >"$STATE/probe.yaml" <<YAML
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: kpn-probe, namespace: default}
spec:
  selector: {matchLabels: {app: kpn-probe}}
  template:
    metadata: {labels: {app: kpn-probe}}
    spec:
      containers:
        - name: netexec
          image: $(tar xOf "$K8S_LAB/images/agnhost.tar" manifest.json | python3 -c 'import json,sys;print(json.load(sys.stdin)[0]["RepoTags"][0])')
          imagePullPolicy: Never
          args: [netexec, --http-port=8080]
          readinessProbe: {httpGet: {path: /healthz, port: 8080}, periodSeconds: 1}
---
apiVersion: v1
kind: Service
metadata: {name: kpn-probe, namespace: default}
spec:
  type: NodePort
  # Both families on dual-stack nodes (one on single-stack ones): each is checked.
  ipFamilyPolicy: PreferDualStack
  selector: {app: kpn-probe}
  ports: [{port: 80, targetPort: 8080}]
YAML
if ! kubectl get svc kpn-probe >/dev/null 2>&1; then
  kubectl apply -f "$STATE/probe.yaml" >/dev/null
  kubectl rollout status ds/kpn-probe --timeout=180s >/dev/null
fi
family() { if [[ $1 == *:* ]]; then echo 6; else echo 4; fi; }
cips=$(kubectl get svc kpn-probe -o jsonpath='{.spec.clusterIPs[*]}')
cip_families=$(for c in $cips; do family "$c"; done | tr '\n' ' ')
np=$(kubectl get svc kpn-probe -o jsonpath='{.spec.ports[0].nodePort}')

t0=$(now)
[ -n "$check_only" ] || kubectl apply -f "$STATE/deploy.yaml" >/dev/null
[ -n "$check_only" ] || log "applied deploy/ (rbac, configmap with server 127.0.0.1:$API_PORT and clusterCIDR $CLUSTER_CIDR, daemonset)"
url() { if [[ $1 == *:* ]]; then echo "http://[$1]:$2/hostname"; else echo "http://$1:$2/hostname"; fi; }
works() { # NODE: the probe answers through its cluster IPs and through every node's NodePort
  local n=$1 ip
  for ip in $cips; do
    ip netns exec "kpn-$n" curl -sf --max-time 1 "$(url "$ip" 80)" >/dev/null || return 1
  done
  # A node address of a family the Service has (a single-stack Service has no NodePort on
  # the node's other family, with either proxy).
  for ip in $(kubectl get nodes -o jsonpath='{.items[*].status.addresses[?(@.type=="InternalIP")].address}'); do
    [[ " $cip_families " == *" $(family "$ip") "* ]] || continue
    ip netns exec "kpn-$n" curl -sf --max-time 1 "$(url "$ip" "$np")" >/dev/null || return 1
  done
}
declare -A done_at=()
deadline=$(( $(date +%s) + 300 ))
while :; do
  for n in $nodes; do
    [ -n "${done_at[$n]:-}" ] && continue
    works "${n#kpn-}" && done_at[$n]=$(now) && log "$n: Services work $(echo "${done_at[$n]} - $t0" | bc) s after apply"
  done
  [ "${#done_at[@]}" = "$(echo "$nodes" | wc -w)" ] && break
  [ "$(date +%s)" -lt "$deadline" ] || { log "Services did not work on every node within 300 s"; kubectl -n kube-system get pods -o wide >&2; exit 1; }
  sleep 0.2
done
[ -n "$check_only" ] && { log "the probe Service works on every node"; exit 0; }
kubectl -n kube-system rollout status ds/kproxy --timeout=120s >/dev/null
t_ready=$(now)
log "every node: Services work $(echo "$(printf '%s\n' "${done_at[@]}" | sort -n | tail -1) - $t0" | bc) s after apply; DaemonSet rolled out $(echo "$t_ready - $t0" | bc) s after apply"
