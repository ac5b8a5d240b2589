//! The kernel's traffic counters (crates/nft/src/counters.rs) as Prometheus families:
//! `kproxy_service_*_total` per Service port (and per endpoint at
//! `--traffic-metrics=endpoint`), with `_created` from the counters' own `since`, so a
//! counter the kernel lost and kproxy restored shows as the reset it is. The kernel is
//! read by a background task every [`REFRESH`] and the text rendered then: a scrape
//! only copies it (at 10k Services the reading is ≈ 140k objects; BENCHMARKS.md).
//! Labels come from the counters' names, so no plan is needed (`kproxy top` reads the
//! same names).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kproxy_nft::{CounterKind, KernelCounter, UNALLOCATED_CLUSTER_IPS, parse_counter_name};

/// How often the daemon reads the counters for `/metrics`.
pub const REFRESH: Duration = Duration::from_secs(10);

/// Which traffic counters exist and how finely they are exported.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Level {
    /// No counters in the kernel, no families.
    Off,
    /// Counters in the kernel; families per Service port (the default: one series per
    /// port and verdict, bounded by the Services, not by the pods).
    Service,
    /// Also `kproxy_service_new_connections_total` per endpoint (a series per pod:
    /// opt in).
    Endpoint,
}

/// The families, in the order exported: (family, help, kind of counter).
const FAMILIES: [(&str, &str); 5] = [
    (
        "kproxy_service_new_connections",
        "New connections this node DNATed to the Service port's endpoints (cluster IP, NodePort, external and LB IPs together), counted in the kernel; per endpoint with --traffic-metrics=endpoint",
    ),
    (
        "kproxy_service_rejected",
        "New connections this node rejected because the Service port has no endpoint (each retransmitted SYN or datagram of an unanswered attempt counts)",
    ),
    (
        "kproxy_service_no_local_endpoint_drops",
        "New connections this node dropped because endpoints exist but none this traffic may use is here (externalTrafficPolicy/internalTrafficPolicy Local)",
    ),
    (
        "kproxy_service_source_range_drops",
        "New connections to a LoadBalancer IP this node dropped by loadBalancerSourceRanges",
    ),
    (
        "kproxy_service_terminating_fallback",
        "New connections this node sent to a terminating endpoint because no ready one qualified (the serving+terminating fallback)",
    ),
];

fn family_of(kind: &CounterKind) -> usize {
    match kind {
        CounterKind::New | CounterKind::Endpoint(_) => 0,
        CounterKind::Rejected => 1,
        CounterKind::NoLocal => 2,
        CounterKind::SourceRange => 3,
        CounterKind::Fallback => 4,
    }
}

/// The exported traffic families, as last rendered.
#[derive(Debug)]
pub struct Traffic {
    pub level: Level,
    max_series: usize,
    text: Mutex<Arc<String>>,
    /// Series left out by the cap at the last rendering.
    capped: AtomicU64,
}

impl Traffic {
    pub fn new(level: Level, max_series: usize) -> Arc<Traffic> {
        Arc::new(Traffic {
            level,
            max_series,
            text: Mutex::new(Arc::new(String::new())),
            capped: AtomicU64::new(0),
        })
    }

    /// Renders a reading of the counters for the next scrapes (`read`: how long the
    /// reading took, exported beside them).
    pub fn update(&self, counters: &[KernelCounter], read: Duration) {
        let (mut text, capped) = render(counters, self.level, self.max_series);
        let name = "kproxy_traffic_counters_read_seconds";
        let _ = writeln!(
            text,
            "# HELP {name} How long the last reading of the kernel's traffic counters took (each counter object asked for by name over netlink, every 10 s).\n# TYPE {name} gauge\n{name} {}",
            read.as_secs_f64()
        );
        let before = self.capped.swap(capped as u64, Ordering::Relaxed);
        if capped > 0 && capped as u64 != before {
            tracing::warn!(
                capped,
                max_series = self.max_series,
                "traffic metrics: more series than --traffic-metrics-max-series; the rest are left out (kproxy_traffic_metrics_capped_series)"
            );
        }
        *self.text.lock().unwrap_or_else(|e| e.into_inner()) = Arc::new(text);
    }

    /// The families' OpenMetrics text (without `# EOF`).
    pub fn text(&self) -> Arc<String> {
        self.text.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// A series: family index, then its labels.
type SeriesKey = (usize, String, String, String, String, Option<String>);

/// The families' text for `counters` at `level`, at most `max_series` Service series
/// (sorted; the rest left out and counted), and how many were left out. Both IP
/// families of a Service port are one series (their sum; `_created` the later
/// `since`). The verdict families hold only the ports that counted something (so a
/// 10k-Service node exports one series per port, not five); new connections hold every
/// port.
pub fn render(counters: &[KernelCounter], level: Level, max_series: usize) -> (String, usize) {
    let mut series: BTreeMap<SeriesKey, (u64, Option<u64>)> = BTreeMap::new();
    let mut unallocated: (u64, Option<u64>) = (0, None);
    for c in counters {
        if c.name == UNALLOCATED_CLUSTER_IPS {
            unallocated.0 += c.packets;
            unallocated.1 = unallocated.1.max(c.since);
            continue;
        }
        let Some(p) = parse_counter_name(&c.name) else {
            continue;
        };
        let endpoint = match (p.kind, level) {
            (CounterKind::Endpoint(ep), Level::Endpoint) => Some(ep.to_string()),
            (CounterKind::Endpoint(_), _) => continue,
            (CounterKind::New, Level::Endpoint) => continue,
            _ => None,
        };
        let fam = family_of(&p.kind);
        if fam > 0 && c.packets == 0 {
            continue;
        }
        let key = (
            fam,
            p.namespace,
            p.service,
            p.port,
            p.protocol.to_uppercase(),
            endpoint,
        );
        let e = series.entry(key).or_default();
        e.0 += c.packets;
        e.1 = e.1.max(c.since);
    }
    let capped = series.len().saturating_sub(max_series);
    let mut out = String::with_capacity(series.len() * 220 + 2048);
    let mut kept = series.into_iter().take(max_series).peekable();
    for (i, (name, help)) in FAMILIES.iter().enumerate() {
        let _ = writeln!(out, "# HELP {name} {help}.");
        let _ = writeln!(out, "# TYPE {name} counter");
        while let Some(((_, ns, svc, port, proto, ep), (v, since))) =
            kept.next_if(|(k, _)| k.0 == i)
        {
            let mut labels = String::with_capacity(96);
            let _ = write!(
                labels,
                "namespace=\"{ns}\",service=\"{svc}\",port=\"{port}\",protocol=\"{proto}\""
            );
            if let Some(ep) = ep {
                let _ = write!(labels, ",endpoint=\"{ep}\"");
            }
            let _ = writeln!(out, "{name}_total{{{labels}}} {v}");
            if let Some(s) = since {
                let _ = writeln!(out, "{name}_created{{{labels}}} {s}");
            }
        }
    }
    let name = "kproxy_unallocated_cluster_ip_drops";
    let _ = writeln!(
        out,
        "# HELP {name} New connections to an address of a service CIDR that no Service holds, dropped by this node."
    );
    let _ = writeln!(out, "# TYPE {name} counter");
    let _ = writeln!(out, "{name}_total {}", unallocated.0);
    if let Some(s) = unallocated.1 {
        let _ = writeln!(out, "{name}_created {s}");
    }
    let name = "kproxy_traffic_metrics_capped_series";
    let _ = writeln!(
        out,
        "# HELP {name} Traffic series left out at the last reading because there were more than --traffic-metrics-max-series."
    );
    let _ = writeln!(out, "# TYPE {name} gauge");
    let _ = writeln!(out, "{name} {capped}");
    (out, capped)
}

/// A Service port as the counters name it (both IP families together).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub struct PortKey {
    pub namespace: String,
    pub service: String,
    pub port: String,
    pub protocol: String,
}

/// A Service port's counts (new connections summed over both IP families), each with
/// since when it counts (the latest `since` of its parts).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PortCounts {
    pub new: Count,
    pub rejected: Count,
    pub no_local: Count,
    pub source_range: Count,
    pub fallback: Count,
    /// Per endpoint (`ip:port`).
    pub endpoints: BTreeMap<String, Count>,
}

/// One count and since when (Unix seconds).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Count {
    pub packets: u64,
    pub since: Option<u64>,
}

impl Count {
    fn add(&mut self, packets: u64, since: Option<u64>) {
        self.packets += packets;
        self.since = self.since.max(since);
    }
}

/// One count of a Service port, from the kernel's counters or a daemon's `/metrics`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sample {
    pub port: PortKey,
    pub kind: CounterKind,
    pub packets: u64,
    pub since: Option<u64>,
}

/// The kernel's counters as samples (counters kproxy does not name are left out).
pub fn samples(counters: &[KernelCounter]) -> Vec<Sample> {
    counters
        .iter()
        .filter_map(|c| {
            let p = parse_counter_name(&c.name)?;
            Some(Sample {
                port: PortKey {
                    namespace: p.namespace,
                    service: p.service,
                    port: p.port,
                    protocol: p.protocol.to_uppercase(),
                },
                kind: p.kind,
                packets: c.packets,
                since: c.since,
            })
        })
        .collect()
}

/// A daemon's `/metrics` text as samples: the `kproxy_service_*_total` series with
/// their `_created` (what [`render`] writes).
pub fn samples_from_metrics(text: &str) -> Vec<Sample> {
    use crate::exposition::{label, samples};
    // Each `_created` by the family and labels of its `_total` series.
    let mut created: BTreeMap<(&str, &str), u64> = BTreeMap::new();
    for (name, labels, v) in samples(text) {
        if let Some(family) = name
            .strip_prefix("kproxy_service_")
            .and_then(|f| f.strip_suffix("_created"))
        {
            created.insert((family, labels), v as u64);
        }
    }
    let mut out = Vec::new();
    for (name, labels, v) in samples(text) {
        let Some(family) = name
            .strip_prefix("kproxy_service_")
            .and_then(|f| f.strip_suffix("_total"))
        else {
            continue;
        };
        // A packet count: a whole number, never negative.
        if v < 0.0 || v.fract() != 0.0 {
            continue;
        }
        let label = |key: &str| label(labels, key).map(str::to_string);
        let kind = match (family, label("endpoint")) {
            ("new_connections", None) => CounterKind::New,
            ("new_connections", Some(ep)) => {
                let Ok(sa) = ep.parse::<std::net::SocketAddr>() else {
                    continue;
                };
                CounterKind::Endpoint(kproxy_core::model::EndpointAddr::new(sa.ip(), sa.port()))
            }
            ("rejected", _) => CounterKind::Rejected,
            ("no_local_endpoint_drops", _) => CounterKind::NoLocal,
            ("source_range_drops", _) => CounterKind::SourceRange,
            ("terminating_fallback", _) => CounterKind::Fallback,
            _ => continue,
        };
        let (Some(namespace), Some(service), Some(port), Some(protocol)) = (
            label("namespace"),
            label("service"),
            label("port"),
            label("protocol"),
        ) else {
            continue;
        };
        out.push(Sample {
            port: PortKey {
                namespace,
                service,
                port,
                protocol,
            },
            kind,
            packets: v as u64,
            since: created.get(&(family, labels)).copied(),
        });
    }
    out
}

/// The samples per Service port (the one aggregation of `kproxy top` and `kproxy
/// explain`). Without endpoint samples (`--traffic-metrics=service`), a port's new
/// connections are its own counter's; with them only, their sum.
pub fn per_port(samples: &[Sample]) -> BTreeMap<PortKey, PortCounts> {
    let mut out: BTreeMap<PortKey, PortCounts> = BTreeMap::new();
    let mut own_new: std::collections::BTreeSet<&PortKey> = Default::default();
    for s in samples {
        let e = out.entry(s.port.clone()).or_default();
        match s.kind {
            CounterKind::New => {
                own_new.insert(&s.port);
                e.new.add(s.packets, s.since);
            }
            CounterKind::Rejected => e.rejected.add(s.packets, s.since),
            CounterKind::NoLocal => e.no_local.add(s.packets, s.since),
            CounterKind::SourceRange => e.source_range.add(s.packets, s.since),
            CounterKind::Fallback => e.fallback.add(s.packets, s.since),
            CounterKind::Endpoint(ep) => e
                .endpoints
                .entry(ep.to_string())
                .or_default()
                .add(s.packets, s.since),
        }
    }
    for (k, c) in out.iter_mut() {
        if !own_new.contains(k) {
            for n in c.endpoints.values() {
                c.new.add(n.packets, n.since);
            }
        }
    }
    out
}

/// A Unix time as RFC 3339 UTC (`2026-11-28T18:00:00Z`), by the health crate's one
/// formatter.
pub fn rfc3339(secs: u64) -> String {
    kproxy_health::decide::rfc3339(std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs))
}

/// The Service's counters on this node, as `kproxy explain` prints them beside the plan.
pub fn explain_lines(samples: &[Sample], namespace: &str, service: &str) -> String {
    let since = |c: &Count| c.since.map_or_else(|| "unknown".to_string(), rfc3339);
    let mut out = String::new();
    for (k, c) in per_port(samples)
        .iter()
        .filter(|(k, _)| k.namespace == namespace && k.service == service)
    {
        let port = if k.port.is_empty() {
            "(unnamed)"
        } else {
            &k.port
        };
        let _ = writeln!(
            out,
            "  port {port}/{}: {} new connections DNATed (since {}); {} rejected (no endpoints), {} dropped (no local endpoint), {} dropped (source ranges), {} sent to terminating endpoints (fallback)",
            k.protocol,
            c.new.packets,
            since(&c.new),
            c.rejected.packets,
            c.no_local.packets,
            c.source_range.packets,
            c.fallback.packets,
        );
        for (ep, n) in &c.endpoints {
            let _ = writeln!(out, "    endpoint {ep}: {} (since {})", n.packets, since(n));
        }
    }
    out
}

/// One reading of the counters, and how long it took.
#[expect(
    clippy::disallowed_types,
    reason = "a blocking thread's netlink dump, timed by the wall clock"
)]
fn timed_read(
    r: &kproxy_nft::CounterReader,
) -> Result<(Vec<KernelCounter>, Duration), kproxy_nft::NftError> {
    let t = std::time::Instant::now();
    r.read().map(|c| (c, t.elapsed()))
}

/// Reads the counters every [`REFRESH`] (on a blocking thread: a netlink dump) into
/// `traffic`, until `stop`.
pub async fn run(
    reader: kproxy_nft::CounterReader,
    traffic: Arc<Traffic>,
    stop: tokio_util::sync::CancellationToken,
) {
    loop {
        let r = reader.clone();
        let read = tokio::task::spawn_blocking(move || timed_read(&r));
        match read.await {
            Ok(Ok((counters, took))) => traffic.update(&counters, took),
            Ok(Err(e)) => tracing::warn!(error = %e, "cannot read the traffic counters"),
            Err(e) => tracing::warn!(error = %e, "the traffic counters' reading failed"),
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(REFRESH) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kproxy_nft::Family;

    fn c(name: &str, packets: u64, since: u64) -> KernelCounter {
        KernelCounter {
            family: Family::Ip,
            name: name.into(),
            packets,
            bytes: packets * 60,
            since: Some(since),
        }
    }

    #[test]
    fn families_labels_created_and_the_cap() {
        let id = "0a1b2c3d-shop/web/tcp/http";
        let mut counters = vec![
            c(&format!("new-{id}"), 7, 100),
            c(&format!("endpoint-{id}/10.244.1.5/8080"), 4, 100),
            c(&format!("endpoint-{id}/10.244.1.6/8080"), 3, 120),
            c(&format!("rejected-{id}"), 2, 100),
            c(&format!("no-local-{id}"), 0, 100),
            c(UNALLOCATED_CLUSTER_IPS, 5, 90),
            c("someone-elses", 9, 1),
        ];
        // The IPv6 table's port of the same name adds up.
        counters.push(KernelCounter {
            family: Family::Ip6,
            ..c(&format!("new-{id}"), 1, 130)
        });
        let (text, capped) = render(&counters, Level::Service, 100);
        assert_eq!(capped, 0);
        let labels = r#"{namespace="shop",service="web",port="http",protocol="TCP"}"#;
        for line in [
            format!("kproxy_service_new_connections_total{labels} 8"),
            format!("kproxy_service_new_connections_created{labels} 130"),
            format!("kproxy_service_rejected_total{labels} 2"),
            "# TYPE kproxy_service_no_local_endpoint_drops counter".to_string(),
            "kproxy_unallocated_cluster_ip_drops_total 5".to_string(),
            "kproxy_traffic_metrics_capped_series 0".to_string(),
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
        assert!(
            !text.contains("no_local_endpoint_drops_total"),
            "zeros left out:\n{text}"
        );
        assert!(!text.contains("endpoint=\""), "{text}");

        let (text, _) = render(&counters, Level::Endpoint, 100);
        let ep = r#"{namespace="shop",service="web",port="http",protocol="TCP",endpoint="10.244.1.6:8080"}"#;
        assert!(
            text.lines()
                .any(|l| l == format!("kproxy_service_new_connections_total{ep} 3")),
            "{text}"
        );
        assert!(!text.contains(&format!("kproxy_service_new_connections_total{labels}")));

        let (text, capped) = render(&counters, Level::Endpoint, 1);
        assert_eq!(capped, 2, "{text}");
        assert!(text.contains("kproxy_traffic_metrics_capped_series 2"));
    }

    #[test]
    fn per_port_adds_families_and_explain_says_since_when() {
        let id = "0a1b2c3d-shop/web/tcp/http";
        let counters = vec![
            c(&format!("new-{id}"), 7, 0),
            KernelCounter {
                family: Family::Ip6,
                ..c(&format!("new-{id}"), 1, 86_400)
            },
            c(&format!("rejected-{id}"), 2, 0),
            c(&format!("endpoint-{id}/10.244.1.5/8080"), 7, 0),
            c("new-0a1b2c3d-shop/other/tcp/http", 1, 0),
        ];
        let samples = samples(&counters);
        assert_eq!(per_port(&samples).len(), 2);
        let explained = explain_lines(&samples, "shop", "web");
        assert_eq!(
            explained,
            "  port http/TCP: 8 new connections DNATed (since 1970-01-02T00:00:00Z); 2 rejected (no endpoints), 0 dropped (no local endpoint), 0 dropped (source ranges), 0 sent to terminating endpoints (fallback)\n    endpoint 10.244.1.5:8080: 7 (since 1970-01-01T00:00:00Z)\n"
        );
        assert_eq!(rfc3339(1_764_352_800), "2025-11-28T18:00:00Z");
        // Through a daemon's /metrics (endpoint level): the same explanation.
        let (text, _) = render(&counters, Level::Endpoint, 100);
        let from_metrics = samples_from_metrics(&text);
        assert_eq!(
            explain_lines(&from_metrics, "shop", "web"),
            explained.replace(
                "8 new connections DNATed (since 1970-01-02T00:00:00Z)",
                "7 new connections DNATed (since 1970-01-01T00:00:00Z)"
            )
        );
        let (text, _) = render(&counters, Level::Service, 100);
        assert!(
            explain_lines(&samples_from_metrics(&text), "shop", "web").starts_with(
                "  port http/TCP: 8 new connections DNATed (since 1970-01-02T00:00:00Z); 2 rejected"
            )
        );
    }
}
