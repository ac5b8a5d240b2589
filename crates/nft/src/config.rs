//! How the plan reaches the kernel ([`DataplaneConfig`]: settings that do not change
//! decisions) and the checks of the only free-form strings that reach an nft script
//! (the table name, interface names of the local-traffic detector).

use kproxy_core::NodePlan;
use kproxy_core::plan::LocalPods;

use crate::error::NftError;

/// How the plan reaches the kernel (settings that do not change decisions).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataplaneConfig {
    /// Table name: `kproxy` → tables `ip kproxy` and `ip6 kproxy`.
    pub table: String,
    /// kube-proxy's masqueradeBit (default 14 → mark 0x4000).
    pub masquerade_bit: u8,
    /// Delete stale UDP conntrack entries after each sync (default true).
    pub conntrack_cleanup: bool,
    /// Count new connections per Service port and endpoint, and the rejects and drops,
    /// in named counter objects (`crate::ruleset`, "Counters"; default false, as
    /// `kproxy run`'s `--traffic-metrics off`).
    pub counters: bool,
}

impl Default for DataplaneConfig {
    fn default() -> Self {
        DataplaneConfig {
            table: "kproxy".into(),
            masquerade_bit: 14,
            conntrack_cleanup: true,
            counters: false,
        }
    }
}

impl DataplaneConfig {
    /// The masquerade mark value.
    pub fn mark(&self) -> u32 {
        1u32 << (self.masquerade_bit & 31)
    }

    /// Rejects values that could not be rendered safely.
    pub fn validate(&self) -> Result<(), NftError> {
        kproxy_core::config::check_nft_table_name(&self.table).map_err(NftError::Invalid)?;
        if self.masquerade_bit > 31 {
            return Err(NftError::Invalid(format!(
                "masquerade bit {} is not in 0..=31",
                self.masquerade_bit
            )));
        }
        Ok(())
    }
}

/// Checks the plan's only free-form strings (interface names from the local-traffic
/// detector config) before they reach a script.
pub fn validate_plan(plan: &NodePlan) -> Result<(), NftError> {
    for f in &plan.families {
        match &f.local_pods {
            LocalPods::InterfacePrefix(s) | LocalPods::Bridge(s) => validate_interface(s)?,
            LocalPods::None | LocalPods::Cidrs(_) => {}
        }
    }
    Ok(())
}

/// Linux interface names: 1..=15 bytes; kproxy also limits the alphabet so the name can
/// sit in an nft string without escaping.
pub fn validate_interface(s: &str) -> Result<(), NftError> {
    kproxy_core::config::check_interface_name(s).map_err(NftError::Invalid)
}
