//! Taking a node over from kube-proxy (docs/migrate.md), the shell around
//! [`kproxy_core::takeover`]: reads what of kube-proxy's is on the node (its nftables
//! tables over nfnetlink, `iptables-save` of both backends and families, `kube-ipvs0`, ipsets, IPVS),
//! tells whether a kube-proxy still runs, and runs the removal plan — only after
//! kproxy's own tables are up (its first sync succeeded and both tables are in the
//! kernel), so no connection meets a node without Service rules.
//!
//! Every step is one atomic transaction (a table delete, one `*-restore` per iptables
//! table, one command per IPVS object) and the plan is computed again from the kernel
//! each round: a kproxy killed halfway finds the rest on its next start and finishes.

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kproxy_core::model::IpFamily;
use kproxy_core::takeover::{
    self, Decision, Inventory, Liveness, RemovalPlan, Step, TakeoverMode, XtBackend,
};
use kproxy_health::Health;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;

/// How often kproxy looks again while kube-proxy's rules are on the node.
const RECHECK: Duration = Duration::from_secs(2);

/// How often kproxy looks again once none are (a kube-proxy started again, a
/// configuration tool restoring its rules): `kproxy_kube_proxy_rules_present` stays true.
const WATCH_AFTER: Duration = Duration::from_secs(10);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeLabel {
    pub mode: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: &'static str,
}

/// The takeover's metrics (docs/migrate.md).
#[derive(Clone, Default)]
pub struct TakeoverMetrics {
    /// 1 while rules of kube-proxy's `mode` are on the node.
    pub rules_present: Family<ModeLabel, Gauge>,
    /// 1 while kproxy leaves them because a kube-proxy runs.
    pub waiting: Gauge,
    /// Removal steps run, by result.
    pub removals: Family<ResultLabel, Counter>,
}

impl TakeoverMetrics {
    pub fn register(registry: &mut Registry) -> TakeoverMetrics {
        let m = TakeoverMetrics::default();
        registry.register(
            "kproxy_kube_proxy_rules_present",
            "1 while rules of upstream kube-proxy's mode (nftables, iptables, ipvs) are on this node",
            m.rules_present.clone(),
        );
        registry.register(
            "kproxy_kube_proxy_takeover_waiting",
            "1 while kproxy leaves kube-proxy's rules in place because a kube-proxy still runs on this node",
            m.waiting.clone(),
        );
        registry.register(
            "kproxy_kube_proxy_removals",
            "Steps of the removal of kube-proxy's rules, by result (ok, failed)",
            m.removals.clone(),
        );
        m
    }

    fn show(&self, plan: &RemovalPlan) {
        let f = plan.found;
        for (mode, on) in [
            ("nftables", f.nftables),
            ("iptables", f.iptables),
            ("ipvs", f.ipvs),
        ] {
            self.rules_present
                .get_or_create(&ModeLabel { mode })
                .set(i64::from(on));
        }
    }
}

/// What the takeover task needs.
pub struct Takeover {
    pub mode: TakeoverMode,
    /// kproxy's table name: both families must be in the kernel before anything goes.
    pub table: String,
    /// Whether kproxy was asked for a healthz address (then failing to bind it means
    /// another process holds it).
    pub healthz_configured: bool,
    pub health: Health,
    pub metrics: Arc<Metrics>,
    pub own: TakeoverMetrics,
}

/// Runs until stopped (with `off`, until it has reported once): removes kube-proxy's
/// rules when the mode and liveness allow, then keeps looking every [`WATCH_AFTER`], so
/// rules that come back are reported (the gauge, a warning) and removed again once no
/// kube-proxy runs.
pub async fn run(t: Takeover, stop: CancellationToken) {
    // kproxy's tables first: its first sync must have reached the kernel.
    loop {
        if t.metrics.last_sync_timestamp.get() > 0.0 && own_tables_present(&t.table) {
            break;
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
    let mut said_waiting = String::new();
    // Nothing of kube-proxy's was on the node at the last look.
    let mut clear = false;
    loop {
        let live = Liveness {
            processes: kube_proxy_processes(),
            healthz_port_held: t.healthz_configured
                && (t.health.healthz_addrs().is_empty() || t.health.healthz_in_use()),
        };
        // While a kube-proxy already reported still runs, only its liveness is looked
        // at: reading a large node's iptables every round would cost more than the
        // stale rules do.
        if t.mode == TakeoverMode::Auto && live.live() && said_waiting == live.reason() {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(RECHECK) => continue,
            }
        }
        let inv = tokio::task::spawn_blocking(inventory)
            .await
            .unwrap_or_default();
        let plan = takeover::removal_plan(&inv);
        t.own.show(&plan);
        let decision = takeover::decide(t.mode, &plan, &live);
        if clear && decision != Decision::Nothing {
            tracing::warn!(
                modes = ?plan.found.modes(),
                steps = ?plan.steps.iter().map(Step::describe).collect::<Vec<_>>(),
                "kube-proxy's rules came back on this node after they were removed (a kube-proxy started again?)"
            );
        }
        clear = decision == Decision::Nothing;
        match decision {
            Decision::Nothing => {
                t.own.waiting.set(0);
                if said_waiting != "clear" {
                    tracing::info!(
                        "no rules of kube-proxy on this node (any more); looking again every {WATCH_AFTER:?}"
                    );
                    said_waiting = "clear".into();
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(WATCH_AFTER) => continue,
                }
            }
            Decision::LeaveToOperator => {
                tracing::warn!(
                    modes = ?plan.found.modes(),
                    steps = ?plan.steps.iter().map(Step::describe).collect::<Vec<_>>(),
                    "kube-proxy's rules are on this node; --kube-proxy-takeover=off leaves them (kproxy's rules decide first; remove them with `kube-proxy --cleanup`)"
                );
                return;
            }
            Decision::WaitForKubeProxy { why } => {
                t.own.waiting.set(1);
                if said_waiting != why {
                    tracing::error!(
                        modes = ?plan.found.modes(),
                        %why,
                        "kube-proxy still runs on this node: its rules stay until it stops (kproxy's rules decide first meanwhile); stop kube-proxy, or start kproxy with --kube-proxy-takeover=force"
                    );
                    said_waiting = why;
                }
            }
            Decision::Remove => {
                t.own.waiting.set(0);
                tracing::info!(
                    modes = ?plan.found.modes(),
                    forced = live.live(),
                    "kproxy's tables are up; removing kube-proxy's rules"
                );
                let own = t.own.clone();
                let plan2 = plan.clone();
                let done = tokio::task::spawn_blocking(move || execute(&plan2, &own)).await;
                if done.unwrap_or(false) {
                    // Look again at once: the next round sees an empty node and says so.
                    continue;
                }
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(RECHECK) => {}
        }
    }
}

/// Runs every step; a failed step is logged and counted, the next round tries again.
/// Whether every step succeeded.
fn execute(plan: &RemovalPlan, m: &TakeoverMetrics) -> bool {
    let mut all = true;
    for step in &plan.steps {
        let what = step.describe();
        match run_step(step) {
            Ok(()) => {
                m.removals
                    .get_or_create(&ResultLabel { result: "ok" })
                    .inc();
                tracing::info!(removed = %what, "removed kube-proxy's");
            }
            Err(e) => {
                m.removals
                    .get_or_create(&ResultLabel { result: "failed" })
                    .inc();
                tracing::warn!(step = %what, error = format!("{e:#}"), "cannot remove kube-proxy's; retrying");
                all = false;
            }
        }
    }
    all
}

fn run_step(step: &Step) -> Result<()> {
    match step {
        Step::DeleteNftTable { family } => {
            kproxy_nft::delete_tables(&[(kproxy_nft::Family::of(*family), takeover::NFT_TABLE)])
                .map_err(anyhow::Error::from)
        }
        Step::XtRestore {
            backend,
            family,
            script,
            ..
        } => command_with_input(
            backend.restore_command(*family),
            &["--noflush", "-w", "5"],
            script,
        ),
        Step::IpvsFlush => command_with_input("ipvsadm", &["--clear"], ""),
        Step::DeleteLink { name } => command_with_input("ip", &["link", "delete", name], ""),
        Step::DestroyIpset { name } => command_with_input("ipset", &["destroy", name], ""),
    }
}

fn command_with_input(cmd: &str, args: &[&str], input: &str) -> Result<()> {
    let mut child = Command::new(cmd)
        .args(args)
        .env("LC_ALL", "C")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {cmd}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(input.as_bytes())
            .with_context(|| format!("writing to {cmd}"))?;
    }
    let out = child
        .wait_with_output()
        .with_context(|| format!("waiting for {cmd}"))?;
    if !out.status.success() {
        bail!(
            "{cmd} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// stdout of a command that succeeded; `None` when it is missing or failed.
fn output(cmd: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(cmd)
        .args(args)
        .env("LC_ALL", "C")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The families of the nftables tables kproxy and kube-proxy's nftables mode use.
const NFT_FAMILIES: [kproxy_nft::Family; 2] = [kproxy_nft::Family::Ip, kproxy_nft::Family::Ip6];

fn own_tables_present(table: &str) -> bool {
    let tables = nft_tables();
    NFT_FAMILIES.iter().all(|fam| {
        tables
            .iter()
            .any(|t| t.family == fam.nft() && t.name == table)
    })
}

/// The `ip` and `ip6` tables of this network namespace (kube-proxy's nftables mode
/// uses no other family), read over nfnetlink; a family that cannot be read counts as
/// holding none, as a missing tool does below.
fn nft_tables() -> Vec<takeover::NftTableName> {
    let mut out = Vec::new();
    for family in NFT_FAMILIES {
        match kproxy_nft::table_names(family) {
            Ok(names) => out.extend(names.into_iter().map(|name| takeover::NftTableName {
                family: family.nft().to_string(),
                name,
            })),
            Err(e) => tracing::warn!(%family, error = %e, "cannot list the nftables tables"),
        }
    }
    out
}

/// What of kube-proxy's this network namespace holds. A tool that is missing (no
/// iptables, no ipset) means none of its objects can be there to remove.
pub fn inventory() -> Inventory {
    let mut inv = Inventory {
        nft_tables: nft_tables(),
        ..Default::default()
    };
    for backend in [XtBackend::Nft, XtBackend::Legacy] {
        for family in IpFamily::ALL {
            let save = backend.restore_command(family).replace("-restore", "-save");
            let Some(text) = output(&save, &[]) else {
                continue;
            };
            match takeover::parse_iptables_save(backend, family, &text) {
                Ok(tables) => inv.xt_tables.extend(tables),
                Err(e) => tracing::warn!(command = %save, error = %e, "cannot read iptables-save"),
            }
        }
    }
    if output("ip", &["link", "show", takeover::IPVS_DEVICE]).is_some() {
        inv.links.push(takeover::IPVS_DEVICE.to_string());
    }
    if let Some(sets) = output("ipset", &["list", "-n"]) {
        inv.ipsets = sets.lines().map(str::to_string).collect();
    }
    if let Ok(text) = std::fs::read_to_string("/proc/net/ip_vs") {
        // Virtual servers are the lines starting with the protocol.
        inv.ipvs_virtual_servers = text
            .lines()
            .filter(|l| l.starts_with("TCP") || l.starts_with("UDP") || l.starts_with("SCTP"))
            .count();
    }
    inv
}

/// Pids of processes named `kube-proxy` in this process's network namespace. kproxy in
/// a pod sees them only with `hostPID: true` (deploy/ sets it); without, the healthz
/// port is the other sign ([`Liveness::healthz_port_held`]).
pub fn kube_proxy_processes() -> Vec<u32> {
    let Ok(own) = std::fs::read_link("/proc/self/ns/net") else {
        return Vec::new();
    };
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| c.trim_end() == "kube-proxy")
                && std::fs::read_link(format!("/proc/{pid}/ns/net")).is_ok_and(|n| n == own)
        })
        .collect();
    pids.sort_unstable();
    pids
}
