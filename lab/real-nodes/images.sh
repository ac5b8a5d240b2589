#!/usr/bin/env bash
# Builds the images the real nodes run, as `docker save` archives under $IMAGES, from this
# machine's files (nothing is pulled): pause and agnhost under the exact names and tags the
# e2e framework asks for (test/utils/image/manifest.go), busybox, distroless-iptables and
# regression-issue-74839 likewise, and kproxy's own image following deploy/Dockerfile's
# steps (kproxy + nft + conntrack + CA certificates).
#
# Env: K8S_LAB (required), NODES_BIN (default $K8S_LAB/bin-nodes), IMAGES (default
#      $K8S_LAB/images), KPROXY_BIN (default <repo>/target/release/kproxy),
#      KPROXY_TAG (default kproxy:0.1.0, deploy/daemonset.yaml's image),
#      KPROXY_OUT (default $IMAGES/kproxy.tar), KPROXY_ONLY=1 (only kproxy's image: another
#      build's, e.g. an older release for the upgrade in upgrade.sh).
set -euo pipefail
: "${K8S_LAB:?set K8S_LAB (source the k8s-lab env.sh)}"
HERE=$(cd "$(dirname "$0")" && pwd) REPO=$(cd "$(dirname "$0")/../.." && pwd)
KUBE=$K8S_LAB/src/deps/github.com/openshift/kubernetes
BIN=${NODES_BIN:-$K8S_LAB/bin-nodes} IMAGES=${IMAGES:-$K8S_LAB/images}
KPROXY_BIN=${KPROXY_BIN:-$REPO/target/release/kproxy} KPROXY_TAG=${KPROXY_TAG:-kproxy:0.1.0}
mkdir -p "$IMAGES"
mk() { python3 "$HERE/mkimage.py" "$@"; }
# The tag the e2e framework asks for: configs[NAME] = Config{registry, "name", "version"}.
e2e_tag() { sed -n "s/.*configs\[$1\] = Config{list\.\([A-Za-z0-9]*\), \"\([^\"]*\)\", \"\([^\"]*\)\"}.*/\1 \2 \3/p" "$KUBE/test/utils/image/manifest.go"; }
e2e_ref() {
  local reg name ver host
  read -r reg name ver < <(e2e_tag "$1")
  host=$(sed -n "s/.*${reg}: *\"\([^\"]*\)\".*/\1/p" "$KUBE/test/utils/image/manifest.go" | head -1)
  [ -n "$host" ] && [ -n "$ver" ] || { echo "images.sh: no $1 in manifest.go" >&2; exit 1; }
  echo "$host/$name:$ver"
}
PAUSE=$(e2e_ref Pause) AGNHOST=$(e2e_ref Agnhost) BUSYBOX=$(e2e_ref BusyBox)
ETC=(--text "etc/passwd:root:x:0:0:root:/root:/bin/sh\nuser-defined-in-image:x:1000:1000::/home:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
     --text "etc/group:root:x:0:\nuser-defined-in-image:x:1000:\ngroup-defined-in-image:x:50000:user-defined-in-image\nnogroup:x:65534:\n"
     --text "etc/nsswitch.conf:passwd: files\ngroup: files\nhosts: files dns\n"
     --copy /etc/protocols:/etc/protocols --copy /etc/services:/etc/services --dir tmp:1777)
NSS=(/lib/x86_64-linux-gnu/libnss_files.so.2 /lib/x86_64-linux-gnu/libnss_dns.so.2 /lib/x86_64-linux-gnu/libresolv.so.2)
nss_copies() { local l; for l in "${NSS[@]}"; do [ -e "$l" ] && printf -- '--copy\0%s:usr%s\0' "$(readlink -f "$l")" "$l"; done; }
mapfile -d '' NSSC < <(nss_copies)

if [ -z "${KPROXY_ONLY:-}" ]; then
mk --tag "$PAUSE" --out "$IMAGES/pause.tar" --copy "$BIN/pause:/pause" --entrypoint '["/pause"]'

# agnhost's Dockerfile: alpine + bind-tools curl netcat-openbsd iproute2 bash util-linux,
# /agnhost (entrypoint, default `pause`), /agnhost-2, porter's localhost.crt/key, /uploads,
# the user and group the security-context tests look for. Here Debian's equivalents.
tools=()
for t in sh dash bash curl nc ip ss seq cat ls sleep timeout grep sed awk wget hostname env head tail \
         tr cut wc date mkdir rm touch ps tee sort uniq xargs id whoami expr dig nslookup mount \
         stat kill chmod ln cp mv dd nproc uname test printf echo true false; do
  p=$(type -P "$t" 2>/dev/null) && tools+=(--bin "$p")
done
mk --tag "$AGNHOST" --out "$IMAGES/agnhost.tar" "${tools[@]}" "${ETC[@]}" "${NSSC[@]}" \
   --copy "$BIN/agnhost:/agnhost" --link agnhost-2:agnhost --dir uploads \
   --copy "$KUBE/test/images/agnhost/porter/localhost.crt:/localhost.crt" \
   --copy "$KUBE/test/images/agnhost/porter/localhost.key:/localhost.key" \
   --entrypoint '["/agnhost"]' --cmd '["pause"]'

# busybox: the static Debian busybox and a link per applet, as the busybox image has.
bb=$(type -P busybox)
links=()
for a in $("$bb" --list); do [ "$a" = busybox ] || links+=(--link "bin/$a:busybox"); done
mk --tag "$BUSYBOX" --out "$IMAGES/busybox.tar" --copy "$bb:/bin/busybox" "${links[@]}" "${ETC[@]}" \
   --cmd '["sh"]'

# distroless-iptables: the hostNetwork, privileged pod of "KubeProxy should set TCP CLOSE_WAIT
# timeout" runs `sleep`, `test -f /proc/net/nf_conntrack`, `which conntrack` and
# `conntrack -L | grep` in it (the real image carries iptables, nft and conntrack).
IPTABLES=$(e2e_ref DistrolessIptables)
ipt=()
for t in sh sleep test cat grep conntrack nft; do p=$(type -P "$t") && ipt+=(--bin "$p"); done
mk --tag "$IPTABLES" --out "$IMAGES/distroless-iptables.tar" "${ipt[@]}" "${ETC[@]}" \
   --bin "$(readlink -f "$(type -P which)"):/usr/bin/which" --cmd '["sh"]'

# regression-issue-74839: its Dockerfile adds the one static binary as the entrypoint.
BOOM=$(e2e_ref RegressionIssue74839)
mk --tag "$BOOM" --out "$IMAGES/regression-issue-74839.tar" \
   --copy "$BIN/regression-issue-74839:/regression-issue-74839" --entrypoint '["/regression-issue-74839"]'
fi

# kproxy: deploy/Dockerfile's runtime stage (nftables, conntrack, ca-certificates, the binary
# at /usr/local/bin/kproxy) from this machine's Debian (bookworm, the Dockerfile's base too).
[ -x "$KPROXY_BIN" ] || { echo "images.sh: no kproxy binary at $KPROXY_BIN (cargo build --release -p kproxy)" >&2; exit 1; }
stripped=$IMAGES/kproxy.stripped.$$
objcopy --strip-debug "$KPROXY_BIN" "$stripped"
mk --tag "$KPROXY_TAG" --out "${KPROXY_OUT:-$IMAGES/kproxy.tar}" --bin "$(type -P nft)" --bin "$(type -P conntrack)" \
   --bin "$(type -P sh)" "${ETC[@]}" "${NSSC[@]}" \
   --copy /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt \
   --bin "$stripped:/usr/local/bin/kproxy" \
   --entrypoint '["/usr/local/bin/kproxy"]' --cmd '["run", "--config", "/var/lib/kproxy/config.yaml"]'
rm -f "$stripped"
echo "images: ${KPROXY_ONLY:+(kproxy only) }$PAUSE $AGNHOST $BUSYBOX ${IPTABLES:-} ${BOOM:-} $KPROXY_TAG in $IMAGES"
