//! kproxy's nftables dataplane: renders a NodePlan into kproxy's own tables
//! (`ip kproxy`, `ip6 kproxy`), applies it atomically (full sync, then deltas),
//! verifies the kernel against what was programmed, and cleans up stale conntrack
//! entries. Under construction (issue 3).
