//! `kproxy trace --kernel`: the fate of one new connection under the tables this
//! network namespace's kernel holds, beside the plan's. kproxy's tables are read back
//! over nfnetlink and adopted in the plan's terms exactly as adoption reads them
//! (`kproxy_nft::KernelTable`), evaluated by `kproxy_nft::evaluate`, and
//! where the two fates or the objects the packet touched differ, the differing chains,
//! sets and elements are named (`kproxy_nft::divergence`).
//!
//! It reads the kernel of the machine it runs on: on a node, as root or in kproxy's
//! pod (`kubectl exec`); the kubectl plugin on a workstation cannot reach a node's
//! kernel, and says so.

use std::net::IpAddr;

use anyhow::{Context, Result, bail};
use kproxy_core::NodePlan;
use kproxy_core::model::IpFamily;
use kproxy_core::trace::{Packet, Trace};
use kproxy_nft::DataplaneConfig;
use kproxy_nft::{Fate, Outcome, divergence, evaluate};
use serde::Serialize;

/// The answer (`-o json|yaml` prints it as is).
#[derive(Debug, Serialize)]
pub struct KernelTrace {
    /// `kproxy trace`'s answer from the plan.
    pub plan: Trace,
    pub kernel: KernelSide,
    /// The kernel does what the plan says (verdict, endpoints and their shares,
    /// masquerade).
    pub agrees: bool,
    /// What of the kernel's table the packet touched differs from the plan's.
    pub differs: Vec<String>,
}

/// The kernel's side: its table and its fate, one outcome per branch.
#[derive(Debug, Serialize)]
pub struct KernelSide {
    /// `ip kproxy` / `ip6 kproxy`.
    pub table: String,
    pub outcomes: Vec<Outcome>,
    /// Why the kernel's table could not be evaluated (it holds what adoption cannot
    /// account for).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unreadable: Option<String>,
}

/// How to run it where the kernel is.
const ON_THE_NODE: &str = "--kernel reads the kernel of the machine it runs on: run it on the node, as root or in kproxy's pod (kubectl exec -n kube-system <kproxy pod on the node> -- kproxy trace --kernel …)";

/// Whether `status` (the text of /proc/self/status) gives the effective capability
/// `cap`; `None` when it does not say.
fn has_capability(status: &str, cap: u32) -> Option<bool> {
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))?
        .trim();
    let bits = u64::from_str_radix(hex, 16).ok()?;
    Some(bits & (1 << cap) != 0)
}

const CAP_NET_ADMIN: u32 = 12;

/// Reads this network namespace's kproxy tables and sets their fate of `pkt` beside
/// `plan`'s (`traced`, `kproxy_core::trace` of the same packet).
pub fn kernel_trace(
    plan: &NodePlan,
    cfg: &DataplaneConfig,
    pkt: &Packet,
    local_addresses: &[IpAddr],
    traced: Trace,
) -> Result<KernelTrace> {
    let family = IpFamily::of(&pkt.dst);
    if IpFamily::of(&pkt.src) != family {
        bail!(
            "--src {} and --dst {} are of different IP families: one connection has one family",
            pkt.src,
            pkt.dst
        );
    }
    if let Ok(status) = std::fs::read_to_string("/proc/self/status")
        && has_capability(&status, CAP_NET_ADMIN) == Some(false)
    {
        bail!(
            "reading kproxy's nftables tables needs CAP_NET_ADMIN, which this process lacks; {ON_THE_NODE}"
        );
    }
    let desired = kproxy_nft::desired(plan, cfg);
    let mut kernel = Vec::with_capacity(2);
    for d in &desired {
        let t = kproxy_nft::KernelTable::read(d.family(), d.name()).with_context(|| {
            format!(
                "reading table {} {} back from the kernel",
                d.family(),
                d.name()
            )
        })?;
        kernel.push(t.map(|t| t.adopt(d)));
    }
    let i = usize::from(family == IpFamily::IPv6);
    let name = format!("{} {}", desired[i].family(), desired[i].name());
    if kernel.iter().all(Option::is_none) {
        bail!(
            "no kproxy tables (ip {t}, ip6 {t}) in this network namespace: is kproxy running here? {ON_THE_NODE}",
            t = cfg.table
        );
    }
    let Some(adopted) = kernel.swap_remove(i) else {
        bail!(
            "table {name} is absent in this network namespace while kproxy's other table exists: {} is of no family kproxy programs here",
            pkt.dst
        );
    };
    let kernel = match adopted {
        Ok(t) => t,
        Err(e) => {
            return Ok(KernelTrace {
                plan: traced,
                kernel: KernelSide {
                    table: name,
                    outcomes: Vec::new(),
                    unreadable: Some(e.what.clone()),
                },
                agrees: false,
                differs: vec![e.to_string()],
            });
        }
    };
    let want = &desired[i];
    let ev = evaluate(&kernel, pkt, local_addresses);
    let mut touched = ev.touched.clone();
    touched.extend(evaluate(want, pkt, local_addresses).touched);
    let differs = divergence(&kernel, want, &touched)
        .context("comparing the kernel's table with the plan's")?;
    Ok(KernelTrace {
        agrees: ev.agrees_with(&traced),
        plan: traced,
        kernel: KernelSide {
            table: name,
            outcomes: ev.outcomes,
            unreadable: None,
        },
        differs,
    })
}

/// One outcome as a sentence.
fn outcome_line(o: &Outcome, whole: bool) -> String {
    let mut s = match o.fate {
        Fate::Dnat => format!(
            "DNAT to {}",
            o.endpoint.map(|e| e.to_string()).unwrap_or_default()
        ),
        Fate::Drop => "DROP".into(),
        Fate::Reject => "REJECT".into(),
        // The mark may be set before a dispatch that finds no row.
        Fate::None if o.masquerade => "NONE (not translated to an endpoint)".into(),
        Fate::None => "NONE (kproxy leaves it untouched)".into(),
        Fate::Unknown => format!(
            "cannot tell: {}",
            o.note
                .as_deref()
                .unwrap_or("a rule the evaluator does not know")
        ),
    };
    if !whole {
        s += &format!(", {} of new connections", o.share);
    }
    if o.masquerade {
        s += ", masqueraded";
    } else if o.fate == Fate::Dnat {
        s += ", client address kept";
    }
    s += &format!(" (chains: {})", o.chains.join(" → "));
    s
}

/// Prints the kernel's side under the plan's (`-o table`).
pub fn print(k: &KernelTrace) {
    let mut label = format!("kernel ({}):", k.kernel.table);
    if let Some(why) = &k.kernel.unreadable {
        println!("{label} cannot be evaluated: {why}");
    }
    let whole = k.kernel.outcomes.len() == 1;
    for o in &k.kernel.outcomes {
        println!("{label} {}", outcome_line(o, whole));
        label = " ".repeat(label.len());
    }
    println!(
        "agrees:     {}",
        if k.kernel.unreadable.is_some() {
            "NO: the kernel's table holds what kproxy cannot evaluate"
        } else if k.agrees && k.differs.is_empty() {
            "yes, the kernel does what the plan says"
        } else if k.agrees {
            "in fate, but the kernel's objects this packet touches differ from the plan's"
        } else {
            "NO: the kernel's fate differs from the plan's"
        }
    );
    for (n, d) in k.differs.iter().enumerate() {
        println!("{} {d}", if n == 0 { "differs:   " } else { "           " });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capabilities_are_read_from_the_status() {
        let status =
            |eff: &str| format!("Name:\tkproxy\nCapInh:\t0000000000000000\nCapEff:\t{eff}\n");
        assert_eq!(
            has_capability(&status("000001ffffffffff"), CAP_NET_ADMIN),
            Some(true)
        );
        assert_eq!(
            has_capability(&status("0000000000001000"), CAP_NET_ADMIN),
            Some(true)
        );
        assert_eq!(
            has_capability(&status("0000000000000000"), CAP_NET_ADMIN),
            Some(false)
        );
        assert_eq!(
            has_capability(&status("00000000a80425fb"), CAP_NET_ADMIN),
            Some(false)
        );
        assert_eq!(has_capability("Name:\tx\n", CAP_NET_ADMIN), None);
    }
}
