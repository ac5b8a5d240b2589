#!/usr/bin/env bash
# Builds once, and caches, what the real nodes need from the Kubernetes tree that
# ../shared/tools/k8s-lab/setup.sh extracted into $K8S_LAB/src: kubelet, kube-scheduler,
# e2e.test, agnhost, regression-issue-74839 (Go, offline, vendor mode, version-stamped like
# setup.sh does) and the pause container (C, static). A binary is rebuilt only when absent or older than the tree.
#
# Env:   K8S_LAB   the k8s-lab directory (required)
#        NODES_BIN where the binaries go (default $K8S_LAB/bin-nodes)
#        GOCACHE   Go build cache (default $K8S_LAB/gocache-nodes)
#        ONLY      space-separated subset of: kubelet kube-scheduler e2e.test agnhost pause
#                  regression-issue-74839 ginkgo
set -euo pipefail
: "${K8S_LAB:?set K8S_LAB (source the k8s-lab env.sh)}"
SRC=$K8S_LAB/src KUBE=$K8S_LAB/src/deps/github.com/openshift/kubernetes
OUT=${NODES_BIN:-$K8S_LAB/bin-nodes}
GOROOT=$K8S_LAB/dl/go/go  # where setup.sh unpacks the Go wheel
[ -d "$KUBE/cmd/kubelet" ] || { echo "build.sh: no Kubernetes tree at $KUBE (run k8s-lab setup.sh first)" >&2; exit 1; }
[ -x "$GOROOT/bin/go" ] || { echo "build.sh: no Go toolchain at $GOROOT" >&2; exit 1; }
mkdir -p "$OUT"
export GOROOT PATH=$GOROOT/bin:$PATH GOPATH=$K8S_LAB/gopath GOCACHE=${GOCACHE:-$K8S_LAB/gocache-nodes}
export GOFLAGS=-mod=vendor GOTOOLCHAIN=local GOPROXY=off GOSUMDB=off CGO_ENABLED=0 GOENV=off GOTELEMETRY=off

# Version stamps the way setup.sh sets them: the e2e framework and kubelet report them.
KUBE_VERSION=$("$K8S_LAB/bin/kube-apiserver" --version | awk '{print $2}')
IFS=. read -r major minor _ <<<"${KUBE_VERSION#v}"
V=k8s.io/component-base/version
LDF="-s -w -X $V.gitVersion=$KUBE_VERSION -X $V.gitMajor=$major -X $V.gitMinor=$minor -X $V.gitTreeState=clean"
LDF+=" -X $V.gitCommit=$(cat "$SRC/.commit") -X $V.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"

log() { echo "[$(date -u +%H:%M:%S)] $*"; }
fresh() { [ -x "$OUT/$1" ] && [ "$OUT/$1" -nt "$SRC/.commit" ] && [ -z "${REBUILD:-}" ]; }
wanted() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
step() { # NAME COMMAND...
  local name=$1; shift
  wanted "$name" || return 0
  if fresh "$name"; then log "$name: cached ($OUT/$name)"; return 0; fi
  log "$name: building"
  local t=$SECONDS
  (cd "$KUBE" && nice -n 10 "$@")
  log "$name: built in $((SECONDS - t)) s"
}
step kubelet go build -trimpath -ldflags "$LDF" -o "$OUT/kubelet" ./cmd/kubelet
step kube-scheduler go build -trimpath -ldflags "$LDF" -o "$OUT/kube-scheduler" ./cmd/kube-scheduler
step agnhost go build -trimpath -ldflags "-s -w" -o "$OUT/agnhost" ./test/images/agnhost
# The boom-server of "Conntrack proxy implementation should not be vulnerable to the invalid
# conntrack state bug": standard library only.
step regression-issue-74839 go build -trimpath -ldflags "-s -w" -o "$OUT/regression-issue-74839" ./test/images/regression-issue-74839
# hack/lib/golang.sh builds test targets with `go test -c` and the tags selinux,notest.
step e2e.test go test -c -vet=off -trimpath -tags selinux,notest -ldflags "$LDF" -o "$OUT/e2e.test" ./test/e2e
# The ginkgo CLI of the same vendored version, to run e2e.test's specs in parallel
# (hack/ginkgo-e2e.sh's way; e2e.sh PROCS=N).
step ginkgo go build -trimpath -ldflags "-s -w" -o "$OUT/ginkgo" github.com/onsi/ginkgo/v2/ginkgo
# build/pause/Makefile: a static C binary stamped with VERSION.
pause_version=$(sed -n 's/^TAG ?= //p' "$KUBE/build/pause/Makefile")
step pause gcc -Os -Wall -Werror -static -DVERSION="v$pause_version-kproxy" -o "$OUT/pause" build/pause/linux/pause.c
log "done: $(ls "$OUT" | tr '\n' ' ')"
