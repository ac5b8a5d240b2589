#!/usr/bin/env bash
# The k8s-lab control plane (etcd, kube-apiserver, kube-controller-manager) started afresh
# for the real nodes' IP families:
#
#   control-plane.sh dual     etcd wiped; the API server and the controller-manager with
#                             --service-cluster-ip-range=10.96.0.0/16,fd00:10:96::/112
#                             (then: FAMILIES=dual nodes.sh up)
#   control-plane.sh dual-ipv6  the same with IPv6 first: fd00:10:96::/112,10.96.0.0/16
#                             (a Service's first cluster IP is IPv6; FAMILIES=dual-ipv6)
#   control-plane.sh single   etcd wiped; k8s-lab's own start.sh, IPv4 only
#
# k8s-lab's start.sh sets one service range, IPv4, in its launch lines. A cluster cannot
# become dual-stack in place here (the default ServiceCIDR is written to etcd at the first
# start), so `dual` wipes etcd and runs a copy of start.sh whose two range flags are
# replaced, nothing else: the same PKI, ports, pid files and logs, so `start.sh stop` and
# `start.sh status` keep working. The copy refuses to run if start.sh's flag changed.
#
# Env: K8S_LAB, API_PORT as for start.sh; K8S_LAB_TOOLS: the k8s-lab directory
# (default: ../shared/tools/k8s-lab beside the repository).
set -euo pipefail
: "${K8S_LAB:?set K8S_LAB (source the k8s-lab env.sh)}"
REPO=$(cd "$(dirname "$0")/../.." && pwd)
TOOLS=${K8S_LAB_TOOLS:-$REPO/../shared/tools/k8s-lab}
START=$TOOLS/start.sh
SINGLE=10.96.0.0/16
[ -x "$START" ] || { echo "control-plane.sh: no $START (set K8S_LAB_TOOLS)" >&2; exit 1; }
[ ! -d "$K8S_LAB/nodes" ] || { echo "control-plane.sh: real nodes are up ($K8S_LAB/nodes): nodes.sh down first" >&2; exit 1; }

case ${1:-} in
  single) script=$START ;;
  dual|dual-ipv6)
    DUAL=10.96.0.0/16,fd00:10:96::/112
    [ "$1" = dual-ipv6 ] && DUAL=fd00:10:96::/112,10.96.0.0/16
    script=$K8S_LAB/start-$1.sh
    n=$(grep -c -- "--service-cluster-ip-range=$SINGLE " "$START" || true)
    [ "$n" = 2 ] || { echo "control-plane.sh: $START has $n lines with --service-cluster-ip-range=$SINGLE, not 2 (the API server's, kcm's): update this script" >&2; exit 1; }
    sed "s#--service-cluster-ip-range=$SINGLE #--service-cluster-ip-range=$DUAL #" "$START" >"$script"
    chmod +x "$script" ;;
  *) sed -n '2,10p' "$0" >&2; exit 2 ;;
esac
"$START" wipe
"$script" start
"$script" kcm
kubectl --kubeconfig "$K8S_LAB/kubeconfig" get servicecidrs kubernetes -o jsonpath='{.spec.cidrs}{"\n"}'
