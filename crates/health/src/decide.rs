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
mod tests;
