//! What the kernel holds, for the rule that keeps broken input from wiping a node
//! ([`kproxy_core::input_guard`] decides): [`kernel_holds_more`] and
//! [`kernel_holds_exactly`] read kproxy's tables.

use kproxy_core::NodePlan;
use kproxy_nft::DataplaneConfig;

/// Rules and set elements of kproxy's tables in the kernel beyond what `plan` without
/// its Services would leave, when there are any; `None` when the tables are absent,
/// unreadable or hold no more. Reads the kernel (root).
pub fn kernel_holds_more(plan: &NodePlan, cfg: &DataplaneConfig) -> Option<(usize, usize)> {
    let empty = NodePlan {
        services: Default::default(),
        conflicts: Vec::new(),
        cluster_ip_warnings: Vec::new(),
        ..plan.clone()
    };
    let desired = kproxy_nft::desired(&empty, cfg);
    let mut more = (0, 0);
    for want in &desired {
        let Ok(Some(kernel)) = kproxy_nft::KernelTable::read(want.family(), want.name()) else {
            continue;
        };
        more.0 += kernel.rule_count().saturating_sub(want.rule_count());
        more.1 += kernel.element_count().saturating_sub(want.element_count());
    }
    (more != (0, 0)).then_some(more)
}

/// Whether kproxy's tables in the kernel hold exactly what `plan` programs: they can be
/// adopted and the adoption delta is empty (what a first sync of `plan` would send
/// here, `kproxy sync --dry-run`'s). Reads the kernel (root); false when it cannot.
pub fn kernel_holds_exactly(plan: &NodePlan, cfg: &DataplaneConfig) -> bool {
    let (tx, adopted) = kproxy_nft::first_sync_transaction(plan, cfg);
    adopted && tx.is_empty()
}
