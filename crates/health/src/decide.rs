//! The pure decisions of the health servers: what the proxy's `/healthz` and `/livez`
//! answer, what each health-check node port answers, which Services get a health-check
//! server, and on which addresses it listens. No I/O, no clock: `now` is an argument,
//! so timelines are table tests. The servers (`crate::Health`, over `crate::http`) only call these.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};
use std::time::{Duration, SystemTime};

use kproxy_core::NodePlan;
use kproxy_core::model::{DrainSignal, IpFamily, ServiceName};
use kproxy_core::plan::{
    FamilyPlan, NodePortAddresses, ServicePlan, local_ready_count, local_ready_ips,
};
use kproxy_core::planner::PlanUpdate;
use kproxy_core::update::Revisit;

/// Which answers the health servers give (`--health-check-semantics`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Semantics {
    /// kproxy's default: never advertise what the dataplane has not programmed or what
    /// the cluster has already taken away (docs/health.md).
    #[default]
    Truthful,
    /// Exactly what upstream kube-proxy answers (docs/upstream-semantics.md §d).
    Upstream,
}

impl Semantics {
    pub fn as_str(self) -> &'static str {
        match self {
            Semantics::Truthful => "truthful",
            Semantics::Upstream => "upstream",
        }
    }

    pub fn parse(s: &str) -> Option<Semantics> {
        match s {
            "truthful" => Some(Semantics::Truthful),
            "upstream" => Some(Semantics::Upstream),
            _ => None,
        }
    }
}

/// The proxy's sync freshness, upstream's `ProxyHealthServer` bookkeeping
/// (docs/upstream-semantics.md §d.2). Upstream keeps one `lastUpdated` and one oldest pending change
/// *per family* (one proxier each) and is healthy only when every family is. kproxy programs
/// both families in one transaction, so the daemon calls the all-family [`ProxyHealth::queued`]
/// / [`ProxyHealth::updated`]; the per-family calls exist so upstream's timelines (one family
/// late, the other fine) have the same answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProxyHealth {
    /// Last successful apply per family (`IpFamily::ALL` order); at start-up the start
    /// time (upstream calls `Updated` once when the sync loop starts, so a proxy that
    /// never syncs still starts healthy).
    pub family_updated: [SystemTime; 2],
    /// Per family, the oldest change that is queued but not yet applied.
    pub family_pending: [Option<SystemTime>; 2],
    /// A plan has been applied at least once.
    pub applied_once: bool,
    /// Failed syncs since the last success.
    pub consecutive_failures: u32,
    /// kproxy's tables in the kernel as the kernel watch last saw them.
    pub kernel: KernelRules,
    /// The conntrack table is full: the node cannot accept new Service connections.
    pub conntrack_full: bool,
    /// kproxy holds its first sync back: the input is empty, or lost objects to a
    /// file that could not be read or parsed, while its tables hold Services from an
    /// earlier run (docs/input.md).
    pub input_held: bool,
    /// Since when a drain signal has turned `/healthz` to 503 (the first computed plan
    /// with a Node signal that counts, or the start of the shutdown drain); `None`
    /// while none does. The shutdown drain counts its period from here.
    pub draining_since: Option<SystemTime>,
    /// kproxy got SIGTERM and drains before it exits ([`DrainSignal::Shutdown`]).
    pub shutting_down: bool,
    /// Since when the API source has heard nothing usable from the API server for one
    /// of the kinds it watches (errors, refusals, throttling); `None` while it follows.
    /// Said in the body, not in the status code: a node cannot tell its own stall from
    /// the API server's outage, and failing every node's `/healthz` in an outage would
    /// take every node out of every load balancer while the rules in place still
    /// serve (docs/health.md).
    pub source_stalled_since: Option<SystemTime>,
}

/// What the kernel holds of kproxy's tables, as the kernel watch (kproxy-nft's
/// `monitor`) last saw it: from another process's change until kproxy repaired it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KernelRules {
    /// As programmed (or nothing seen).
    #[default]
    Intact,
    /// Another process changed them; a repair is pending.
    Altered,
    /// One of kproxy's tables is gone; a repair is pending.
    TablesMissing,
}

impl KernelRules {
    pub fn as_str(self) -> &'static str {
        match self {
            KernelRules::Intact => "intact",
            KernelRules::Altered => "altered",
            KernelRules::TablesMissing => "tablesMissing",
        }
    }
}

impl ProxyHealth {
    pub fn new(now: SystemTime) -> ProxyHealth {
        ProxyHealth {
            family_updated: [now; 2],
            family_pending: [None; 2],
            applied_once: false,
            consecutive_failures: 0,
            kernel: KernelRules::Intact,
            conntrack_full: false,
            input_held: false,
            draining_since: None,
            shutting_down: false,
            source_stalled_since: None,
        }
    }

    /// The computed plan's Node drain signals moved to `node_signals`: the drain
    /// starts with the first signal and ends when none is left (the shutdown drain,
    /// once begun, never ends).
    pub fn node_drain(&mut self, node_signals: &[DrainSignal], now: SystemTime) {
        if node_signals.is_empty() && !self.shutting_down {
            self.draining_since = None;
        } else {
            self.draining_since.get_or_insert(now);
        }
    }

    /// SIGTERM: the shutdown drain begins (a drain already under way keeps its start).
    pub fn shut_down(&mut self, now: SystemTime) {
        self.shutting_down = true;
        self.draining_since.get_or_insert(now);
    }

    /// Another process changed kproxy's tables (`tables_missing`: deleted one); a
    /// table found missing stays missing until the repair, whatever changes follow.
    pub fn kernel_changed(&mut self, tables_missing: bool) {
        self.kernel = match (self.kernel, tables_missing) {
            (_, true) | (KernelRules::TablesMissing, _) => KernelRules::TablesMissing,
            _ => KernelRules::Altered,
        };
    }

    /// kproxy restored its tables.
    pub fn kernel_repaired(&mut self) {
        self.kernel = KernelRules::Intact;
    }

    /// The `serviceProxyHealthy` of the health-check node ports. Truthful: also false
    /// from another process's change to kproxy's tables until the repair, since which
    /// Services lost rules is not known before it, and while the conntrack table is full
    /// (upstream: the `/livez` notion alone).
    pub fn service_proxy_healthy(
        &self,
        semantics: Semantics,
        now: SystemTime,
        timeout: Duration,
    ) -> bool {
        self.healthy(now, timeout)
            && (semantics == Semantics::Upstream
                || (self.kernel == KernelRules::Intact && !self.conntrack_full))
    }

    /// Upstream `QueuedUpdate(family)`: remembers the family's *oldest* pending change.
    pub fn queued_family(&mut self, family: IpFamily, now: SystemTime) {
        self.family_pending[family.index()].get_or_insert(now);
    }

    /// Upstream `Updated(family)`: nothing of that family pending any more.
    pub fn updated_family(&mut self, family: IpFamily, now: SystemTime) {
        self.family_pending[family.index()] = None;
        self.family_updated[family.index()] = now;
    }

    /// A change queued for both families (kproxy syncs them together).
    pub fn queued(&mut self, now: SystemTime) {
        for f in IpFamily::ALL {
            self.queued_family(f, now);
        }
    }

    /// Both families applied in one successful sync.
    pub fn updated(&mut self, now: SystemTime) {
        for f in IpFamily::ALL {
            self.updated_family(f, now);
        }
        self.applied_once = true;
        self.consecutive_failures = 0;
    }

    /// The most recent successful apply of any family (upstream's top-level
    /// `lastUpdated` before it is rewritten for 200 answers).
    pub fn last_updated(&self) -> SystemTime {
        self.family_updated[0].max(self.family_updated[1])
    }

    /// The oldest change pending in any family.
    pub fn oldest_pending(&self) -> Option<SystemTime> {
        self.family_pending.iter().flatten().min().copied()
    }

    /// A sync failed. Upstream has no such call (a failure simply leaves the queued
    /// change pending). Truthful: a failure also starts the staleness clock when
    /// nothing was queued (e.g. the caller reports a failed re-verification), so a
    /// dataplane that keeps failing always turns the proxy unhealthy.
    pub fn failed(&mut self, now: SystemTime, semantics: Semantics) {
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        if semantics == Semantics::Truthful {
            self.queued(now);
        }
    }

    /// Whether `family` is healthy: unhealthy iff its pending change is at least
    /// `timeout` old. A clock that went backwards counts as "not late" (as Go's
    /// negative `Sub` does).
    pub fn family_healthy(&self, family: IpFamily, now: SystemTime, timeout: Duration) -> bool {
        match self.family_pending[family.index()] {
            None => true,
            Some(q) => now
                .duration_since(q)
                .map(|age| age < timeout)
                .unwrap_or(true),
        }
    }

    /// Healthy iff every family is.
    pub fn healthy(&self, now: SystemTime, timeout: Duration) -> bool {
        IpFamily::ALL
            .into_iter()
            .all(|f| self.family_healthy(f, now, timeout))
    }
}

/// Which proxy endpoint is asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    /// For load balancers of eTP-Cluster Services: proxy health and node eligibility.
    Healthz,
    /// For the liveness probe: proxy health only.
    Livez,
}

/// One HTTP answer. Headers common to all answers (`Content-Type: application/json`,
/// `X-Content-Type-Options: nosniff`) are added by the server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub body: String,
    /// `X-Load-Balancing-Endpoint-Weight` (health-check node ports only).
    pub endpoint_weight: Option<u32>,
}

/// RFC 3339 UTC with nanoseconds when non-zero (Go's `time.Time` JSON form).
pub fn rfc3339(t: SystemTime) -> String {
    match jiff::Timestamp::try_from(t) {
        Ok(ts) => ts.to_string(),
        // Outside jiff's range (year ±9999): cannot come from a real clock.
        Err(_) => "0001-01-01T00:00:00Z".to_string(),
    }
}

/// The answer of `/healthz` or `/livez` (docs/upstream-semantics.md §d.2).
///
/// Upstream: `healthy` = no change pending for ≥ `timeout`; `/livez` is 200 iff healthy;
/// `/healthz` is 200 iff healthy and the node is eligible. When the answer is 200 the
/// top-level `lastUpdated` is reported as `currentTime` (upstream keeps that appearance
/// for old clients); the per-family `status` keeps the real time.
///
/// Truthful differs in three places: `/healthz` is 503 until a plan has been applied once
/// (a node without rules must not receive eTP-Cluster traffic; upstream says 200 from
/// start-up), while one of kproxy's tables is missing from the kernel (deleted by
/// another process, until kproxy restored it) and while the conntrack table is full, and
/// `lastUpdated` is always the real time of the last successful apply. It also adds
/// `syncedOnce`, `oldestPendingChange`, `consecutiveSyncFailures`, `kernelRules`,
/// `conntrackFull`, `inputHeld`, `sourceStalledSince` and `drainSignals`.
///
/// `drain` is [`drain_signals`]: under both semantics the node is eligible only
/// while it is empty (the opt-outs are applied before: the planner's
/// `PlanConfig::counts` for the Node's signals, `--shutdown-drain never` for SIGTERM).
pub fn proxy_answer(
    semantics: Semantics,
    probe: Probe,
    health: &ProxyHealth,
    drain: &[DrainSignal],
    families: &[IpFamily],
    now: SystemTime,
    timeout: Duration,
) -> Answer {
    let node_eligible = drain.is_empty();
    let healthy = health.healthy(now, timeout);
    let ok = match (probe, semantics) {
        (Probe::Livez, _) => healthy,
        (Probe::Healthz, Semantics::Upstream) => healthy && node_eligible,
        (Probe::Healthz, Semantics::Truthful) => {
            healthy
                && node_eligible
                && health.applied_once
                && health.kernel != KernelRules::TablesMissing
                && !health.conntrack_full
                && !health.input_held
        }
    };
    let last = rfc3339(health.last_updated());
    let top_last = if ok && semantics == Semantics::Upstream {
        rfc3339(now)
    } else {
        last.clone()
    };
    let mut body = serde_json::Map::new();
    body.insert("lastUpdated".into(), top_last.into());
    body.insert("currentTime".into(), rfc3339(now).into());
    if probe == Probe::Healthz {
        body.insert("nodeEligible".into(), node_eligible.into());
    }
    body.insert("healthy".into(), healthy.into());
    let mut status = serde_json::Map::new();
    for f in families {
        status.insert(
            f.as_str().into(),
            serde_json::json!({
                "lastUpdated": rfc3339(health.family_updated[f.index()]),
                "healthy": health.family_healthy(*f, now, timeout),
            }),
        );
    }
    body.insert("status".into(), status.into());
    if semantics == Semantics::Truthful {
        body.insert("syncedOnce".into(), health.applied_once.into());
        body.insert(
            "oldestPendingChange".into(),
            health.oldest_pending().map(rfc3339).into(),
        );
        body.insert(
            "consecutiveSyncFailures".into(),
            health.consecutive_failures.into(),
        );
        body.insert("kernelRules".into(), health.kernel.as_str().into());
        body.insert("conntrackFull".into(), health.conntrack_full.into());
        body.insert("inputHeld".into(), health.input_held.into());
        if probe == Probe::Healthz {
            body.insert(
                "drainSignals".into(),
                drain.iter().map(|d| d.as_str()).collect::<Vec<_>>().into(),
            );
        }
        body.insert(
            "sourceStalledSince".into(),
            health.source_stalled_since.map(rfc3339).into(),
        );
    }
    Answer {
        status: if ok { 200 } else { 503 },
        body: serde_json::Value::Object(body).to_string(),
        endpoint_weight: None,
    }
}

/// The status [`service_answer`] gives, without building its body.
pub fn service_status(local_endpoints: u32, proxy_healthy: bool) -> u16 {
    if local_endpoints > 0 && proxy_healthy {
        200
    } else {
        503
    }
}

/// The answer of a health-check node port (docs/upstream-semantics.md §d.1): 200 iff the Service has
/// local ready endpoints and the proxy is healthy (`/livez` notion); the body is upstream's,
/// byte for byte (tab-indented, no trailing newline).
pub fn service_answer(service: &ServiceName, local_endpoints: u32, proxy_healthy: bool) -> Answer {
    let ok = service_status(local_endpoints, proxy_healthy) == 200;
    // Names are validated DNS labels; JSON-encode anyway so the body is always JSON.
    let ns = serde_json::Value::from(&*service.namespace).to_string();
    let name = serde_json::Value::from(&*service.name).to_string();
    Answer {
        status: if ok { 200 } else { 503 },
        body: format!(
            "{{\n\t\"service\": {{\n\t\t\"namespace\": {ns},\n\t\t\"name\": {name}\n\t}},\n\t\"localEndpoints\": {local_endpoints},\n\t\"serviceProxyHealthy\": {proxy_healthy}\n}}"
        ),
        endpoint_weight: Some(local_endpoints),
    }
}

/// What the health servers keep of a plan: its node facts and its health-checked
/// Services only, moved by the planner's [`PlanUpdate`] as
/// [`PlanUpdate::revisit`] says (the sync loop never clones a whole plan for health).
pub fn follow(view: &mut Option<NodePlan>, plan: &NodePlan, update: &PlanUpdate) {
    let checked = |svc: &&std::sync::Arc<ServicePlan>| svc.health_check.is_some();
    let revisit = update.revisit(view.is_some());
    match (view.as_mut(), revisit) {
        (Some(v), Revisit::Services(names)) => {
            for name in names.iter() {
                match plan.services.get(name).filter(checked) {
                    Some(svc) => {
                        v.services.insert(name.clone(), svc.clone());
                    }
                    None => {
                        v.services.remove(name);
                    }
                }
            }
        }
        _ => {
            *view = Some(NodePlan {
                node: plan.node.clone(),
                zone: plan.zone.clone(),
                node_eligible: plan.node_eligible,
                node_drain_signals: plan.node_drain_signals.clone(),
                families: plan.families.clone(),
                services: plan
                    .services
                    .iter()
                    .filter(|(_, s)| checked(s))
                    .map(|(n, s)| (n.clone(), s.clone()))
                    .collect(),
                conflicts: Vec::new(),
                cluster_ip_warnings: Vec::new(),
            })
        }
    }
}

/// What one health-check server must serve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub port: u16,
    pub local_endpoints: u32,
}

/// The health-check servers to run and the count each answers with.
///
/// Both semantics open servers for the health checks of the *applied* plan (upstream
/// opens them after a successful sync, so nothing is served before rules exist).
///
/// - Upstream: the count is the applied plan's (upstream calls `SyncEndpoints` only
///   after a successful sync).
/// - Truthful: where the computed plan has moved on from the applied one, only
///   endpoints that are both *programmed* (applied) and *still ready* (computed)
///   count. New endpoints count once their rules are in; endpoints the cluster took
///   away (deleted, not ready, terminating) stop counting at once, even while the
///   dataplane cannot apply, so the load balancer starts draining the node.
pub fn health_check_targets(
    semantics: Semantics,
    computed: Option<&NodePlan>,
    applied: Option<&NodePlan>,
) -> BTreeMap<ServiceName, Target> {
    let Some(applied) = applied else {
        return BTreeMap::new();
    };
    applied
        .services
        .iter()
        .filter_map(|(name, svc)| Some((name.clone(), target_of(semantics, computed, svc)?)))
        .collect()
}

/// One Service's entry of [`health_check_targets`] (`None`: no server), for a caller
/// that follows changes Service by Service.
pub fn health_check_target(
    semantics: Semantics,
    computed: Option<&NodePlan>,
    applied: Option<&NodePlan>,
    name: &ServiceName,
) -> Option<Target> {
    target_of(semantics, computed, applied?.services.get(name)?)
}

fn target_of(
    semantics: Semantics,
    computed: Option<&NodePlan>,
    svc: &std::sync::Arc<ServicePlan>,
) -> Option<Target> {
    let hc = svc.health_check.as_ref()?;
    let local_endpoints = match (semantics, computed) {
        (Semantics::Upstream, _) | (Semantics::Truthful, None) => hc.local_endpoints,
        (Semantics::Truthful, Some(computed)) => match computed.services.get(&svc.service) {
            Some(now) if std::sync::Arc::ptr_eq(now, svc) || **now == **svc => hc.local_endpoints,
            Some(now) => match &now.health_check {
                Some(now_hc) => hc
                    .local_endpoints
                    .min(now_hc.local_endpoints)
                    .min(programmed_and_ready(svc, now)),
                None => 0,
            },
            None => 0,
        },
    };
    Some(Target {
        port: hc.health_check_node_port,
        local_endpoints,
    })
}

/// Local ready endpoint IPs present in both plans of a Service, counted as the planner
/// counts them (`kproxy_core::plan::local_ready_count`).
fn programmed_and_ready(applied: &ServicePlan, computed: &ServicePlan) -> u32 {
    let ips = |s: &ServicePlan, f: IpFamily| {
        local_ready_ips(
            s.ports
                .iter()
                .filter(|p| p.family == f)
                .flat_map(|p| p.endpoints.iter()),
        )
    };
    local_ready_count(IpFamily::ALL.into_iter().map(|f| {
        ips(applied, f)
            .intersection(&ips(computed, f))
            .copied()
            .collect()
    }))
}

/// Why a health-check node port is not served on an address: logged with the Service,
/// counted by reason (`kproxy_health_check_node_port_bind_failures_total{reason}`) and
/// shown by `kproxy explain --server`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BindFailure {
    /// nodePortAddresses selects a node address this host does not have.
    AddressAbsent,
    /// Another socket holds the port.
    PortInUse,
    /// Anything else the kernel refused (the error's text).
    Other(String),
}

impl BindFailure {
    /// Every metric label value, for removing a port's series.
    pub const LABELS: [&'static str; 3] = ["address_absent", "port_in_use", "other"];

    pub fn of(e: &std::io::Error) -> BindFailure {
        match e.kind() {
            std::io::ErrorKind::AddrInUse => BindFailure::PortInUse,
            std::io::ErrorKind::AddrNotAvailable => BindFailure::AddressAbsent,
            _ => BindFailure::Other(e.to_string()),
        }
    }

    /// The metric label value.
    pub fn label(&self) -> &'static str {
        match self {
            BindFailure::AddressAbsent => Self::LABELS[0],
            BindFailure::PortInUse => Self::LABELS[1],
            BindFailure::Other(_) => Self::LABELS[2],
        }
    }
}

impl std::fmt::Display for BindFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BindFailure::AddressAbsent => f.write_str("the node address is not on this host"),
            BindFailure::PortInUse => f.write_str("the port is in use by another socket"),
            BindFailure::Other(e) => f.write_str(e),
        }
    }
}

/// A local interface address (with its IPv6 scope, needed to bind link-local ones).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct LocalAddr {
    pub ip: IpAddr,
    pub scope_id: u32,
}

/// Node addresses that nodePortAddresses selects explicitly (the node's primary IPs by
/// default) but this host does not have: a health-check node port cannot listen there,
/// which the servers report rather than skip in silence. Empty when nothing is known
/// about local addresses.
pub fn missing_node_addrs(families: &[FamilyPlan], local: &[LocalAddr]) -> Vec<IpAddr> {
    if local.is_empty() {
        return Vec::new();
    }
    families
        .iter()
        .filter_map(|f| match &f.node_port_addresses {
            NodePortAddresses::Only(ips) => Some(ips),
            NodePortAddresses::AllLocal | NodePortAddresses::Cidrs(_) => None,
        })
        .flatten()
        .filter(|ip| !local.iter().any(|l| l.ip == **ip))
        .copied()
        .collect()
}

/// Where a health-check node port listens (docs/upstream-semantics.md §d.1): the wildcard address of
/// each family whose nodePortAddresses match everything, else each selected node address that
/// is really local (binding another one would fail). A family without any node address is not
/// in use and gets no listener, unless no family has one (nothing is known: listen everywhere,
/// as upstream does).
pub fn listen_addrs(families: &[FamilyPlan], local: &[LocalAddr], port: u16) -> Vec<SocketAddr> {
    let any_known = families.iter().any(|f| !f.node_ips.is_empty());
    let mut out = BTreeSet::new();
    for f in families {
        match &f.node_port_addresses {
            NodePortAddresses::AllLocal => {
                if any_known && f.node_ips.is_empty() {
                    continue;
                }
                out.insert(match f.family {
                    IpFamily::IPv4 => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port),
                    IpFamily::IPv6 => SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port),
                });
            }
            // Every local address inside the CIDRs, loopback included: unlike NodePorts
            // (which nftables mode never serves on loopback), upstream's health server
            // listens on 127.0.0.1 when nodePortAddresses selects it.
            NodePortAddresses::Cidrs(cidrs) => {
                for l in local
                    .iter()
                    .filter(|l| cidrs.iter().any(|c| c.contains(&l.ip)))
                {
                    out.insert(match l.ip {
                        IpAddr::V4(_) => SocketAddr::new(l.ip, port),
                        IpAddr::V6(v6) => {
                            SocketAddr::V6(SocketAddrV6::new(v6, port, 0, l.scope_id))
                        }
                    });
                }
            }
            NodePortAddresses::Only(ips) => {
                for ip in ips {
                    let Some(l) = local.iter().find(|l| l.ip == *ip) else {
                        continue;
                    };
                    out.insert(match l.ip {
                        IpAddr::V4(_) => SocketAddr::new(l.ip, port),
                        IpAddr::V6(v6) => {
                            SocketAddr::V6(SocketAddrV6::new(v6, port, 0, l.scope_id))
                        }
                    });
                }
            }
        }
    }
    out.into_iter().collect()
}

/// The drain signals that turn `/healthz` to 503 now: the Node's, from the newest
/// computed plan (Node changes need no dataplane work; none until a plan says otherwise,
/// as upstream v1.28–v1.32), then [`DrainSignal::Shutdown`] during the shutdown drain.
pub fn drain_signals(computed: Option<&NodePlan>, health: &ProxyHealth) -> Vec<DrainSignal> {
    let mut out: Vec<DrainSignal> = computed
        .map(|p| p.node_drain_signals.clone())
        .unwrap_or_default();
    if health.shutting_down {
        out.push(DrainSignal::Shutdown);
    }
    out
}

/// When SIGTERM means the node is going away (`--shutdown-drain`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ShutdownDrain {
    /// Only when a drain signal of the Node is already counted: a SIGTERM without one is
    /// taken for a restart of kproxy (its DaemonSet's rollout), which must not take a
    /// healthy node out of the load balancers.
    #[default]
    Signalled,
    /// Every SIGTERM (kproxy as a host service whose SIGTERM comes at host shutdown).
    Always,
    /// Never: exit at once, as kube-proxy does.
    Never,
}

impl ShutdownDrain {
    pub const NAMES: [&'static str; 3] = ["signalled", "always", "never"];

    pub fn parse(s: &str) -> Option<ShutdownDrain> {
        match s {
            "signalled" => Some(ShutdownDrain::Signalled),
            "always" => Some(ShutdownDrain::Always),
            "never" => Some(ShutdownDrain::Never),
            _ => None,
        }
    }
}

/// How long kproxy keeps forwarding, answering 503 on `/healthz`, after SIGTERM before it
/// exits (its rules stay either way): `None` to exit at once. The period counts from the
/// start of the drain (`draining_since`, when a Node signal first turned `/healthz` to
/// 503), since the load balancers have been seeing 503 since then: a node drained for
/// longer than `period` exits at once.
pub fn shutdown_drain(
    mode: ShutdownDrain,
    period: Duration,
    draining_since: Option<SystemTime>,
    now: SystemTime,
) -> Option<Duration> {
    let since = match (mode, draining_since) {
        (ShutdownDrain::Never, _) | (ShutdownDrain::Signalled, None) => return None,
        (_, Some(t)) => t,
        (ShutdownDrain::Always, None) => now,
    };
    // A clock that went backwards counts as a drain just begun.
    let drained = now.duration_since(since).unwrap_or_default();
    Some(period.saturating_sub(drained)).filter(|d| !d.is_zero())
}

/// Families to report in the proxy body: those with node addresses, else both.
pub fn families(computed: Option<&NodePlan>) -> Vec<IpFamily> {
    let known: Vec<IpFamily> = computed
        .map(|p| {
            p.families
                .iter()
                .filter(|f| !f.node_ips.is_empty())
                .map(|f| f.family)
                .collect()
        })
        .unwrap_or_default();
    if known.is_empty() {
        IpFamily::ALL.to_vec()
    } else {
        known
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_failures_are_classified_by_the_kernel_error() {
        use std::io::{Error, ErrorKind};
        for (e, want, label) in [
            (
                Error::from(ErrorKind::AddrInUse),
                BindFailure::PortInUse,
                "port_in_use",
            ),
            (
                Error::from(ErrorKind::AddrNotAvailable),
                BindFailure::AddressAbsent,
                "address_absent",
            ),
            (
                Error::from_raw_os_error(libc::EACCES),
                BindFailure::Other(Error::from_raw_os_error(libc::EACCES).to_string()),
                "other",
            ),
        ] {
            let got = BindFailure::of(&e);
            assert_eq!(got, want);
            assert_eq!(got.label(), label);
        }
    }

    #[test]
    fn a_view_moved_by_plan_updates_equals_one_built_from_the_whole_plan() {
        use kproxy_core::synthetic::{self, Spec};
        let spec = Spec {
            nodes: 2,
            etp_local_every: 3,
            ..Spec::new(60, 4)
        };
        let mut state = synthetic::cluster(&spec);
        let mut planner = kproxy_core::Planner::new(synthetic::node_name(0), Default::default());
        let mut view = None;
        let update = planner.update(&mut state);
        follow(&mut view, planner.plan(), &update);
        let rebuilt = |plan: &NodePlan| {
            let mut v = None;
            follow(&mut v, plan, &PlanUpdate::WHOLE);
            v
        };
        assert_eq!(view, rebuilt(planner.plan()));
        assert_eq!(view.as_ref().map(|v| v.services.len()), Some(20));
        // Endpoints change, a health-checked Service goes, another loses its eTP Local,
        // a new one comes.
        for i in (0..30).step_by(2) {
            state.upsert_slice(synthetic::slice(&spec, i, 1));
        }
        state.delete_service(&synthetic::service(&spec, 3).name);
        let mut cluster_policy = synthetic::service(&spec, 6);
        cluster_policy.external_traffic_policy = kproxy_core::model::TrafficPolicy::Cluster;
        state.upsert_service(cluster_policy);
        state.upsert_service(synthetic::service(&spec, 60));
        let update = planner.update(&mut state);
        assert!(!update.node && !update.services.is_empty());
        follow(&mut view, planner.plan(), &update);
        assert_eq!(view, rebuilt(planner.plan()));
    }

    const T: Duration = Duration::from_secs(60);

    fn at(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000 + s)
    }

    #[derive(Clone, Copy, Debug)]
    enum Ev {
        Queued,
        Updated,
        Failed,
    }

    /// A timeline: events at times, then probes at a time with the expected statuses
    /// (healthz upstream, healthz truthful, livez upstream, livez truthful).
    struct Case {
        name: &'static str,
        events: &'static [(u64, Ev)],
        eligible: bool,
        probe_at: u64,
        want: [u16; 4],
    }

    #[test]
    fn proxy_health_timelines() {
        use Ev::*;
        let cases = [
            Case {
                name: "fresh start, nothing queued",
                events: &[],
                eligible: true,
                probe_at: 1000,
                want: [200, 503, 200, 200],
            },
            Case {
                name: "start, first plan queued, young",
                events: &[(10, Queued)],
                eligible: true,
                probe_at: 69,
                want: [200, 503, 200, 200],
            },
            Case {
                name: "start, first plan never applied, just stale",
                events: &[(10, Queued)],
                eligible: true,
                probe_at: 70,
                want: [503, 503, 503, 503],
            },
            Case {
                name: "applied",
                events: &[(10, Queued), (11, Updated)],
                eligible: true,
                probe_at: 5000,
                want: [200, 200, 200, 200],
            },
            Case {
                name: "applied, new change pending 59s",
                events: &[(10, Queued), (11, Updated), (100, Queued)],
                eligible: true,
                probe_at: 159,
                want: [200, 200, 200, 200],
            },
            Case {
                name: "applied, new change pending 60s",
                events: &[(10, Queued), (11, Updated), (100, Queued)],
                eligible: true,
                probe_at: 160,
                want: [503, 503, 503, 503],
            },
            Case {
                name: "later queued does not reset the oldest",
                events: &[(0, Updated), (100, Queued), (150, Queued)],
                eligible: true,
                probe_at: 165,
                want: [503, 503, 503, 503],
            },
            Case {
                name: "update clears pending",
                events: &[(0, Updated), (100, Queued), (150, Queued), (170, Updated)],
                eligible: true,
                probe_at: 171,
                want: [200, 200, 200, 200],
            },
            Case {
                name: "node not eligible: healthz 503, livez 200",
                events: &[(0, Updated)],
                eligible: false,
                probe_at: 10,
                want: [503, 503, 200, 200],
            },
            Case {
                name: "failing syncs while queued: stale after timeout",
                events: &[(0, Updated), (10, Queued), (11, Failed), (40, Failed)],
                eligible: true,
                probe_at: 70,
                want: [503, 503, 503, 503],
            },
            Case {
                name: "failing syncs while queued: young",
                events: &[(0, Updated), (10, Queued), (11, Failed)],
                eligible: true,
                probe_at: 69,
                want: [200, 200, 200, 200],
            },
            // A failure reported without a queued change (e.g. re-verification):
            // upstream ignores it; truthful starts the staleness clock.
            Case {
                name: "failure without queued change",
                events: &[(0, Updated), (10, Failed)],
                eligible: true,
                probe_at: 80,
                want: [200, 503, 200, 503],
            },
            Case {
                name: "clock went backwards",
                events: &[(0, Updated), (100, Queued)],
                eligible: true,
                probe_at: 50,
                want: [200, 200, 200, 200],
            },
        ];
        for c in cases {
            let mut got = [0u16; 4];
            for (i, (probe, sem)) in [
                (Probe::Healthz, Semantics::Upstream),
                (Probe::Healthz, Semantics::Truthful),
                (Probe::Livez, Semantics::Upstream),
                (Probe::Livez, Semantics::Truthful),
            ]
            .into_iter()
            .enumerate()
            {
                let mut h = ProxyHealth::new(at(0));
                for (t, ev) in c.events {
                    match ev {
                        Ev::Queued => h.queued(at(*t)),
                        Ev::Updated => h.updated(at(*t)),
                        Ev::Failed => h.failed(at(*t), sem),
                    }
                }
                got[i] = proxy_answer(
                    sem,
                    probe,
                    &h,
                    if c.eligible {
                        &[]
                    } else {
                        &[DrainSignal::DeletionTimestamp]
                    },
                    &IpFamily::ALL,
                    at(c.probe_at),
                    T,
                )
                .status;
            }
            assert_eq!(got, c.want, "{}", c.name);
        }
    }

    #[test]
    fn proxy_body_fields() {
        let mut h = ProxyHealth::new(at(0));
        h.updated(at(5));
        let now = at(10);
        let a = proxy_answer(
            Semantics::Upstream,
            Probe::Healthz,
            &h,
            &[],
            &[IpFamily::IPv4],
            now,
            T,
        );
        let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
        assert_eq!(
            v["lastUpdated"],
            rfc3339(now),
            "200 reports lastUpdated = currentTime"
        );
        assert_eq!(v["currentTime"], rfc3339(now));
        assert_eq!(v["nodeEligible"], true);
        assert_eq!(v["healthy"], true);
        assert_eq!(v["status"]["IPv4"]["lastUpdated"], rfc3339(at(5)));
        assert!(v["status"].get("IPv6").is_none());
        assert!(v.get("syncedOnce").is_none());

        let l = proxy_answer(
            Semantics::Upstream,
            Probe::Livez,
            &h,
            &[],
            &IpFamily::ALL,
            now,
            T,
        );
        let v: serde_json::Value = serde_json::from_str(&l.body).unwrap();
        assert!(v.get("nodeEligible").is_none(), "livez has no nodeEligible");
        assert_eq!(v["status"]["IPv6"]["healthy"], true);

        // 503: the real last update.
        h.queued(at(20));
        let a = proxy_answer(
            Semantics::Upstream,
            Probe::Healthz,
            &h,
            &[],
            &[IpFamily::IPv4],
            at(100),
            T,
        );
        assert_eq!(a.status, 503);
        let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
        assert_eq!(v["lastUpdated"], rfc3339(at(5)));
        assert_eq!(v["healthy"], false);

        // Truthful never rewrites lastUpdated and says what is pending.
        let mut h = ProxyHealth::new(at(0));
        h.updated(at(5));
        h.queued(at(8));
        let t = proxy_answer(
            Semantics::Truthful,
            Probe::Healthz,
            &h,
            &[],
            &[IpFamily::IPv4],
            now,
            T,
        );
        assert_eq!(t.status, 200);
        let v: serde_json::Value = serde_json::from_str(&t.body).unwrap();
        assert_eq!(v["lastUpdated"], rfc3339(at(5)));
        assert_eq!(v["oldestPendingChange"], rfc3339(at(8)));
        assert_eq!(v["syncedOnce"], true);
    }

    /// Every drain signal and its opt-out, from the Node object through the planner to
    /// the answer: `/healthz` under both semantics, `/livez`, and truthful's
    /// `drainSignals`. Fails if a signal is not read, not planned, or not answered.
    #[test]
    fn drain_signals_table() {
        use DrainSignal::*;
        use kproxy_core::config::PlanConfig;
        use kproxy_core::model::Node;
        use kproxy_core::state::ClusterState;
        struct Case {
            name: &'static str,
            node: fn(&mut Node),
            /// `--ignore-drain-signal`.
            ignore: &'static [DrainSignal],
            /// The `KubeProxyDrainingTerminatingNodes` gate.
            gate: bool,
            /// SIGTERM with a drain period.
            shutdown: bool,
            want: &'static [DrainSignal],
        }
        let none: fn(&mut Node) = |_| {};
        let taint: fn(&mut Node) = |n| n.to_be_deleted_by_autoscaler = true;
        let deleting: fn(&mut Node) = |n| n.deleting = true;
        let deleted: fn(&mut Node) = |n| n.deleted = true;
        let draining: fn(&mut Node) = |n| n.drain_in_progress = true;
        let stopping: fn(&mut Node) = |n| n.graceful_node_shutdown_in_progress = true;
        let c = |name, node, ignore, gate, shutdown, want| Case {
            name,
            node,
            ignore,
            gate,
            shutdown,
            want,
        };
        let cases = [
            c("no signal", none, &[], true, false, &[]),
            c(
                "autoscaler taint",
                taint,
                &[],
                true,
                false,
                &[AutoscalerTaint],
            ),
            c("taint ignored", taint, &[AutoscalerTaint], true, false, &[]),
            c("taint, gate off", taint, &[], false, false, &[]),
            c(
                "deletionTimestamp",
                deleting,
                &[],
                true,
                false,
                &[DeletionTimestamp],
            ),
            c(
                "deletionTimestamp ignored",
                deleting,
                &[DeletionTimestamp],
                true,
                false,
                &[],
            ),
            c(
                "deletionTimestamp, gate off",
                deleting,
                &[],
                false,
                false,
                &[],
            ),
            c("Node deleted", deleted, &[], true, false, &[NodeDeleted]),
            c(
                "Node deleted ignored",
                deleted,
                &[NodeDeleted],
                true,
                false,
                &[],
            ),
            c("Node deleted, gate off", deleted, &[], false, false, &[]),
            c(
                "DrainInProgress",
                draining,
                &[],
                true,
                false,
                &[DrainInProgress],
            ),
            c(
                "DrainInProgress ignored",
                draining,
                &[DrainInProgress],
                true,
                false,
                &[],
            ),
            // The gate is KEP-3836's: KEP-5683's conditions have their own opt-outs.
            c(
                "DrainInProgress, gate off",
                draining,
                &[],
                false,
                false,
                &[DrainInProgress],
            ),
            c(
                "GracefulNodeShutdownInProgress",
                stopping,
                &[],
                true,
                false,
                &[GracefulNodeShutdownInProgress],
            ),
            c(
                "GracefulNodeShutdownInProgress ignored",
                stopping,
                &[GracefulNodeShutdownInProgress],
                true,
                false,
                &[],
            ),
            c(
                "GracefulNodeShutdownInProgress, gate off",
                stopping,
                &[],
                false,
                false,
                &[GracefulNodeShutdownInProgress],
            ),
            c("shutdown drain", none, &[], true, true, &[Shutdown]),
            // An ignored Node signal does not hide the shutdown drain, nor another signal.
            c(
                "shutdown, taint ignored",
                taint,
                &[AutoscalerTaint],
                true,
                true,
                &[Shutdown],
            ),
            c(
                "two signals, one ignored",
                |n| {
                    n.to_be_deleted_by_autoscaler = true;
                    n.drain_in_progress = true;
                },
                &[AutoscalerTaint],
                true,
                false,
                &[DrainInProgress],
            ),
            c(
                "every signal",
                |n| {
                    n.to_be_deleted_by_autoscaler = true;
                    n.deleting = true;
                    n.deleted = true;
                    n.drain_in_progress = true;
                    n.graceful_node_shutdown_in_progress = true;
                },
                &[],
                true,
                true,
                &[
                    AutoscalerTaint,
                    DeletionTimestamp,
                    NodeDeleted,
                    DrainInProgress,
                    GracefulNodeShutdownInProgress,
                    Shutdown,
                ],
            ),
        ];
        for c in cases {
            let mut node = Node {
                name: "node-a".into(),
                ..Node::default()
            };
            (c.node)(&mut node);
            let mut state = ClusterState::new();
            state.set_node(Some(node));
            let config = PlanConfig {
                ignored_drain_signals: c.ignore.iter().copied().collect(),
                drain_terminating_nodes: c.gate,
                ..PlanConfig::default()
            };
            let plan = kproxy_core::plan(&state, "node-a", &config);
            let mut h = ProxyHealth::new(at(0));
            h.updated(at(1));
            if c.shutdown {
                h.shut_down(at(2));
            }
            let drain = drain_signals(Some(&plan), &h);
            assert_eq!(drain, c.want, "{}", c.name);
            let healthz = if c.want.is_empty() { 200 } else { 503 };
            for sem in [Semantics::Truthful, Semantics::Upstream] {
                let a = proxy_answer(sem, Probe::Healthz, &h, &drain, &[], at(3), T);
                assert_eq!(a.status, healthz, "{} {sem:?}", c.name);
                let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
                assert_eq!(v["nodeEligible"], c.want.is_empty(), "{}", c.name);
                let l = proxy_answer(sem, Probe::Livez, &h, &drain, &[], at(3), T);
                assert_eq!(l.status, 200, "{}: /livez ignores drains", c.name);
            }
            let a = proxy_answer(
                Semantics::Truthful,
                Probe::Healthz,
                &h,
                &drain,
                &[],
                at(3),
                T,
            );
            let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
            let names: Vec<&str> = c.want.iter().map(|d| d.as_str()).collect();
            assert_eq!(v["drainSignals"], serde_json::json!(names), "{}", c.name);
        }
    }

    /// The shutdown drain: when SIGTERM drains and for how long, counted from the start
    /// of the drain.
    #[test]
    fn shutdown_drain_table() {
        use ShutdownDrain::*;
        let p = Duration::from_secs(26);
        let s = Duration::from_secs;
        #[rustfmt::skip]
        /// (case, mode, period, draining since, now, drain for)
        type Row = (&'static str, ShutdownDrain, Duration, Option<u64>, u64, Option<Duration>);
        let cases: [Row; 10] = [
            (
                "signalled, no signal: kproxy's own restart",
                Signalled,
                p,
                None,
                100,
                None,
            ),
            (
                "signalled, signal just seen",
                Signalled,
                p,
                Some(100),
                100,
                Some(p),
            ),
            (
                "signalled, signal 20 s ago",
                Signalled,
                p,
                Some(80),
                100,
                Some(s(6)),
            ),
            (
                "signalled, drained longer than the period",
                Signalled,
                p,
                Some(10),
                100,
                None,
            ),
            (
                "signalled, drained exactly the period",
                Signalled,
                p,
                Some(74),
                100,
                None,
            ),
            ("always, no signal", Always, p, None, 100, Some(p)),
            (
                "always, signal 20 s ago",
                Always,
                p,
                Some(80),
                100,
                Some(s(6)),
            ),
            ("never, signal just seen", Never, p, Some(100), 100, None),
            ("period 0", Always, Duration::ZERO, None, 100, None),
            (
                "clock went backwards",
                Signalled,
                p,
                Some(200),
                100,
                Some(p),
            ),
        ];
        for (name, mode, period, since, now, want) in cases {
            assert_eq!(
                shutdown_drain(mode, period, since.map(at), at(now)),
                want,
                "{name}"
            );
        }
    }

    /// The drain's start: the first Node signal (or SIGTERM), kept while signals
    /// change, cleared when none is left, never cleared once shutting down.
    #[test]
    fn draining_since_follows_the_signals() {
        let mut h = ProxyHealth::new(at(0));
        h.node_drain(&[], at(1));
        assert_eq!(h.draining_since, None);
        h.node_drain(&[DrainSignal::DrainInProgress], at(2));
        h.node_drain(
            &[DrainSignal::DrainInProgress, DrainSignal::NodeDeleted],
            at(3),
        );
        assert_eq!(h.draining_since, Some(at(2)));
        h.node_drain(&[], at(4));
        assert_eq!(h.draining_since, None, "an uncordoned node is not draining");
        h.node_drain(&[DrainSignal::AutoscalerTaint], at(5));
        h.shut_down(at(6));
        assert_eq!(
            h.draining_since,
            Some(at(5)),
            "SIGTERM keeps the drain's start"
        );
        h.node_drain(&[], at(7));
        assert_eq!(
            h.draining_since,
            Some(at(5)),
            "shutting down drains to the end"
        );
        let mut h = ProxyHealth::new(at(0));
        h.shut_down(at(8));
        assert_eq!(h.draining_since, Some(at(8)));
    }

    /// Truthful: from another process's change to kproxy's tables until the repair, the
    /// node ports say unhealthy, and `/healthz` too while a table is missing; `/livez`
    /// and upstream semantics do not look at the kernel.
    #[test]
    fn kernel_interference_until_repair() {
        use KernelRules::*;
        let now = at(10);
        let mut h = ProxyHealth::new(at(0));
        h.updated(at(5));
        let answers = |h: &ProxyHealth| {
            [Semantics::Truthful, Semantics::Upstream].map(|sem| {
                (
                    proxy_answer(sem, Probe::Healthz, h, &[], &[IpFamily::IPv4], now, T).status,
                    proxy_answer(sem, Probe::Livez, h, &[], &[IpFamily::IPv4], now, T).status,
                    h.service_proxy_healthy(sem, now, T),
                )
            })
        };
        let all_well = [(200, 200, true), (200, 200, true)];
        assert_eq!(answers(&h), all_well);
        h.kernel_changed(false);
        assert_eq!(h.kernel, Altered);
        assert_eq!(answers(&h), [(200, 200, false), (200, 200, true)]);
        h.kernel_changed(true);
        assert_eq!(answers(&h), [(503, 200, false), (200, 200, true)]);
        // A later partial change does not hide the missing table.
        h.kernel_changed(false);
        assert_eq!(h.kernel, TablesMissing);
        let v: serde_json::Value = serde_json::from_str(
            &proxy_answer(Semantics::Truthful, Probe::Healthz, &h, &[], &[], now, T).body,
        )
        .unwrap();
        assert_eq!(v["kernelRules"], "tablesMissing");
        h.kernel_repaired();
        assert_eq!(answers(&h), all_well);
        // A full conntrack table: no new Service connection can be accepted.
        h.conntrack_full = true;
        assert_eq!(answers(&h), [(503, 200, false), (200, 200, true)]);
    }

    #[test]
    fn service_answer_table() {
        let svc = ServiceName::new("a", "b");
        for (n, healthy, status) in [
            (0, true, 503),
            (1, true, 200),
            (18, true, 200),
            (7, false, 503),
            (0, false, 503),
        ] {
            let a = service_answer(&svc, n, healthy);
            assert_eq!(a.status, status, "{n} {healthy}");
            assert_eq!(a.endpoint_weight, Some(n));
            let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
            assert_eq!(
                v,
                serde_json::json!({"service": {"namespace": "a", "name": "b"}, "localEndpoints": n, "serviceProxyHealthy": healthy})
            );
        }
        // Upstream's exact bytes.
        assert_eq!(
            service_answer(&svc, 3, true).body,
            "{\n\t\"service\": {\n\t\t\"namespace\": \"a\",\n\t\t\"name\": \"b\"\n\t},\n\t\"localEndpoints\": 3,\n\t\"serviceProxyHealthy\": true\n}"
        );
    }

    fn fam(family: IpFamily, ips: &[&str], npa: NodePortAddresses) -> FamilyPlan {
        FamilyPlan {
            family,
            node_ips: ips.iter().map(|s| s.parse().unwrap()).collect(),
            node_port_addresses: npa,
            local_pods: kproxy_core::plan::LocalPods::None,
            service_cidrs: Vec::new(),
        }
    }

    #[test]
    fn a_selected_node_address_absent_from_the_host_is_reported_missing() {
        let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
        let local = [LocalAddr {
            ip: ip("10.200.0.2"),
            scope_id: 0,
        }];
        let only = |ips: &[&str]| NodePortAddresses::Only(ips.iter().map(|s| ip(s)).collect());
        let families = [
            fam(
                IpFamily::IPv4,
                &["10.200.0.9"],
                only(&["10.200.0.9", "10.200.0.2"]),
            ),
            fam(IpFamily::IPv6, &[], NodePortAddresses::AllLocal),
        ];
        assert_eq!(
            missing_node_addrs(&families, &local),
            vec![ip("10.200.0.9")]
        );
        // Every selected address present: nothing missing; nothing known: nothing said.
        let present = [fam(IpFamily::IPv4, &["10.200.0.2"], only(&["10.200.0.2"]))];
        assert!(missing_node_addrs(&present, &local).is_empty());
        assert!(missing_node_addrs(&families, &[]).is_empty());
        // Match-all and CIDR selections name no address that could be missing.
        let cidrs = [fam(
            IpFamily::IPv4,
            &["10.200.0.9"],
            NodePortAddresses::Cidrs(vec!["10.0.0.0/8".parse().unwrap()]),
        )];
        assert!(missing_node_addrs(&cidrs, &local).is_empty());
    }

    #[test]
    fn listen_addrs_table() {
        let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
        let local = [
            LocalAddr {
                ip: ip("127.0.0.1"),
                scope_id: 0,
            },
            LocalAddr {
                ip: ip("10.200.0.2"),
                scope_id: 0,
            },
            LocalAddr {
                ip: ip("10.200.0.3"),
                scope_id: 0,
            },
            LocalAddr {
                ip: ip("fd00::2"),
                scope_id: 0,
            },
            LocalAddr {
                ip: ip("fe80::1"),
                scope_id: 7,
            },
        ];
        use NodePortAddresses::*;
        let cases: Vec<(&str, Vec<FamilyPlan>, Vec<&str>)> = vec![
            (
                "nothing known: wildcard both",
                vec![
                    fam(IpFamily::IPv4, &[], AllLocal),
                    fam(IpFamily::IPv6, &[], AllLocal),
                ],
                vec!["0.0.0.0:9", "[::]:9"],
            ),
            (
                "v4-only node: no v6 wildcard",
                vec![
                    fam(IpFamily::IPv4, &["10.200.0.2"], AllLocal),
                    fam(IpFamily::IPv6, &[], AllLocal),
                ],
                vec!["0.0.0.0:9"],
            ),
            (
                "dual-stack all",
                vec![
                    fam(IpFamily::IPv4, &["10.200.0.2"], AllLocal),
                    fam(IpFamily::IPv6, &["fd00::2"], AllLocal),
                ],
                vec!["0.0.0.0:9", "[::]:9"],
            ),
            (
                "primary only",
                vec![
                    fam(
                        IpFamily::IPv4,
                        &["10.200.0.2"],
                        Only(vec![ip("10.200.0.2")]),
                    ),
                    fam(IpFamily::IPv6, &[], AllLocal),
                ],
                vec!["10.200.0.2:9"],
            ),
            (
                "non-local address skipped",
                vec![
                    fam(
                        IpFamily::IPv4,
                        &["10.200.0.2", "192.0.2.1"],
                        Only(vec![ip("10.200.0.2"), ip("192.0.2.1")]),
                    ),
                    fam(IpFamily::IPv6, &[], Only(vec![])),
                ],
                vec!["10.200.0.2:9"],
            ),
            (
                "empty selection: nothing",
                vec![
                    fam(IpFamily::IPv4, &["10.200.0.2"], Only(vec![])),
                    fam(IpFamily::IPv6, &[], Only(vec![])),
                ],
                vec![],
            ),
            (
                "v6 with scope",
                vec![
                    fam(IpFamily::IPv4, &[], Only(vec![])),
                    fam(
                        IpFamily::IPv6,
                        &["fe80::1"],
                        Only(vec![ip("fe80::1"), ip("fd00::2")]),
                    ),
                ],
                vec!["[fd00::2]:9", "[fe80::1%7]:9"],
            ),
        ];
        for (name, fams, want) in cases {
            let got: Vec<String> = listen_addrs(&fams, &local, 9)
                .iter()
                .map(|a| a.to_string())
                .collect();
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn health_check_targets_table() {
        use crate::fixtures::{plan, svc};
        let ab = |ips: &[&str]| plan(&[svc("a", "b", 9376, ips)]);
        let p_a = ab(&["10.244.0.5"]);
        let p_a2 = ab(&["10.244.0.5"]);
        let p_none = ab(&[]);
        let p_ac = ab(&["10.244.0.5", "10.244.0.6"]);
        let p_c = ab(&["10.244.0.6"]);
        let p_term = plan(&[svc("a", "b", 9376, &[]).terminating("10.244.0.5")]);
        let p_moved = plan(&[svc("a", "b", 9377, &["10.244.0.5"])]);
        let empty = plan(&[]);
        // (name, computed, applied, upstream count, truthful count); None = no server.
        type P<'a> = Option<&'a std::sync::Arc<NodePlan>>;
        type Case<'a> = (&'a str, P<'a>, P<'a>, Option<u32>, Option<u32>);
        let cases: Vec<Case> = vec![
            (
                "nothing applied yet: no server",
                Some(&p_a),
                None,
                None,
                None,
            ),
            ("steady state", Some(&p_a), Some(&p_a), Some(1), Some(1)),
            (
                "steady state, equal but not the same Arc",
                Some(&p_a2),
                Some(&p_a),
                Some(1),
                Some(1),
            ),
            (
                "new endpoint computed, not applied",
                Some(&p_ac),
                Some(&p_a),
                Some(1),
                Some(1),
            ),
            (
                "first endpoint computed, not applied",
                Some(&p_a),
                Some(&p_none),
                Some(0),
                Some(0),
            ),
            (
                "endpoint gone, not applied yet",
                Some(&p_none),
                Some(&p_a),
                Some(1),
                Some(0),
            ),
            (
                "endpoint terminating, not applied yet",
                Some(&p_term),
                Some(&p_a),
                Some(1),
                Some(0),
            ),
            (
                "pod replaced on the node, not applied yet",
                Some(&p_c),
                Some(&p_a),
                Some(1),
                Some(0),
            ),
            (
                "one of two gone, not applied yet",
                Some(&p_c),
                Some(&p_ac),
                Some(2),
                Some(1),
            ),
            (
                "service deleted, not applied yet",
                Some(&empty),
                Some(&p_a),
                Some(1),
                Some(0),
            ),
            (
                "port moved, not applied yet: old port stays",
                Some(&p_moved),
                Some(&p_a),
                Some(1),
                Some(1),
            ),
            (
                "service deleted and applied: no server",
                Some(&empty),
                Some(&empty),
                None,
                None,
            ),
        ];
        let name = ServiceName::new("a", "b");
        for (what, computed, applied, up, tr) in cases {
            for (sem, want) in [(Semantics::Upstream, up), (Semantics::Truthful, tr)] {
                let got = health_check_targets(sem, computed.map(|p| &**p), applied.map(|p| &**p));
                let got_n = got.get(&name).map(|t| t.local_endpoints);
                assert_eq!(got_n, want, "{what} ({sem:?})");
                // One Service's target, as the reconciler visits changed Services.
                let one =
                    health_check_target(sem, computed.map(|p| &**p), applied.map(|p| &**p), &name);
                assert_eq!(one.as_ref(), got.get(&name), "{what} ({sem:?}): one by one");
                if let (Some(t), Some(a)) = (got.get(&name), applied) {
                    assert_eq!(
                        t.port,
                        a.health_checks().next().unwrap().health_check_node_port,
                        "{what}: port follows the applied plan"
                    );
                }
            }
        }
    }
}
