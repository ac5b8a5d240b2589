#!/usr/bin/env bash
# kproxy upgraded across versions and rolled back, under load: the DaemonSet's image goes
# from another build (OLD_BIN, e.g. a release from before a table layout change) to this
# one and back, RUNS times, each step a rolling update under self-update.sh's load
# (load.py in kpn-n1: new connections and keep-alive through the probe Service's cluster
# IP and every node's NodePort). Prints one line per step and the JSON of each.
#
#   upgrade.sh OLD_BIN [RUNS]       (after nodes.sh up && nodes.sh proxy kproxy)
#   NEW_ARGS="--traffic-metrics service" upgrade.sh OLD_BIN [RUNS]
#       this build also runs with NEW_ARGS (its steps change the image and the command in
#       one rollout): tables the other build did not write, so each step replaces them
#       rather than adopting (at a few Services and no counters both builds write the same)
set -euo pipefail
: "${K8S_LAB:?set K8S_LAB}"
HERE=$(cd "$(dirname "$0")" && pwd)
export KUBECONFIG=$K8S_LAB/kubeconfig
old_bin=${1:?OLD_BIN: the kproxy binary of another build} runs=${2:-3}
IMAGES=${IMAGES:-$K8S_LAB/images}
tar=$IMAGES/kproxy-prev.tar prev=kproxy:prev new=kproxy:0.1.0
log() { echo "[upgrade $(date -u +%H:%M:%S)] $*" >&2; }
KPROXY_ONLY=1 KPROXY_BIN=$old_bin KPROXY_TAG=$prev KPROXY_OUT=$tar "$HERE/images.sh" >&2
out=$K8S_LAB/upgrade
mkdir -p "$out"
base=$(kubectl -n kube-system get ds kproxy -o jsonpath='{.spec.template.spec.containers[0].command}')
base=$(python3 -c 'import json,sys; c=json.loads(sys.argv[1]); n=sys.argv[2].split(); print(json.dumps(c[:len(c)-len(n)] if n and c[-len(n):]==n else c))' "$base" "${NEW_ARGS:-}")
with_args=$(python3 -c 'import json,sys; print(json.dumps(json.loads(sys.argv[1]) + sys.argv[2].split()))' "$base" "${NEW_ARGS:-}")
step() { # NAME TAG [IMPORT]
  local name=$1 tag=$2 command=
  if [ -n "${NEW_ARGS:-}" ]; then
    if [ "$tag" = "$new" ]; then command=$with_args; else command=$base; fi
  fi
  COMMAND=$command IMPORT=${3:-} "$HERE/self-update.sh" "$tag" >"$out/$name.json"
  python3 - "$name" "$out/$name.json" <<'PY'
import json, sys
name, d = sys.argv[1], json.load(open(sys.argv[2]))
t = d.get("targets", d)
new_ok = sum(v.get("new_ok", 0) for v in t.values())
new_failed = sum(v.get("new_failed", 0) for v in t.values())
est = sum(v.get("est_requests", 0) for v in t.values())
broken = sum(v.get("est_broken", 0) for v in t.values())
print(f"{name}: new connections {new_failed} failed of {new_ok + new_failed}; "
      f"keep-alive {broken} broken over {est} requests", flush=True)
PY
}
log "to the other build ($old_bin) first, under load too"
step start-prev "$prev" "$tar"
for r in $(seq 1 "$runs"); do
  step "run$r-upgrade" "$new"
  step "run$r-rollback" "$prev" "$tar"
done
step end "$new"
if [ -n "${NEW_ARGS:-}" ]; then
  log "the DaemonSet's command back to $base (not under load)"
  kubectl -n kube-system patch ds kproxy --type=json \
    -p "[{\"op\":\"replace\",\"path\":\"/spec/template/spec/containers/0/command\",\"value\":$base}]" >/dev/null
  kubectl -n kube-system rollout status ds/kproxy --timeout=300s >/dev/null
fi
log "JSON per step in $out"

