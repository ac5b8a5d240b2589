//! The daemon's metrics: upstream kube-proxy's names, types and buckets (so existing
//! dashboards and alerts keep working) plus kproxy's own, and the `/metrics` server.
//! Health metrics are registered by kproxy-health into the same registry.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use anyhow::{Context, Result};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// A stage of a change's way to the kernel (see [`kproxy_source::Pending`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabel {
    pub stage: &'static str,
}

/// Fine between 0.5 and 25 ms, where a change's way to the kernel lies when syncs are not
/// batched (`--min-sync-period=0s`), so a 10 ms objective can be read off the buckets;
/// then coarser up to a minute (minSyncPeriod batching, failures and retries).
pub const CHANGE_STAGE_BUCKETS: [f64; 24] = [
    0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.008, 0.010, 0.012, 0.015, 0.020, 0.025,
    0.050, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0,
];

fn change_stage_histogram() -> Histogram {
    Histogram::new(CHANGE_STAGE_BUCKETS)
}

/// What another process changed in kproxy's tables (`kproxy_nft::ChangeKind`), or
/// `unknown` when notifications were lost.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WhatLabel {
    pub what: &'static str,
}

/// A sysctl kproxy set (its `/proc/sys` path, or `/sys/module/…` for the hash table size).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SysctlLabel {
    pub sysctl: String,
}

/// Why an endpoint's warm-up hold ended (`kproxy_core::warmup::ReleaseReason`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NoLocalLabels {
    pub traffic_policy: &'static str,
    /// "IPv4" / "IPv6", upstream's `ip_family` label (one proxier per family).
    pub ip_family: &'static str,
}

pub struct Metrics {
    pub sync_duration: Histogram,
    pub sync_full_duration: Histogram,
    pub sync_partial_duration: Histogram,
    pub last_sync_timestamp: Gauge<f64, AtomicU64>,
    pub last_queued_timestamp: Gauge<f64, AtomicU64>,
    pub network_programming: Histogram,
    pub endpoint_changes_pending: Gauge,
    pub endpoint_changes_total: Counter,
    pub service_changes_pending: Gauge,
    pub service_changes_total: Counter,
    pub no_local_endpoints: Family<NoLocalLabels, Gauge>,
    pub nftables_sync_failures: Counter,
    pub nftables_cleanup_failures: Counter,
    // kproxy's own
    pub drift_repairs: Counter,
    pub conntrack_deleted: Counter,
    pub skipped_objects: Gauge,
    pub frontend_conflicts: Gauge,
    pub cluster_ip_warnings: Gauge,
    pub change_stages: Family<StageLabel, Histogram, fn() -> Histogram>,
    /// From the API answering again after failures to the rules matching it.
    pub api_return_to_converged: Histogram,
    /// Transactions of other processes that changed kproxy's tables, per kind of object.
    pub kernel_interference: Family<WhatLabel, Counter>,
    pub kernel_repairs: Counter,
    pub kernel_repair_backoff: Gauge<f64, AtomicU64>,
    /// Drift the periodic verification found while the kernel watch ran (it missed it).
    pub kernel_watch_missed: Counter,
    pub conntrack_entries: Gauge,
    pub conntrack_max: Gauge,
    /// The kernel's counters since boot, mirrored.
    pub conntrack_insert_failed: Counter,
    pub conntrack_drop: Counter,
    pub conntrack_early_drop: Counter,
    /// 1 while a sysctl kproxy set holds another value.
    pub sysctl_changed: Family<SysctlLabel, Gauge>,
    /// Endpoints held for warm-up ([`crate::warmup`]), and their releases by reason.
    pub endpoint_warmup_holds: Counter,
    pub endpoint_warmup_releases: Family<ReasonLabel, Counter>,
    /// The endpoints held now, served at [`ENDPOINT_WARMUP_PATH`].
    pub endpoint_warmup_held: HeldView,
}

/// Upstream's NetworkProgrammingLatency buckets: 0.25 s, 0.5 s, 1..59 s, 60..115 s by
/// 5, 120..300 s by 30.
fn network_programming_buckets() -> Vec<f64> {
    let mut b = vec![0.25, 0.5];
    b.extend((1..=59).map(f64::from));
    b.extend((0..12).map(|i| 60.0 + 5.0 * f64::from(i)));
    b.extend((0..7).map(|i| 120.0 + 30.0 * f64::from(i)));
    b
}

impl Metrics {
    /// Creates the metrics and registers them in `registry` (upstream ones under the
    /// `kubeproxy` prefix, kproxy's under `kproxy`).
    pub fn register(registry: &mut Registry) -> Arc<Metrics> {
        let sync_buckets = || exponential_buckets(0.001, 2.0, 15);
        let m = Metrics {
            sync_duration: Histogram::new(sync_buckets()),
            sync_full_duration: Histogram::new(sync_buckets()),
            sync_partial_duration: Histogram::new(sync_buckets()),
            last_sync_timestamp: Gauge::default(),
            last_queued_timestamp: Gauge::default(),
            network_programming: Histogram::new(network_programming_buckets()),
            endpoint_changes_pending: Gauge::default(),
            endpoint_changes_total: Counter::default(),
            service_changes_pending: Gauge::default(),
            service_changes_total: Counter::default(),
            no_local_endpoints: Family::default(),
            nftables_sync_failures: Counter::default(),
            nftables_cleanup_failures: Counter::default(),
            drift_repairs: Counter::default(),
            conntrack_deleted: Counter::default(),
            skipped_objects: Gauge::default(),
            frontend_conflicts: Gauge::default(),
            cluster_ip_warnings: Gauge::default(),
            change_stages: Family::new_with_constructor(change_stage_histogram),
            api_return_to_converged: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            kernel_interference: Family::default(),
            kernel_repairs: Counter::default(),
            kernel_repair_backoff: Gauge::default(),
            kernel_watch_missed: Counter::default(),
            conntrack_entries: Gauge::default(),
            conntrack_max: Gauge::default(),
            conntrack_insert_failed: Counter::default(),
            conntrack_drop: Counter::default(),
            conntrack_early_drop: Counter::default(),
            sysctl_changed: Family::default(),
            endpoint_warmup_holds: Counter::default(),
            endpoint_warmup_releases: Family::default(),
            endpoint_warmup_held: Default::default(),
        };
        let r = registry.sub_registry_with_prefix("kubeproxy");
        r.register(
            "sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            m.sync_duration.clone(),
        );
        r.register(
            "sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
            m.sync_full_duration.clone(),
        );
        r.register(
            "sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
            m.sync_partial_duration.clone(),
        );
        r.register(
            "sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            m.last_sync_timestamp.clone(),
        );
        r.register(
            "sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            m.last_queued_timestamp.clone(),
        );
        r.register(
            "network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            m.network_programming.clone(),
        );
        r.register(
            "sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules Endpoint changes",
            m.endpoint_changes_pending.clone(),
        );
        // prometheus-client appends `_total` to counters.
        r.register(
            "sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules Endpoint changes",
            m.endpoint_changes_total.clone(),
        );
        r.register(
            "sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes",
            m.service_changes_pending.clone(),
        );
        r.register(
            "sync_proxy_rules_service_changes",
            "Cumulative proxy rules Service changes",
            m.service_changes_total.clone(),
        );
        r.register(
            "sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            m.no_local_endpoints.clone(),
        );
        r.register(
            "sync_proxy_rules_nftables_sync_failures",
            "Cumulative proxy nftables sync failures",
            m.nftables_sync_failures.clone(),
        );
        r.register(
            "sync_proxy_rules_nftables_cleanup_failures",
            "Cumulative proxy nftables cleanup failures",
            m.nftables_cleanup_failures.clone(),
        );
        let own = registry.sub_registry_with_prefix("kproxy");
        own.register(
            "dataplane_drift_repairs",
            "Times the periodic verification found the kernel different from what kproxy programmed and repaired it",
            m.drift_repairs.clone(),
        );
        own.register(
            "conntrack_entries_deleted",
            "Stale conntrack entries deleted after syncs",
            m.conntrack_deleted.clone(),
        );
        own.register(
            "skipped_objects",
            "Objects skipped or trimmed at the last load because they failed validation",
            m.skipped_objects.clone(),
        );
        own.register(
            "endpoint_warmup_holds",
            "Endpoints that became ready while kproxy ran and were held back from new connections for --endpoint-warmup (docs/warmup.md)",
            m.endpoint_warmup_holds.clone(),
        );
        own.register(
            "endpoint_warmup_releases",
            "Warm-up holds ended, by reason: elapsed (the warm-up passed), needed (the other endpoints went, so the held one takes the traffic at once), gone (it stopped being ready or was removed)",
            m.endpoint_warmup_releases.clone(),
        );
        own.register(
            "frontend_conflicts",
            "Frontends (address, port, protocol) refused to a Service in the current plan because another Service holds them or they would capture a cluster IP or node address (docs/input.md)",
            m.frontend_conflicts.clone(),
        );
        own.register(
            "cluster_ip_warnings",
            "Cluster IPs in the current plan programmed, as upstream kube-proxy programs them, although no API server would allocate them now: another Node's address or outside the service CIDRs (docs/input.md)",
            m.cluster_ip_warnings.clone(),
        );
        own.register(
            "change_stage_duration_seconds",
            "A change's way to the kernel by stage, from the oldest change a sync carried: received (watch event received -> in the state), queued (in the state -> planning starts), plan, commit (kernel transaction), total (received -> committed)",
            m.change_stages.clone(),
        );
        own.register(
            "kernel_interference",
            "Transactions of other processes that changed kproxy's nftables tables, by kind of object changed (table, chain, rule, set, element, other; unknown: notifications lost)",
            m.kernel_interference.clone(),
        );
        own.register(
            "kernel_interference_repairs",
            "Repairs of kproxy's nftables tables after another process changed them",
            m.kernel_repairs.clone(),
        );
        own.register(
            "kernel_interference_backoff_seconds",
            "The wait before the next repair of kproxy's tables (0 unless a process keeps changing them)",
            m.kernel_repair_backoff.clone(),
        );
        own.register(
            "kernel_interference_missed",
            "Times the periodic verification found kproxy's tables changed while the kernel watch ran and had not reported it",
            m.kernel_watch_missed.clone(),
        );
        own.register(
            "conntrack_entries",
            "Conntrack entries in the node's network namespace (nf_conntrack_count)",
            m.conntrack_entries.clone(),
        );
        own.register(
            "conntrack_max",
            "The conntrack table's limit (nf_conntrack_max); at it, new connections are dropped",
            m.conntrack_max.clone(),
        );
        own.register(
            "conntrack_insert_failed",
            "Conntrack entries the kernel could not insert, since boot (per-CPU statistics summed)",
            m.conntrack_insert_failed.clone(),
        );
        own.register(
            "conntrack_drop",
            "Packets the kernel dropped because the conntrack table was full, since boot",
            m.conntrack_drop.clone(),
        );
        own.register(
            "conntrack_early_drop",
            "Conntrack entries evicted early to make room, since boot",
            m.conntrack_early_drop.clone(),
        );
        own.register(
            "sysctl_changed",
            "1 while a sysctl kproxy set at start holds another value (someone else changed it)",
            m.sysctl_changed.clone(),
        );
        own.register(
            "api_return_to_converged_seconds",
            "After an API outage: from the API answering again (its relist applied) to the rules matching the state (immediately when the relist found nothing changed: nothing is programmed)",
            m.api_return_to_converged.clone(),
        );
        Arc::new(m)
    }
}

/// Renders the registry in the OpenMetrics text format.
pub fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    // Encoding into a String cannot fail except on a formatting bug.
    prometheus_client::encoding::text::encode(&mut out, registry)
        .expect("encoding metrics into a String");
    out
}

/// [`encode`] with `more` families (already OpenMetrics text: the traffic counters,
/// rendered when they are read, `crate::traffic`) before the closing `# EOF`.
pub fn encode_with(registry: &Registry, more: &str) -> String {
    let mut out = encode(registry);
    if !more.is_empty()
        && let Some(at) = out.rfind("# EOF")
    {
        out.insert_str(at, more);
    }
    out
}

/// Scrape-time gauge of the manifest source: `kproxy_manifest_unread_documents`, the
/// documents or List items its last rescan could not read (a document without
/// a kind, or with an unknown one, is counted, not ignored).
pub struct ManifestCollector(pub kproxy_source::Reader);

impl std::fmt::Debug for ManifestCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ManifestCollector").finish_non_exhaustive()
    }
}

impl prometheus_client::collector::Collector for ManifestCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        let g = prometheus_client::metrics::gauge::ConstGauge::new(
            i64::try_from(self.0.status().unread_documents).unwrap_or(i64::MAX),
        );
        let m = encoder.encode_descriptor(
            "kproxy_manifest_unread_documents",
            "Manifest documents or List items the last rescan could not read (did not parse, no kind, an unknown kind); each keeps its file's last good objects. Beyond 1,000 in a file, the rest counts as one",
            None,
            g.metric_type(),
        )?;
        g.encode(m)?;
        let c = prometheus_client::metrics::counter::ConstCounter::new(self.0.status().rescans);
        let m = encoder.encode_descriptor(
            "kproxy_manifest_rescans",
            "Times the manifest source looked at its files for changes (after a filesystem event, and every --sync-period up to 10 s); an idle directory adds one per period",
            None,
            c.metric_type(),
        )?;
        c.encode(m)
    }
}

/// Scrape-time counter of the API source: `kproxy_api_skipped_total`, the watch events
/// and objects it skipped. Their warnings are rate-limited (one line per 10 s, saying
/// how many it stands for); this counts every one.
pub struct ApiCollector(pub kproxy_source::Reader);

impl std::fmt::Debug for ApiCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiCollector").finish_non_exhaustive()
    }
}

impl prometheus_client::collector::Collector for ApiCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        let c = prometheus_client::metrics::counter::ConstCounter::new(self.0.skipped());
        let m = encoder.encode_descriptor(
            "kproxy_api_skipped",
            "Watch events and listed objects the API source skipped: malformed, of an unknown type, undecodable (the object keeps its last good version and its kind is listed again) or refused by ingest",
            None,
            c.metric_type(),
        )?;
        c.encode(m)
    }
}

/// Bounds of the metrics server: a scraper or two need few connections; a flood of
/// idle ones is cut at this many (oldest closed first) instead of exhausting the
/// process's file descriptors, and keep-alive idleness ends after the header timeout.
pub const SERVER_LIMITS: kproxy_health::http::Limits = kproxy_health::http::Limits {
    max_connections: 64,
    header_read_timeout: std::time::Duration::from_secs(10),
    max_buf_size: 8192,
    max_headers: 64,
};

/// Where the daemon serves the health-check node ports' runtime state (JSON, see
/// `kproxy_health::listening_json`); `kproxy explain --server` reads it.
pub const HEALTH_CHECK_PORTS_PATH: &str = "/health-check-node-ports";

/// Where kube-proxy names its proxy mode on its metrics address (`GET /proxyMode`,
/// `cmd/kube-proxy/app/server.go`); upstream's e2e spec "[sig-network] Networking should
/// check kube-proxy urls" asks it for 200, and tooling reads it to tell the mode.
pub const PROXY_MODE_PATH: &str = "/proxyMode";

/// kproxy's only data path is nftables, so it answers as kube-proxy in that mode does.
pub const PROXY_MODE: &str = "nftables";

/// Serves `GET /metrics`, [`HEALTH_CHECK_PORTS_PATH`], the endpoints held for warm-up
/// ([`ENDPOINT_WARMUP_PATH`]) and [`PROXY_MODE_PATH`] on `addr`
/// (other paths: 404)
/// with [`SERVER_LIMITS`], through the health crate's bounded HTTP shell; runs until the
/// task is dropped.
pub async fn serve(
    addr: SocketAddr,
    registry: Arc<Registry>,
    health: kproxy_health::Health,
    traffic: Arc<crate::traffic::Traffic>,
    held: HeldView,
) -> Result<()> {
    use kproxy_health::http::{Responder, Server, bind, body_response};
    let responder: Responder = Arc::new(move |req: &http::request::Parts| match req.uri.path() {
        "/metrics" => body_response(
            http::StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            encode_with(&registry, &traffic.text()),
        ),
        HEALTH_CHECK_PORTS_PATH => body_response(
            http::StatusCode::OK,
            "application/json",
            kproxy_health::listening_json(&health.listening()).to_string(),
        ),
        PROXY_MODE_PATH => body_response(
            http::StatusCode::OK,
            "text/plain; charset=utf-8",
            PROXY_MODE.to_string(),
        ),
        ENDPOINT_WARMUP_PATH => {
            body_response(http::StatusCode::OK, "application/json", held.json())
        }
        _ => body_response(
            http::StatusCode::NOT_FOUND,
            "text/plain; charset=utf-8",
            format!(
                "not found: kproxy serves /metrics, {HEALTH_CHECK_PORTS_PATH}, {} and {PROXY_MODE_PATH} here\n",
                ENDPOINT_WARMUP_PATH
            ),
        ),
    });
    let listener = bind(addr).with_context(|| format!("binding the metrics server to {addr}"))?;
    let server = Server::with_responder("metrics server", responder, SERVER_LIMITS);
    let _listener = server.serve(listener);
    // The server's tasks run on their own; keeping `server` alive keeps them running.
    std::future::pending::<()>().await;
    drop(server);
    Ok(())
}

/// Where the daemon serves the endpoints it holds now (JSON, [`HeldView`]).
pub const ENDPOINT_WARMUP_PATH: &str = "/endpoint-warmup";

/// The endpoints the daemon's plan holds now, as served at [`ENDPOINT_WARMUP_PATH`]:
/// `{"held": [{"service", "servicePort", "family", "endpoint", "readySince",
/// "releaseAt"}]}` (moments in Unix milliseconds), rebuilt when a hold begins or ends.
#[derive(Clone, Debug, Default)]
pub struct HeldView(Arc<std::sync::Mutex<serde_json::Value>>);

impl HeldView {
    /// The answer's body.
    pub fn json(&self) -> String {
        let v = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if v.is_null() {
            serde_json::json!({ "held": [] }).to_string()
        } else {
            v.to_string()
        }
    }

    /// Rebuilds the view from `plan`'s Services that hold endpoints (`held`, the
    /// planner's [`kproxy_core::Planner::held_services`]).
    pub fn set<'a>(
        &self,
        plan: &kproxy_core::NodePlan,
        held: impl Iterator<Item = &'a kproxy_core::model::ServiceName>,
    ) {
        let mut list = Vec::new();
        for p in held
            .filter_map(|n| plan.services.get(n))
            .flat_map(|s| &s.ports)
        {
            for e in &p.endpoints {
                if let Some(h) = e.warmup.as_deref() {
                    list.push(serde_json::json!({
                        "service": p.service_port.service.to_string(),
                        "servicePort": p.service_port.to_string(),
                        "family": p.family.as_str(),
                        "endpoint": e.addr.to_string(),
                        "readySince": h.ready_since,
                        "releaseAt": h.release,
                    }));
                }
            }
        }
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = serde_json::json!({ "held": list });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_names_types_and_buckets() {
        let mut registry = Registry::default();
        let m = Metrics::register(&mut registry);
        m.sync_duration.observe(0.003);
        m.endpoint_changes_total.inc();
        m.no_local_endpoints
            .get_or_create(&NoLocalLabels {
                traffic_policy: "internal",
                ip_family: "IPv4",
            })
            .set(2);
        let text = encode(&registry);
        for line in [
            "# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.001\"} 0",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"0.004\"} 1",
            "kubeproxy_sync_proxy_rules_duration_seconds_bucket{le=\"16.384\"} 1",
            "# TYPE kubeproxy_sync_full_proxy_rules_duration_seconds histogram",
            "# TYPE kubeproxy_sync_partial_proxy_rules_duration_seconds histogram",
            "# TYPE kubeproxy_sync_proxy_rules_last_timestamp_seconds gauge",
            "# TYPE kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds gauge",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"0.25\"} 0",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"59.0\"} 0",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"115.0\"} 0",
            "kubeproxy_network_programming_duration_seconds_bucket{le=\"300.0\"} 0",
            "kubeproxy_sync_proxy_rules_endpoint_changes_total 1",
            "# TYPE kubeproxy_sync_proxy_rules_endpoint_changes_pending gauge",
            "# TYPE kubeproxy_sync_proxy_rules_service_changes counter",
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy=\"internal\",ip_family=\"IPv4\"} 2",
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total 0",
            "kproxy_dataplane_drift_repairs_total 0",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert_eq!(network_programming_buckets().len(), 2 + 59 + 12 + 7);
    }

    /// Every metric deploy/prometheus/kproxy-alerts.yaml names (in expressions and in
    /// annotations) is one the daemon exports, under that exact sample name.
    #[test]
    fn the_alert_rules_name_exported_metrics() {
        use kproxy_health::metrics::{BindLabels, CodeLabel, PortLabels, ServiceLabels};
        let mut registry = Registry::default();
        let m = Metrics::register(&mut registry);
        let health = kproxy_health::metrics::Metrics::default();
        health.register(&mut registry);
        // A family is exported once it has a child: give each one.
        let _ = m
            .change_stages
            .get_or_create(&StageLabel { stage: "total" });
        let _ = m.no_local_endpoints.get_or_create(&NoLocalLabels {
            traffic_policy: "external",
            ip_family: "IPv4",
        });
        let (namespace, name) = ("shop".to_string(), "web".to_string());
        let port = PortLabels {
            namespace: namespace.clone(),
            name: name.clone(),
            port: 32000,
        };
        let _ = health.port_listening.get_or_create(&port);
        let _ = health.port_healthy.get_or_create(&port);
        let _ = health.healthz.get_or_create(&CodeLabel { code: "200" });
        let _ = health.livez.get_or_create(&CodeLabel { code: "200" });
        let _ = health.transitions.get_or_create(&ServiceLabels {
            namespace: namespace.clone(),
            name: name.clone(),
        });
        let _ = health.bind_failures.get_or_create(&BindLabels {
            namespace,
            name,
            port: 32000,
            reason: "port_in_use",
        });
        // The traffic families (rendered from the kernel's counters), each with a series.
        let id = "0a1b2c3d-shop/web/tcp/http";
        let counters: Vec<kproxy_nft::KernelCounter> =
            ["new", "rejected", "no-local", "source-range", "fallback"]
                .iter()
                .map(|kind| kproxy_nft::KernelCounter {
                    family: kproxy_nft::Family::Ip,
                    name: format!("{kind}-{id}"),
                    packets: 1,
                    bytes: 60,
                    since: Some(1),
                })
                .collect();
        let traffic = crate::traffic::render(&counters, crate::traffic::Level::Service, 100).0;
        let text = encode_with(&registry, &traffic);
        let mut exported = std::collections::BTreeSet::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("# TYPE ") else {
                continue;
            };
            let (name, kind) = rest.split_once(' ').unwrap();
            match kind {
                "counter" => {
                    exported.insert(format!("{name}_total"));
                }
                "histogram" => {
                    // The family's own name, as annotations speak of it.
                    for suffix in ["", "_bucket", "_sum", "_count"] {
                        exported.insert(format!("{name}{suffix}"));
                    }
                }
                _ => {
                    exported.insert(name.to_string());
                }
            }
        }
        let rules = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../deploy/prometheus/kproxy-alerts.yaml"
        ))
        .unwrap();
        let named: std::collections::BTreeSet<&str> = rules
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| w.starts_with("kproxy_") || w.starts_with("kubeproxy_"))
            // The file's header speaks of the prefixes themselves.
            .filter(|w| !w.ends_with('_'))
            .collect();
        assert!(named.len() >= 8, "{named:?}");
        for name in named {
            assert!(
                exported.contains(name),
                "deploy/prometheus/kproxy-alerts.yaml names {name}, which kproxy does not export; exported: {exported:?}"
            );
        }
    }

    /// A change's way can be told apart around a 10 ms objective: 9.5 ms falls under
    /// 10 ms and above 8 ms, 11 ms under 12 ms.
    #[test]
    fn change_stage_buckets_resolve_milliseconds() {
        let mut registry = Registry::default();
        let m = Metrics::register(&mut registry);
        let total = m
            .change_stages
            .get_or_create(&StageLabel { stage: "total" });
        total.observe(0.0095);
        total.observe(0.011);
        let text = encode(&registry);
        for (le, n) in [("0.008", 0), ("0.01", 1), ("0.012", 2), ("60.0", 2)] {
            let line = format!(
                "kproxy_change_stage_duration_seconds_bucket{{le=\"{le}\",stage=\"total\"}} {n}"
            );
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        assert!(CHANGE_STAGE_BUCKETS.is_sorted());
    }
}
