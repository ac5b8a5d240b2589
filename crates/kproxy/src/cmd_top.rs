//! `kproxy top`: per-Service rates on this node from the kernel's traffic counters
//! (crates/nft/src/counters.rs), read directly over netlink (no daemon needed):
//! new connections/s, rejects/s, drops/s, terminating-fallback/s per Service port,
//! refreshed like `top`, sorted by a column; `-o json` prints one measurement for
//! scripts. The rates are the difference of two readings `--interval` apart.
#![expect(
    clippy::disallowed_types,
    reason = "a blocking command timing its own readings by the wall clock (no tokio)"
)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::IsTerminal as _;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::traffic::{PortCounts, PortKey, per_port, samples};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Seconds between readings (the rates' window).
    #[arg(long, value_name = "SECONDS", default_value_t = 2.0)]
    pub interval: f64,
    /// The column to sort by, highest first (`name`: by namespace/name).
    #[arg(long, value_enum, default_value = "new")]
    pub sort: SortBy,
    /// Show at most this many Service ports.
    #[arg(long, value_name = "N", default_value_t = 40)]
    pub limit: usize,
    /// Stop after this many refreshes (default: until interrupted; `-o json`: one).
    #[arg(long, value_name = "N")]
    pub iterations: Option<u64>,
    /// `table`: refreshed like top; `json`: one measurement (all ports), for scripts.
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    pub output: TopOutput,
    #[command(flatten)]
    pub nft: crate::common::NftTableFlag,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SortBy {
    New,
    Rejects,
    Drops,
    Fallback,
    Name,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TopOutput {
    Table,
    Json,
}

/// One Service port's rates (per second) over a window, and its totals.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Rates {
    #[serde(flatten)]
    pub port: PortKey,
    pub new_per_second: f64,
    pub rejects_per_second: f64,
    /// No-local and source-range drops together.
    pub drops_per_second: f64,
    pub fallback_per_second: f64,
    pub new_total: u64,
    pub rejects_total: u64,
    pub drops_total: u64,
    pub fallback_total: u64,
}

/// The rates between two readings `secs` apart, sorted by `by` (then by name). A
/// counter lower in the second reading (restored after a loss) counts from 0.
pub fn rates(
    before: &BTreeMap<PortKey, PortCounts>,
    after: &BTreeMap<PortKey, PortCounts>,
    secs: f64,
    by: SortBy,
) -> Vec<Rates> {
    let secs = secs.max(1e-3);
    let empty = PortCounts::default();
    let drops = |c: &PortCounts| c.no_local.packets + c.source_range.packets;
    let mut out: Vec<Rates> = after
        .iter()
        .map(|(k, a)| {
            let b = before.get(k).unwrap_or(&empty);
            let rate = |x: u64, y: u64| x.saturating_sub(y) as f64 / secs;
            Rates {
                port: k.clone(),
                new_per_second: rate(a.new.packets, b.new.packets),
                rejects_per_second: rate(a.rejected.packets, b.rejected.packets),
                drops_per_second: rate(drops(a), drops(b)),
                fallback_per_second: rate(a.fallback.packets, b.fallback.packets),
                new_total: a.new.packets,
                rejects_total: a.rejected.packets,
                drops_total: drops(a),
                fallback_total: a.fallback.packets,
            }
        })
        .collect();
    let key = |r: &Rates| match by {
        SortBy::New => r.new_per_second,
        SortBy::Rejects => r.rejects_per_second,
        SortBy::Drops => r.drops_per_second,
        SortBy::Fallback => r.fallback_per_second,
        SortBy::Name => 0.0,
    };
    // Stable: equal keys stay in name order.
    out.sort_by(|a, b| key(b).total_cmp(&key(a)));
    out
}

/// The screen: a header with the node's totals, then one line per Service port.
pub fn screen(rates: &[Rates], limit: usize, window: f64, by: SortBy) -> String {
    let sum = |f: fn(&Rates) -> f64| rates.iter().map(f).sum::<f64>();
    // The flag's own spelling (`--sort drops`), not the Rust variant's.
    let by = clap::ValueEnum::to_possible_value(&by)
        .map_or_else(String::new, |v| v.get_name().to_owned());
    let mut out = format!(
        "kproxy top - {} Service ports, window {window:.1}s, sorted by {by}: {:.1} new/s, {:.1} rejects/s, {:.1} drops/s, {:.1} fallback/s\n\n",
        rates.len(),
        sum(|r| r.new_per_second),
        sum(|r| r.rejects_per_second),
        sum(|r| r.drops_per_second),
        sum(|r| r.fallback_per_second),
    );
    let _ = writeln!(
        out,
        "{:<40} {:<16} {:>9} {:>9} {:>9} {:>9} {:>10}",
        "SERVICE", "PORT", "NEW/S", "REJECT/S", "DROP/S", "FALLBK/S", "NEW TOTAL"
    );
    for r in rates.iter().take(limit) {
        let svc = format!("{}/{}", r.port.namespace, r.port.service);
        let port = format!("{}/{}", r.port.port, r.port.protocol);
        let _ = writeln!(
            out,
            "{svc:<40} {port:<16} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>10}",
            r.new_per_second,
            r.rejects_per_second,
            r.drops_per_second,
            r.fallback_per_second,
            r.new_total
        );
    }
    if rates.len() > limit {
        let _ = writeln!(out, "… {} more (--limit)", rates.len() - limit);
    }
    out
}

fn read(table: &str) -> Result<BTreeMap<PortKey, PortCounts>> {
    let counters = kproxy_nft::read_counters(table).with_context(|| {
        format!("reading the traffic counters of the {table} tables (needs CAP_NET_ADMIN on the node: run it there, or in kproxy's pod)")
    })?;
    Ok(per_port(&samples(&counters)))
}

pub fn run(args: Args) -> Result<ExitCode> {
    if crate::cluster::invoked_as_kubectl_plugin() {
        // The workstation's kernel holds no node's counters: say how to reach one.
        anyhow::bail!(
            "kproxy top reads the counters of the kernel it runs on: run it in kproxy's pod on the node, e.g. kubectl -n kube-system exec -it \"$(kubectl -n kube-system get pod -l app.kubernetes.io/name=kproxy --field-selector spec.nodeName=NODE -o name)\" -- kproxy top"
        );
    }
    anyhow::ensure!(
        args.interval.is_finite() && args.interval > 0.0,
        "--interval must be a positive number of seconds, got {}",
        args.interval
    );
    let interval = Duration::from_secs_f64(args.interval);
    let iterations = match args.output {
        TopOutput::Json => 1,
        TopOutput::Table => args.iterations.unwrap_or(u64::MAX),
    };
    let clear = args.output == TopOutput::Table && std::io::stdout().is_terminal();
    let mut before = read(&args.nft.nft_table)?;
    let mut at = Instant::now();
    for _ in 0..iterations {
        std::thread::sleep(interval);
        let after = read(&args.nft.nft_table)?;
        let now = Instant::now();
        let window = now.duration_since(at).as_secs_f64();
        let r = rates(&before, &after, window, args.sort);
        match args.output {
            TopOutput::Json => println!(
                "{}",
                serde_json::to_string_pretty(&serde_json::json!({
                    "windowSeconds": window,
                    "servicePorts": r,
                }))?
            ),
            TopOutput::Table => {
                if clear {
                    // Home and clear, as top redraws.
                    print!("\x1b[H\x1b[2J");
                }
                print!("{}", screen(&r, args.limit, window, args.sort));
            }
        }
        (before, at) = (after, now);
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::traffic::Count;

    fn port(name: &str) -> PortKey {
        PortKey {
            namespace: "shop".into(),
            service: name.into(),
            port: "http".into(),
            protocol: "TCP".into(),
        }
    }

    fn counts(new: u64, rejected: u64, no_local: u64) -> PortCounts {
        let c = |packets| Count {
            packets,
            since: Some(0),
        };
        PortCounts {
            new: c(new),
            rejected: c(rejected),
            no_local: c(no_local),
            ..PortCounts::default()
        }
    }

    #[test]
    fn rates_are_differences_over_the_window_sorted_by_the_column() {
        let before = BTreeMap::from([(port("a"), counts(10, 0, 0)), (port("b"), counts(0, 5, 0))]);
        let after = BTreeMap::from([
            (port("a"), counts(30, 0, 4)),
            (port("b"), counts(2, 45, 0)),
            (port("c"), counts(8, 0, 0)),
        ]);
        let r = rates(&before, &after, 2.0, SortBy::New);
        let order: Vec<&str> = r.iter().map(|r| r.port.service.as_str()).collect();
        assert_eq!(order, ["a", "c", "b"]);
        assert_eq!(
            (r[0].new_per_second, r[0].drops_per_second, r[0].new_total),
            (10.0, 2.0, 30)
        );
        let r = rates(&before, &after, 2.0, SortBy::Rejects);
        assert_eq!(r[0].port.service, "b");
        assert_eq!(r[0].rejects_per_second, 20.0);
        // A counter restored lower than before counts from 0, never negative.
        let r = rates(&after, &before, 2.0, SortBy::Name);
        assert!(r.iter().all(|r| r.new_per_second >= 0.0));
        let s = screen(
            &rates(&before, &after, 2.0, SortBy::New),
            2,
            2.0,
            SortBy::New,
        );
        assert!(s.starts_with("kproxy top - 3 Service ports, window 2.0s, sorted by new: 15.0 new/s, 20.0 rejects/s, 2.0 drops/s, 0.0 fallback/s\n"), "{s}");
        assert!(s.contains("shop/a"), "{s}");
        assert!(s.ends_with("… 1 more (--limit)\n"), "{s}");
    }
}
