#!/usr/bin/env bash
# Real Kubernetes nodes on this machine, registered with a running k8s-lab API server
# (../shared/tools/k8s-lab: `start.sh start` and `start.sh kcm`, env sourced).
#
#   nodes.sh up [N]          build what is missing, start N (default 2) nodes + kube-scheduler
#                            + the cloud (load balancers for type=LoadBalancer; CLOUD=0: none)
#   nodes.sh proxy MODE      switch the Service proxy on every node: kube-proxy | kproxy | none
#   nodes.sh status          nodes, pods in kube-system, processes
#   nodes.sh node-stop I     node I's machine goes away: kubelet, containers, containerd and
#                            the node's proxy killed, its switch port down (nothing answers)
#   nodes.sh node-start I    node I's machine back: port up, containerd, kubelet (and
#                            kube-proxy in that mode) started again; waits until Ready
#   nodes.sh down            stop and clean everything `up` started (also after a failed `up`)
#   FAMILIES=dual nodes.sh up [N]   IPv4 and IPv6 nodes, pods and routes (the API server and
#                            controller-manager with both service CIDRs first:
#                            control-plane.sh dual); `up` remembers it for every later command
#   FAMILIES=dual-ipv6 …     the same with IPv6 first: the nodes' primary address, the pods'
#                            first IP (control-plane.sh dual-ipv6: the Services' too)
#
# Each node is its own network namespace (kpn-nI, and a UTS namespace: hostname kpn-nI) holding a containerd (+ runc through a
# wrapper, see runc-wrapper) and a kubelet, pods on a CNI bridge (cni0) with the node's pod
# CIDR 10.226.I.0/24 (dual: and fd00:10:226:I::/64). The nodes hang off a bridge in a switch namespace (kpn-sw) on
# 192.168.226.0/24 (node I at .1I; dual: also fd00:192:168:226::1I/64); a veth from the
# switch to this machine (kpn-host, 192.168.226.1; dual: also fd00:192:168:226::1) lets
# the API server reach the kubelets (exec, logs) and the e2e runner
# reach node IPs. Every node namespace routes the other nodes' pod CIDRs through their node
# IPs. The API server listens on this machine's 127.0.0.1 only: a socat bridge forwards
# each node's 127.0.0.1:$API_PORT to it through a unix socket, so kubelets, kube-proxy and a
# hostNetwork kproxy pod use https://127.0.0.1:$API_PORT as on the host.
#
# What to kill and unmount is found by what this script owns, never by name: every process
# it starts runs in its own cgroup (pids:/kpn-nI-host) and every container in the kubelet's
# cgroupRoot (/kpn-nI); mounts are those under $STATE; namespaces and links carry the kpn-
# prefix. State: $K8S_LAB/nodes (removed by down); logs: $K8S_LAB/logs/nodes (kept).
set -euo pipefail
: "${K8S_LAB:?set K8S_LAB (source the k8s-lab env.sh)}"
: "${API_PORT:?set API_PORT (source the k8s-lab env.sh)}"
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${NODES_BIN:-$K8S_LAB/bin-nodes} IMAGES=${IMAGES:-$K8S_LAB/images}
STATE=$K8S_LAB/nodes LOGS=$K8S_LAB/logs/nodes
KUBECONFIG_ADMIN=$K8S_LAB/kubeconfig
SCHED_PORT=${SCHED_PORT:-$((${KCM_PORT:-10257} + 2))}
NET=192.168.226 HOST_IP=192.168.226.1 CLUSTER_CIDR=10.226.0.0/16
# The client side of the cloud is outside the nodes' /16: the ESIPP spec takes a client
# address inside it for a rewritten one ("Source IP was NOT preserved").
CLOUD_NET=172.31.228 LB_SW_IP=192.168.226.2 LB_POOL=172.31.229.0/24
# Dual stack (FAMILIES=dual|dual-ipv6 at `up`, kept in $STATE/families): the same plan in IPv6. The
# cloud's load balancers stay IPv4 (cloud.py assigns from an IPv4 pool only).
NET6=fd00:192:168:226 HOST_IP6=fd00:192:168:226::1 CLUSTER_CIDR6=fd00:10:226::/48
if [ -f "$STATE/families" ]; then FAMILIES=$(cat "$STATE/families"); else FAMILIES=${FAMILIES:-ipv4}; fi
HOSTS_TAG="# kproxy lab/real-nodes $K8S_LAB"
export KUBECONFIG=$KUBECONFIG_ADMIN

log() { echo "[nodes $(date -u +%H:%M:%S)] $*" >&2; }
die() { log "error: $*"; exit 1; }
k() { kubectl --kubeconfig "$KUBECONFIG_ADMIN" "$@"; }
node_ip() { echo "$NET.1$1"; }
pod_cidr() { echo "10.226.$1.0/24"; }
dual() { [ "$FAMILIES" = dual ] || [ "$FAMILIES" = dual-ipv6 ]; }
node_ip6() { echo "$NET6::1$1"; }
pod_cidr6() { echo "fd00:10:226:$1::/64"; }
in_order() { # IPV4 IPV6: the node's families in their order, comma-separated
  case $FAMILIES in dual) echo "$1,$2" ;; dual-ipv6) echo "$2,$1" ;; *) echo "$1" ;; esac
}
node_ips() { in_order "$(node_ip "$1")" "$(node_ip6 "$1")"; }
cluster_cidrs() { in_order "$CLUSTER_CIDR" "$CLUSTER_CIDR6"; }
# The Node's podCIDRs as kube-controller-manager's node IPAM would set them (it does not
# run here: the CIDRs are this script's plan). Set once: the API refuses a change.
patch_pod_cidrs() { # I
  local cidrs
  cidrs=$(in_order "\"$(pod_cidr "$1")\"" "\"$(pod_cidr6 "$1")\"")
  k patch node "kpn-n$1" --type merge -p "{\"spec\":{\"podCIDR\":${cidrs%%,*},\"podCIDRs\":[$cidrs]}}" >/dev/null 2>&1 || true
}
nodes_started() { local d; for d in "$STATE"/n[1-9]*/; do [ -d "$d" ] && basename "$d" | tr -d n; done; }

# --- cgroups: one per node for the processes started here, the kubelet's root for pods ---
CONTROLLERS=(cpu cpuacct cpuset memory pids blkio devices freezer systemd)
cg_make() { # NAME: the cgroup in every v1 hierarchy (cpuset needs cpus/mems before use)
  local c d
  for c in "${CONTROLLERS[@]}"; do
    d=/sys/fs/cgroup/$c/$1
    [ -d "/sys/fs/cgroup/$c" ] || continue
    mkdir -p "$d"
    if [ "$c" = cpuset ]; then
      cat /sys/fs/cgroup/cpuset/cpuset.cpus >"$d/cpuset.cpus"
      cat /sys/fs/cgroup/cpuset/cpuset.mems >"$d/cpuset.mems"
    fi
  done
}
cg_pids() { # NAME: every process in the cgroup's subtree
  local d=/sys/fs/cgroup/pids/$1
  [ -d "$d" ] && find "$d" -name cgroup.procs -exec cat {} + 2>/dev/null || true
}
cg_kill() { # NAME: KILL every process in the subtree until none is left, then remove it
  local try pids c
  for try in $(seq 1 50); do
    pids=$(cg_pids "$1")
    [ -z "$pids" ] && break
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    sleep 0.1
  done
  for c in "${CONTROLLERS[@]}" unified; do
    [ -d "/sys/fs/cgroup/$c/$1" ] && find "/sys/fs/cgroup/$c/$1" -depth -type d -exec rmdir {} \; 2>/dev/null
  done
  return 0
}

# launch NODE NAME CMD...: run in the node's namespace and host cgroup, log, remember the PID
# (node 0: this machine's namespace, or the one named by NETNS, e.g. the cloud's kpn-lb)
launch() {
  local n=$1 name=$2; shift 2
  local enter=()
  if [ "$n" != 0 ]; then
    # nsenter, not `ip netns exec`: that one also unshares the mount namespace and
    # remounts /sys, hiding the cgroup mounts from the kubelet and the pods' mounts from
    # everyone else.
    enter=(nsenter --net="/run/netns/kpn-n$n" --uts="$STATE/n$n/uts")
  elif [ -n "${NETNS:-}" ]; then
    enter=(nsenter --net="/run/netns/$NETNS")
  fi
  (
    echo "$BASHPID" >"/sys/fs/cgroup/pids/kpn-n$n-host/cgroup.procs"
    for c in "${CONTROLLERS[@]}"; do
      [ "$c" = pids ] || echo "$BASHPID" >"/sys/fs/cgroup/$c/kpn-n$n-host/cgroup.procs" 2>/dev/null || true
    done
    exec "${enter[@]}" "$@"
  ) >>"$LOGS/n$n-$name.log" 2>&1 &
  echo $! >"$STATE/n$n/$name.pid"
}
stop_pid() { # NODE NAME: TERM, then KILL after 10 s
  local f=$STATE/n$1/$2.pid p
  [ -f "$f" ] || return 0
  p=$(cat "$f")
  if kill -0 "$p" 2>/dev/null; then
    kill -TERM "$p" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
  fi
  rm -f "$f"
}
wait_for() { # SECONDS WHAT CMD...
  local t=$1 what=$2; shift 2
  for _ in $(seq 1 $((t * 2))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.5; done
  die "timed out after ${t}s waiting for $what"
}

# --- the network: switch namespace, host veth, node namespaces ---
net_up() {
  local nodes=$1 i j
  # What `down` compares the pods' network namespaces with (made after this: ours).
  mkdir -p "$STATE" && touch "$STATE/.started"
  ip netns add kpn-sw
  ip -n kpn-sw link add br0 type bridge
  ip -n kpn-sw link set br0 up
  ip link add kpn-host type veth peer name host netns kpn-sw
  ip -n kpn-sw link set host master br0 up
  ip addr add "$HOST_IP/24" dev kpn-host
  if dual; then ip addr add "$HOST_IP6/64" dev kpn-host nodad; fi
  ip link set kpn-host up
  for i in $(seq 1 "$nodes"); do
    ip netns add "kpn-n$i"
    # Its own hostname too: a hostNetwork pod answers with the node's name, as the e2e
    # specs on hostNetwork backends expect ("the expected hostname is the node name").
    mkdir -p "$STATE/n$i"
    touch "$STATE/n$i/uts"
    unshare --uts="$STATE/n$i/uts" hostname "kpn-n$i"
    ip -n kpn-sw link add "n$i" type veth peer name eth0 netns "kpn-n$i"
    ip -n kpn-sw link set "n$i" master br0 up
    ip -n "kpn-n$i" link set lo up
    ip -n "kpn-n$i" addr add "$(node_ip "$i")/24" dev eth0
    ip -n "kpn-n$i" link set eth0 up
    ip -n "kpn-n$i" route add default via "$HOST_IP"
    ip netns exec "kpn-n$i" sysctl -qw net.ipv4.ip_forward=1 net.bridge.bridge-nf-call-iptables=1 \
      net.bridge.bridge-nf-call-ip6tables=1
    ip route add "$(pod_cidr "$i")" via "$(node_ip "$i")"
    if dual; then
      # nodad: an address is usable at once, not after duplicate detection's second.
      ip -n "kpn-n$i" addr add "$(node_ip6 "$i")/64" dev eth0 nodad
      ip -n "kpn-n$i" route add default via "$HOST_IP6"
      ip netns exec "kpn-n$i" sysctl -qw net.ipv6.conf.all.forwarding=1
      ip route add "$(pod_cidr6 "$i")" via "$(node_ip6 "$i")"
    fi
    # The API server reaches a kubelet (logs, exec) by the node's Hostname address first
    # (--kubelet-preferred-address-types' default), and k8s-lab's flags are not ours.
    echo "$(node_ip "$i") kpn-n$i $HOSTS_TAG" >>/etc/hosts
  done
  for i in $(seq 1 "$nodes"); do
    for j in $(seq 1 "$nodes"); do
      [ "$i" = "$j" ] && continue
      ip -n "kpn-n$i" route add "$(pod_cidr "$j")" via "$(node_ip "$j")"
      if dual; then ip -n "kpn-n$i" route add "$(pod_cidr6 "$j")" via "$(node_ip6 "$j")"; fi
    done
  done
}

# --- the cloud: a load balancer in its own namespace between this machine and the nodes ---
# kpn-lb: `uplink` 172.31.228.2/30 ── veth ── kpn-cloud 172.31.228.1/30 on this machine, which
# routes the ingress pool (172.31.229.0/24) through it; `sw` 192.168.226.2/24 on the switch.
# Every node routes 172.31.228.0/30 back through it (conntrack there sees both directions). cloud.py, inside,
# assigns ingress IPs, health-checks the nodes and marks each new flow with one healthy
# node: `ip rule fwmark I` sends it to node I unchanged. docs/real-nodes.md, "The cloud".
cloud_up() {
  local nodes=$1 i spec=""
  ip netns add kpn-lb
  ip -n kpn-lb link set lo up
  ip link add kpn-cloud type veth peer name uplink netns kpn-lb
  ip addr add "$CLOUD_NET.1/30" dev kpn-cloud
  ip link set kpn-cloud up
  ip -n kpn-lb addr add "$CLOUD_NET.2/30" dev uplink
  ip -n kpn-lb link set dev uplink up
  ip -n kpn-sw link add lb type veth peer name sw netns kpn-lb
  ip -n kpn-sw link set lb master br0 up
  ip -n kpn-lb addr add "$LB_SW_IP/24" dev sw
  ip -n kpn-lb link set sw up
  ip netns exec kpn-lb sysctl -qw net.ipv4.ip_forward=1 net.ipv4.conf.all.rp_filter=0 \
    net.ipv4.conf.default.rp_filter=0 net.ipv4.conf.sw.rp_filter=0 net.ipv4.conf.uplink.rp_filter=0
  ip route add "$LB_POOL" via "$CLOUD_NET.2" dev kpn-cloud
  for i in $(seq 1 "$nodes"); do
    ip -n kpn-lb rule add fwmark "$i" lookup "$((100 + i))"
    ip -n kpn-lb route add default via "$(node_ip "$i")" dev sw table "$((100 + i))"
    ip -n "kpn-n$i" route add "$CLOUD_NET.0/30" via "$LB_SW_IP"
    spec+="$i:kpn-n$i=$(node_ip "$i"),"
  done
  NETNS=kpn-lb launch 0 lb-api-bridge socat "TCP-LISTEN:$API_PORT,bind=127.0.0.1,fork,reuseaddr" "UNIX-CONNECT:$STATE/api.sock"
  NETNS=kpn-lb launch 0 cloud python3 "$HERE/cloud.py" --kubeconfig "$KUBECONFIG_ADMIN" \
    --pool "$LB_POOL" --nodes "${spec%,}"
  wait_for 10 "the cloud's controller" grep -q "up: pool" "$LOGS/n0-cloud.log"
}

# --- one node: containerd, kubelet, API bridge ---
node_files() { # I
  local i=$1 d=$STATE/n$1
  mkdir -p "$d"/{containerd,cni,cni-ipam,kubelet,pod-logs}
  cat >"$d/containerd.toml" <<EOF
version = 2
root = "$d/containerd/root"
state = "$d/containerd/state"
[grpc]
  address = "$d/containerd.sock"
[ttrpc]
  address = "$d/containerd.sock.ttrpc"
[debug]
  address = "$d/containerd-debug.sock"
[plugins."io.containerd.internal.v1.opt"]
  path = "$d/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$(tar xOf "$IMAGES/pause.tar" manifest.json | python3 -c 'import json,sys;print(json.load(sys.stdin)[0]["RepoTags"][0])')"
  enable_selinux = false
  disable_apparmor = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "$HERE/runc-wrapper"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$d/cni"
EOF
  local ranges routes
  ranges=$(in_order "[{\"subnet\": \"$(pod_cidr "$i")\"}]" "[{\"subnet\": \"$(pod_cidr6 "$i")\"}]")
  routes=$(in_order '{"dst": "0.0.0.0/0"}' '{"dst": "::/0"}')
  cat >"$d/cni/10-kpn.conflist" <<EOF
{"cniVersion": "0.4.0", "name": "kpn", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [$ranges],
            "routes": [$routes], "dataDir": "$d/cni-ipam"}},
  {"type": "portmap", "capabilities": {"portMappings": true}}
]}
EOF
  # The host's kubeconfig unchanged: 127.0.0.1:$API_PORT is the socat bridge in the node.
  cp "$KUBECONFIG_ADMIN" "$d/kubeconfig"
  cat >"$d/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This machine: cgroup v1 and no systemd (k8s-lab README, "Real nodes").
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /kpn-n$i
failSwapOn: false
containerRuntimeEndpoint: unix://$d/containerd.sock
address: $(node_ip "$i")
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
# The API server's kubelet client has no client certificate in k8s-lab: anonymous, allowed.
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
podCIDR: $(pod_cidr "$i")
podLogsDir: $d/pod-logs
clusterDomain: cluster.local
# dns.py on the host's end of the node network: the e2e tests reach Services by name.
clusterDNS: [$HOST_IP]
# The disk is shared and nothing can be pulled again: no eviction for disk, no image GC.
evictionHard: {memory.available: "1Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
maxPods: 110
EOF
}

node_up() { # I
  local i=$1 d=$STATE/n$1
  cg_make "kpn-n$i-host"
  cg_make "kpn-n$i"
  node_files "$i"
  launch "$i" api-bridge socat "TCP-LISTEN:$API_PORT,bind=127.0.0.1,fork,reuseaddr" "UNIX-CONNECT:$STATE/api.sock"
  launch "$i" containerd containerd --config "$d/containerd.toml"
  wait_for 30 "containerd n$i" test -S "$d/containerd.sock"
  local img
  for img in "$IMAGES"/*.tar; do
    ctr -a "$d/containerd.sock" -n k8s.io images import "$img" >>"$LOGS/n$i-import.log" 2>&1 ||
      die "n$i: importing $img failed (see $LOGS/n$i-import.log)"
  done
  launch "$i" kubelet "$BIN/kubelet" --config "$d/kubelet.yaml" --kubeconfig "$d/kubeconfig" \
    --root-dir "$d/kubelet" --cert-dir "$d/kubelet/pki" --hostname-override "kpn-n$i" \
    --node-ip "$(node_ips "$i")" --v=1
}

# A machine that powers off: nothing of the node runs and nothing answers at its address
# (its switch port is down, so probes and packets to it time out, as to a gone VM). The
# node's network namespace, its rules and its pods' state on disk stay, as a disk does.
node_stop() { # I
  local i=$1
  [ -d "$STATE/n$i" ] || die "node-stop: no node $i"
  ip -n kpn-sw link set "n$i" down
  stop_pid "$i" kube-proxy
  stop_pid "$i" kubelet
  cg_kill "kpn-n$i"
  cg_kill "kpn-n$i-host"
  # A killed containerd leaves its sockets: node-start must wait for the new ones.
  rm -f "$STATE/n$i"/*.pid "$STATE/n$i"/containerd*.sock*
  log "node-stop: kpn-n$i off"
}
node_start() { # I
  local i=$1
  [ -d "$STATE/n$i" ] || die "node-start: no node $i"
  ip -n kpn-sw link set "n$i" up
  node_up "$i"
  wait_for 120 "node kpn-n$i Ready" sh -c "kubectl get node kpn-n$i -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}' | grep -qx True"
  patch_pod_cidrs "$i"
  if [ "$(proxy_mode)" = kube-proxy ]; then
    kube_proxy_up "$i"
    wait_for 60 "kube-proxy healthz on n$i" ip netns exec "kpn-n$i" curl -sf "http://$(node_ip "$i"):10256/healthz"
  fi
  log "node-start: kpn-n$i Ready"
}

kube_proxy_up() { # I
  launch "$1" kube-proxy "$K8S_LAB/bin/kube-proxy" --kubeconfig "$K8S_LAB/kubeconfig-proxy" \
    --proxy-mode=nftables --hostname-override="kpn-n$1" --cluster-cidr="$(cluster_cidrs)" \
    --nodeport-addresses=primary --healthz-bind-address=0.0.0.0:10256 \
    --metrics-bind-address=127.0.0.1:10249 --conntrack-max-per-core=0 --v=1
}

proxy_mode() { cat "$STATE/proxy" 2>/dev/null || echo none; }
proxy_off() {
  local i mode
  mode=$(proxy_mode)
  for i in $(nodes_started); do stop_pid "$i" kube-proxy; done
  if [ "$mode" = kproxy ]; then
    k delete -f "$STATE/deploy.yaml" --ignore-not-found --wait=true >/dev/null 2>&1 || true
    # Pods on gone nodes never finish terminating: wait only while the kubelets run.
    wait_for 60 "kproxy pods gone" sh -c "! kubectl -n kube-system get pods -l app.kubernetes.io/name=kproxy -o name | grep -q ."
  fi
  # Whatever table either proxy left (both name theirs after themselves).
  for i in $(nodes_started); do
    for t in "ip kube-proxy" "ip6 kube-proxy" "ip kproxy" "ip6 kproxy"; do
      ip netns exec "kpn-n$i" nft delete table $t 2>/dev/null || true
    done
  done
  echo none >"$STATE/proxy"
}
proxy_up() { # MODE
  local i
  proxy_off
  case $1 in
    none) ;;
    kube-proxy)
      for i in $(nodes_started); do kube_proxy_up "$i"; done
      for i in $(nodes_started); do
        wait_for 60 "kube-proxy healthz on n$i" ip netns exec "kpn-n$i" curl -sf "http://$(node_ip "$i"):10256/healthz"
      done ;;
    kproxy) "$HERE/deploy.sh" ;;
    *) die "proxy: kube-proxy, kproxy or none, not '$1'" ;;
  esac
  echo "$1" >"$STATE/proxy"
  log "proxy: $1"
}

up() {
  local nodes=${1:-2} i
  [ -d "$STATE" ] && die "$STATE exists: run '$0 down' first"
  k get --raw /readyz >/dev/null 2>&1 || die "no API server at $KUBECONFIG_ADMIN (start.sh start; start.sh kcm)"
  case $FAMILIES in ipv4|dual|dual-ipv6) ;; *) die "FAMILIES: ipv4, dual or dual-ipv6, not '$FAMILIES'" ;; esac
  # The API server must allocate what the nodes carry, in the same order of families.
  local cidrs want
  cidrs=$(k get servicecidrs kubernetes -o jsonpath='{.spec.cidrs}' 2>/dev/null || true)
  want=$(in_order ipv4 ipv6)
  [ "$(python3 -c 'import json,sys; print(",".join("ipv6" if ":" in c else "ipv4" for c in json.loads(sys.argv[1] or "[]")))' "$cidrs")" = "$want" ] ||
    die "FAMILIES=$FAMILIES wants service CIDRs of $want, the API server has '$cidrs' (control-plane.sh single, dual or dual-ipv6 to match)"
  local tool
  for tool in containerd ctr runc socat nft curl /usr/lib/cni/bridge /usr/lib/cni/host-local /usr/lib/cni/portmap; do
    command -v "$tool" >/dev/null || die "missing $tool (apt-get install containerd runc containernetworking-plugins socat nftables curl)"
  done
  ONLY="kubelet kube-scheduler agnhost pause regression-issue-74839" "$HERE/build.sh"  # e2e.test: e2e.sh builds it
  [ -f "$IMAGES/agnhost.tar" ] && [ -f "$IMAGES/kproxy.tar" ] && [ -z "${REBUILD_IMAGES:-}" ] || "$HERE/images.sh"
  mkdir -p "$STATE/n0" "$LOGS"
  echo "$FAMILIES" >"$STATE/families"
  # Any failure from here on (die, a failing command) leaves nothing behind.
  trap 'rc=$?; if [ $rc != 0 ]; then log "up failed (exit $rc): cleaning"; down; fi' EXIT
  cg_make kpn-n0-host
  launch 0 api-socket socat "UNIX-LISTEN:$STATE/api.sock,fork,unlink-early" "TCP:127.0.0.1:$API_PORT"
  net_up "$nodes"
  launch 0 dns python3 "$HERE/dns.py" --listen "$HOST_IP" --kubeconfig "$KUBECONFIG_ADMIN"
  [ "${CLOUD:-1}" = 0 ] || cloud_up "$nodes"
  for i in $(seq 1 "$nodes"); do node_up "$i"; done
  launch 0 kube-scheduler "$BIN/kube-scheduler" --kubeconfig "$KUBECONFIG_ADMIN" \
    --authentication-kubeconfig "$KUBECONFIG_ADMIN" --authorization-kubeconfig "$KUBECONFIG_ADMIN" \
    --bind-address=127.0.0.1 --secure-port="$SCHED_PORT" --leader-elect=false --v=1
  for i in $(seq 1 "$nodes"); do
    wait_for 120 "node kpn-n$i Ready" sh -c "kubectl get node kpn-n$i -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}' | grep -qx True"
    patch_pod_cidrs "$i"
  done
  proxy_up "${PROXY:-none}"
  trap - EXIT
  log "up: $nodes nodes Ready ($(k get nodes -o name | tr '\n' ' ')), proxy $(proxy_mode); logs in $LOGS"
}

down() {
  trap - EXIT
  local i
  [ -d "$STATE" ] || { log "down: nothing started ($STATE absent)"; }
  if [ -d "$STATE" ] && [ "$(proxy_mode)" = kproxy ]; then
    k delete -f "$STATE/deploy.yaml" --ignore-not-found --wait=false >/dev/null 2>&1 || true
  fi
  for i in $(nodes_started); do
    stop_pid "$i" kube-proxy
    stop_pid "$i" kubelet
  done
  stop_pid 0 kube-scheduler
  # Containers (the kubelet's cgroup root), then containerd and its shims (the node's cgroup).
  for i in $(nodes_started) $(seq 1 9); do
    [ -d /sys/fs/cgroup/pids/kpn-n$i ] && cg_kill "kpn-n$i"
    [ -d /sys/fs/cgroup/pids/kpn-n$i-host ] && cg_kill "kpn-n$i-host"
  done
  [ -d /sys/fs/cgroup/pids/kpn-n0-host ] && cg_kill kpn-n0-host
  # Mounts under the state directory (pod volumes, overlay rootfs, shm), deepest first.
  if [ -d "$STATE" ]; then
    local m
    for _ in 1 2 3; do
      m=$(awk -v s="$STATE/" 'index($5, s) == 1 {print $5}' /proc/self/mountinfo | sort -r)
      [ -z "$m" ] && break
      # shellcheck disable=SC2086
      for mp in $m; do umount "$mp" 2>/dev/null || umount -l "$mp" 2>/dev/null || true; done
    done
  fi
  for ns in $(ip netns list | awk '$1 ~ /^kpn-(n[0-9]+|sw|lb)$/ {print $1}'); do ip netns del "$ns"; done
  # The pods' own namespaces: containerd's CRI pins each sandbox's at /run/netns/cni-*
  # and removes it only when the sandbox is removed, which a killed containerd never
  # does. Those made since these nodes started and with no process left are ours.
  if [ -e "$STATE/.started" ]; then
    for ns in $(find /run/netns -maxdepth 1 -name 'cni-*' -newer "$STATE/.started" -printf '%f\n' 2>/dev/null); do
      if [ -z "$(ip netns pids "$ns" 2>/dev/null)" ]; then ip netns del "$ns"; fi
    done
  fi
  ip link del kpn-host 2>/dev/null || true
  ip link del kpn-cloud 2>/dev/null || true
  if grep -qF "$HOSTS_TAG" /etc/hosts; then
    # In place (not sed -i): /etc/hosts may be a bind mount that a rename cannot replace.
    grep -vF "$HOSTS_TAG" /etc/hosts >"/etc/hosts.kpn.$$" || true
    cat "/etc/hosts.kpn.$$" >/etc/hosts
    rm -f "/etc/hosts.kpn.$$"
  fi
  if [ -d "$STATE" ]; then
    for i in $(nodes_started); do
      k delete node "kpn-n$i" --ignore-not-found --wait=false >/dev/null 2>&1 || true
    done
    rm -rf "$STATE"
  fi
  log "down: clean"
}

status() {
  k get nodes -o wide || true
  k -n kube-system get pods -o wide || true
  echo "proxy: $(proxy_mode); families: $FAMILIES"
  local f
  for f in "$STATE"/n*/*.pid; do [ -f "$f" ] && printf '%s %s %s\n' "${f#"$STATE"/}" "$(cat "$f")" "$(kill -0 "$(cat "$f")" 2>/dev/null && echo running || echo GONE)"; done
}

case ${1:-} in
  up) shift; up "$@" ;;
  down) down ;;
  proxy) shift; [ -d "$STATE" ] || die "no nodes: $0 up first"; proxy_up "${1:?kube-proxy|kproxy|none}" ;;
  status) status ;;
  node-stop) shift; node_stop "${1:?node number}" ;;
  node-start) shift; node_start "${1:?node number}" ;;
  *) sed -n '2,16p' "$0" >&2; exit 2 ;;
esac
