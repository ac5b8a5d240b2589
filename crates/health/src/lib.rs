//! kproxy-health: the health servers. One HTTP server per `healthCheckNodePort` of the
//! plan (what steers external load balancers of eTP-Local Services), and the proxy's own
//! `/healthz` and `/livez` on `healthzBindAddress`.
//!
//! Functional core, imperative shell: [`decide`] holds every decision as pure functions
//! of (plans, proxy-health state, now); this module keeps the state and runs a
//! reconciler task that opens, retargets and closes listeners as plans change; [`http`]
//! is the hyper shell with bounded per-connection resources. The sync loop reports to a
//! cheap [`Health`] handle: [`Health::computed`], [`Health::applied`] (each with the
//! planner's `PlanUpdate`, so health keeps its own small view of the plans, moved as
//! `kproxy_core::update` says), and
//! [`Health::sync_failed`]. Semantics (truthful vs upstream) are documented in
//! `docs/health.md`.

#![forbid(unsafe_code)]

pub mod decide;
#[cfg(any(test, feature = "test-util"))]
pub mod fixtures;
pub mod http;
pub mod metrics;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use kproxy_core::NodePlan;
use kproxy_core::model::{IpFamily, ServiceName};
use kproxy_core::plan::{FamilyPlan, NodePortAddresses};
use kproxy_core::planner::PlanUpdate;
use kproxy_core::update::Revisit;
use prometheus_client::registry::Registry;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use decide::{
    Answer, BindFailure, KernelRules, LocalAddr, Probe, ProxyHealth, Semantics, ShutdownDrain,
};
use metrics::{BindLabels, CodeLabel, Metrics, PortLabels, ServiceLabels};

/// Upstream's default `healthzBindAddress`.
pub const DEFAULT_HEALTHZ_BIND_ADDRESS: SocketAddr =
    SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 10256);

/// How long `shutdown` lets in-flight requests finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);
/// Re-evaluation period of port answers for the gauges (staleness changes with time
/// alone) and of local addresses for `nodePortAddresses`.
const TICK: Duration = Duration::from_secs(1);
const RETRY_FIRST: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(10);

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthConfig {
    /// `None`: no `/healthz`, `/livez` server. Default `0.0.0.0:10256`.
    pub healthz_bind_address: Option<SocketAddr>,
    pub semantics: Semantics,
    /// The proxy is unhealthy when a change stays unapplied for 2 × syncPeriod.
    pub sync_period: Duration,
    /// Connections open at once across `/healthz` and every health-check node port
    /// ([`http::ConnectionBudget`]); `None`: only each server's own bound.
    pub connection_budget: Option<usize>,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            healthz_bind_address: Some(DEFAULT_HEALTHZ_BIND_ADDRESS),
            semantics: Semantics::Truthful,
            sync_period: Duration::from_secs(30),
            connection_budget: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HealthError {
    #[error("syncPeriod must be positive (the health timeout is 2 × syncPeriod)")]
    ZeroSyncPeriod,
}

/// Wall clock for health timestamps and staleness; tests inject [`ManualClock`].
pub trait Clock: Send + Sync + 'static {
    fn now(&self) -> SystemTime;
}

pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> SystemTime {
        SystemTime::now()
    }
}

/// A clock that moves only when told to.
pub struct ManualClock(Mutex<SystemTime>);

impl ManualClock {
    pub fn new(t: SystemTime) -> Arc<ManualClock> {
        Arc::new(ManualClock(Mutex::new(t)))
    }

    pub fn set(&self, t: SystemTime) {
        *lock(&self.0) = t;
    }

    pub fn advance(&self, d: Duration) {
        *lock(&self.0) += d;
    }
}

impl Clock for ManualClock {
    fn now(&self) -> SystemTime {
        *lock(&self.0)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks cannot leave the data half-updated in a
    // way that matters more than stopping the health servers would.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

struct Core {
    health: ProxyHealth,
    /// Views of the computed and applied plans ([`decide::follow`]).
    computed: Option<NodePlan>,
    applied: Option<NodePlan>,
    /// What changed in the views since the reconciler last looked, merged
    /// ([`PlanUpdate::merge`]); [`PlanUpdate::WHOLE`] before the first pass. The
    /// reconciler revisits what this says ([`PlanUpdate::revisit`]), so a sync costs
    /// health the change, not every health check.
    changed: PlanUpdate,
}

/// What request handlers and the reconciler share.
struct Shared {
    semantics: Semantics,
    timeout: Duration,
    clock: Arc<dyn Clock>,
    core: Mutex<Core>,
    metrics: Metrics,
    limits: http::Limits,
    budget: Option<Arc<http::ConnectionBudget>>,
}

impl Shared {
    fn proxy_healthy(&self) -> bool {
        let now = self.clock.now();
        lock(&self.core).health.healthy(now, self.timeout)
    }

    /// What the health-check node ports say as `serviceProxyHealthy`.
    fn service_proxy_healthy(&self) -> bool {
        let now = self.clock.now();
        lock(&self.core)
            .health
            .service_proxy_healthy(self.semantics, now, self.timeout)
    }

    fn proxy_answer(&self, probe: Probe) -> Answer {
        let now = self.clock.now();
        let c = lock(&self.core);
        let computed = c.computed.as_ref();
        decide::proxy_answer(
            self.semantics,
            probe,
            &c.health,
            &decide::drain_signals(computed, &c.health),
            &decide::families(computed),
            now,
            self.timeout,
        )
    }

    /// Records the answer a port gave: the gauge, and a transition when it changed.
    fn note_status(&self, check: &CheckState, status: u16) {
        let prev = check.last_status.swap(status, Ordering::Relaxed);
        if prev != status {
            self.metrics
                .port_healthy
                .get_or_create(&PortLabels::of(&check.service, check.port))
                .set(i64::from(status == 200));
            if prev != 0 {
                self.metrics
                    .transitions
                    .get_or_create(&ServiceLabels::of(&check.service))
                    .inc();
            }
        }
    }
}

/// The answer state of one health-check port, read by every request.
struct CheckState {
    service: ServiceName,
    port: u16,
    local_endpoints: AtomicU32,
    /// Last status answered or evaluated (0: none yet).
    last_status: AtomicU16,
}

/// Where one health-check node port listens.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Listening {
    pub port: u16,
    /// Bound and serving.
    pub addrs: Vec<SocketAddr>,
    /// Selected but not bound (being retried with backoff).
    pub failing: Vec<SocketAddr>,
    /// Every address the port should serve but does not, with the reason: the
    /// `failing` ones, and selected node addresses absent from this host.
    pub unbound: Vec<(SocketAddr, BindFailure)>,
    /// The count the port answers with.
    pub local_endpoints: u32,
}

#[derive(Default)]
struct Observed {
    checks: BTreeMap<ServiceName, Listening>,
    healthz: Vec<SocketAddr>,
    /// A healthz address (or its `[::]` companion) is held by another process.
    healthz_in_use: bool,
}

struct Control {
    wake: Notify,
    requested: AtomicU64,
    done: watch::Sender<u64>,
    stop: CancellationToken,
    task: Mutex<Option<JoinHandle<()>>>,
    observed: Mutex<Observed>,
}

/// The health servers' handle: cheap to clone; every method but `start`, `shutdown` and
/// `reconciled` returns at once (work happens on the reconciler task).
#[derive(Clone)]
pub struct Health {
    shared: Arc<Shared>,
    ctl: Arc<Control>,
}

impl Health {
    /// Starts the proxy health server (if configured) and the reconciler; registers the
    /// metrics into `registry`. A `healthzBindAddress` that cannot be bound is logged,
    /// counted and retried in the background, never fatal (as upstream).
    pub async fn start(cfg: HealthConfig, registry: &mut Registry) -> Result<Health, HealthError> {
        Health::start_with_clock(cfg, registry, Arc::new(SystemClock)).await
    }

    /// [`Health::start`] with an injected clock (tests: staleness without sleeping).
    pub async fn start_with_clock(
        cfg: HealthConfig,
        registry: &mut Registry,
        clock: Arc<dyn Clock>,
    ) -> Result<Health, HealthError> {
        Health::start_with(cfg, registry, clock, http::Limits::default()).await
    }

    /// [`Health::start_with_clock`] with other per-server connection limits.
    pub async fn start_with(
        cfg: HealthConfig,
        registry: &mut Registry,
        clock: Arc<dyn Clock>,
        limits: http::Limits,
    ) -> Result<Health, HealthError> {
        if cfg.sync_period.is_zero() {
            return Err(HealthError::ZeroSyncPeriod);
        }
        let now = clock.now();
        let shared = Arc::new(Shared {
            semantics: cfg.semantics,
            timeout: cfg.sync_period.saturating_mul(2),
            clock,
            core: Mutex::new(Core {
                health: ProxyHealth::new(now),
                computed: None,
                applied: None,
                changed: PlanUpdate::WHOLE,
            }),
            metrics: Metrics::default(),
            limits,
            budget: cfg.connection_budget.map(http::ConnectionBudget::new),
        });
        shared.metrics.register(registry);
        let ctl = Arc::new(Control {
            wake: Notify::new(),
            requested: AtomicU64::new(1),
            done: watch::Sender::new(0),
            stop: CancellationToken::new(),
            task: Mutex::new(None),
            observed: Mutex::default(),
        });
        let healthz = cfg.healthz_bind_address.map(|addr| {
            let mut h = HealthzServer::new(addr, &shared);
            h.try_bind_due(&shared);
            h
        });
        if let Some(h) = &healthz {
            let mut o = lock(&ctl.observed);
            o.healthz = h.bound_addrs();
            o.healthz_in_use = h.in_use();
        }
        let task = tokio::spawn(reconcile_loop(shared.clone(), ctl.clone(), healthz));
        *lock(&ctl.task) = Some(task);
        tracing::info!(semantics = cfg.semantics.as_str(), healthz = ?cfg.healthz_bind_address, "health servers started");
        Ok(Health { shared, ctl })
    }

    /// The sync loop has a new computed plan queued (upstream `QueuedUpdate`); `update`
    /// is what the planner changed since the previous one. Node eligibility for
    /// `/healthz` comes from this plan; truthful semantics also stop counting endpoints
    /// this plan no longer has as ready.
    pub fn computed(&self, plan: &NodePlan, update: &PlanUpdate) {
        let now = self.shared.clock.now();
        {
            let mut c = lock(&self.shared.core);
            c.health.queued(now);
            decide::follow(&mut c.computed, plan, update);
            c.health.node_drain(&plan.node_drain_signals, now);
            c.changed.merge(update.clone());
        }
        self.kick();
    }

    /// The dataplane applied this plan successfully (upstream `Updated`, then
    /// `SyncServices`/`SyncEndpoints`): health-check servers follow this plan. `update`
    /// is every change since the previous applied plan (failed syncs in between included).
    pub fn applied(&self, plan: &NodePlan, update: &PlanUpdate) {
        let now = self.shared.clock.now();
        {
            let mut c = lock(&self.shared.core);
            c.health.updated(now);
            decide::follow(&mut c.applied, plan, update);
            c.changed.merge(update.clone());
            if c.computed.is_none() {
                decide::follow(&mut c.computed, plan, &PlanUpdate::WHOLE);
                c.health.node_drain(&plan.node_drain_signals, now);
                c.changed.merge(PlanUpdate::WHOLE);
            }
        }
        self.kick();
    }

    /// [`Health::computed`] for a caller with a whole plan and no delta.
    pub fn plan_computed(&self, plan: &NodePlan) {
        self.computed(plan, &PlanUpdate::WHOLE);
    }

    /// [`Health::applied`] for a caller with a whole plan and no delta.
    pub fn plan_applied(&self, plan: &NodePlan) {
        self.applied(plan, &PlanUpdate::WHOLE);
    }

    /// A change reached the cluster state (upstream `QueuedUpdate`, called where the
    /// change arrives): starts the staleness clock unless an older change is pending, so
    /// a sync loop that stops taking changes turns `/livez` unhealthy after
    /// 2 × syncPeriod even though it never computes a plan.
    pub fn change_queued(&self) {
        let now = self.shared.clock.now();
        lock(&self.shared.core).health.queued(now);
    }

    /// Upstream `QueuedUpdate(family)` for one family only. The daemon syncs both
    /// families together and uses [`Health::computed`]; this exists for upstream's
    /// per-family timelines (`proxy_healthz.json`).
    pub fn family_queued(&self, family: IpFamily) {
        let now = self.shared.clock.now();
        lock(&self.shared.core).health.queued_family(family, now);
    }

    /// Upstream `Updated(family)` for one family only (see [`Health::family_queued`]).
    pub fn family_updated(&self, family: IpFamily) {
        let now = self.shared.clock.now();
        lock(&self.shared.core).health.updated_family(family, now);
    }

    /// A sync failed: the last applied answers stay, and the proxy turns unhealthy once
    /// the oldest unapplied change is 2 × syncPeriod old.
    pub fn sync_failed(&self) {
        let now = self.shared.clock.now();
        lock(&self.shared.core)
            .health
            .failed(now, self.shared.semantics);
        self.kick();
    }

    /// Another process changed kproxy's tables in the kernel (`tables_missing`: deleted
    /// one): truthful health-check node ports answer 503, and `/healthz` too while a
    /// table is missing, until [`Health::kernel_repaired`] (docs/health.md).
    pub fn kernel_changed(&self, tables_missing: bool) {
        lock(&self.shared.core)
            .health
            .kernel_changed(tables_missing);
        self.kick();
    }

    /// Whether the conntrack table is full (truthful: node ports and `/healthz` 503
    /// while it is; docs/health.md).
    pub fn conntrack_full(&self, full: bool) {
        let changed = {
            let mut c = lock(&self.shared.core);
            std::mem::replace(&mut c.health.conntrack_full, full) != full
        };
        if changed {
            self.kick();
        }
    }

    /// kproxy holds its first sync back (`true`): the input is empty or lost objects
    /// while its tables hold Services; truthful `/healthz` answers 503 meanwhile
    /// (docs/health.md).
    pub fn input_held(&self, held: bool) {
        lock(&self.shared.core).health.input_held = held;
        self.kick();
    }

    /// Since when a drain signal has turned `/healthz` to 503, if one does
    /// ([`ProxyHealth::draining_since`]).
    pub fn draining_since(&self) -> Option<SystemTime> {
        lock(&self.shared.core).health.draining_since
    }

    /// SIGTERM with a drain period: `/healthz` answers 503
    /// ([`kproxy_core::model::DrainSignal::Shutdown`])
    /// until the process exits; the health-check node ports keep their answers (their
    /// rules stay and forward).
    pub fn shut_down(&self) {
        let now = self.shared.clock.now();
        lock(&self.shared.core).health.shut_down(now);
        self.kick();
    }

    /// Since when the API source has heard nothing usable from the API server (`None`:
    /// it follows again); truthful `/healthz` says it in its body
    /// (`sourceStalledSince`), leaving the status code to the rules (docs/health.md).
    pub fn source_stalled(&self, since: Option<SystemTime>) {
        lock(&self.shared.core).health.source_stalled_since = since;
    }

    /// kproxy restored its tables after [`Health::kernel_changed`].
    pub fn kernel_repaired(&self) {
        lock(&self.shared.core).health.kernel_repaired();
        self.kick();
    }

    /// The proxy's health as `/livez` reports it now.
    pub fn proxy_healthy(&self) -> bool {
        self.shared.proxy_healthy()
    }

    /// The shared connection budget of the health servers, when configured.
    pub fn connection_budget(&self) -> Option<Arc<http::ConnectionBudget>> {
        self.shared.budget.clone()
    }

    /// Health-check servers as of the last reconcile.
    pub fn listening(&self) -> BTreeMap<ServiceName, Listening> {
        lock(&self.ctl.observed).checks.clone()
    }

    /// The bound `healthzBindAddress` (with the real port when 0 was asked); empty when
    /// disabled or not bound (yet).
    pub fn healthz_addrs(&self) -> Vec<SocketAddr> {
        lock(&self.ctl.observed).healthz.clone()
    }

    /// Whether another process holds one of the `healthzBindAddress` sockets (the
    /// address itself, or the `[::]` companion of `0.0.0.0`): its last bind failed
    /// with "address in use". A kube-proxy holding only `0.0.0.0:10256` left kproxy
    /// serving on `[::]:10256` alone, and the takeover took that for no kube-proxy.
    pub fn healthz_in_use(&self) -> bool {
        lock(&self.ctl.observed).healthz_in_use
    }

    /// Waits until the reconciler has acted on every call made before this one.
    pub async fn reconciled(&self) {
        let want = self.ctl.requested.load(Ordering::SeqCst);
        let mut rx = self.ctl.done.subscribe();
        let _ = rx
            .wait_for(|done| *done >= want || self.ctl.stop.is_cancelled())
            .await;
    }

    /// Closes every listener (in-flight requests get a short grace) and stops the
    /// reconciler. Other clones of the handle become inert.
    pub async fn shutdown(self) {
        self.ctl.stop.cancel();
        let task = lock(&self.ctl.task).take();
        if let Some(t) = task {
            let _ = t.await;
        }
    }

    fn kick(&self) {
        self.ctl.requested.fetch_add(1, Ordering::SeqCst);
        self.ctl.wake.notify_one();
    }
}

#[derive(Clone, Copy, Debug)]
struct Retry {
    attempts: u32,
    next: tokio::time::Instant,
}

impl Retry {
    fn after_failure(prev: Option<Retry>) -> Retry {
        let attempts = prev.map_or(0, |r| r.attempts.saturating_add(1));
        let delay = RETRY_FIRST
            .saturating_mul(1u32 << attempts.min(10))
            .min(RETRY_MAX);
        Retry {
            attempts,
            next: tokio::time::Instant::now() + delay,
        }
    }

    fn due(&self) -> bool {
        tokio::time::Instant::now() >= self.next
    }
}

/// One address of the proxy health server.
struct HealthzSlot {
    want: SocketAddr,
    /// The `[::]` companion of a `0.0.0.0` address: Go's wildcard listen in upstream
    /// accepts IPv6 too. Skipped quietly when the host has no IPv6.
    companion: bool,
    bound: Option<SocketAddr>,
    retry: Option<Retry>,
    unavailable: bool,
    /// The last bind failed: the address is in use.
    in_use: bool,
}

struct HealthzServer {
    server: http::Server,
    slots: Vec<HealthzSlot>,
}

impl HealthzServer {
    fn new(addr: SocketAddr, shared: &Arc<Shared>) -> HealthzServer {
        let s = shared.clone();
        let handler: http::Handler = Arc::new(move |req: &::http::request::Parts| {
            let (probe, family) = match req.uri.path() {
                "/healthz" => (Probe::Healthz, &s.metrics.healthz),
                "/livez" => (Probe::Livez, &s.metrics.livez),
                _ => {
                    return Answer {
                        status: 404,
                        body: r#"{"error":"404 page not found"}"#.into(),
                        endpoint_weight: None,
                    };
                }
            };
            let a = s.proxy_answer(probe);
            family
                .get_or_create(&CodeLabel {
                    code: metrics::code(a.status),
                })
                .inc();
            a
        });
        let slot = |want, companion| HealthzSlot {
            want,
            companion,
            bound: None,
            retry: None,
            unavailable: false,
            in_use: false,
        };
        let mut slots = vec![slot(addr, false)];
        // Port 0 (tests) would give the two sockets different ports: IPv4 only then.
        if addr.ip() == IpAddr::V4(Ipv4Addr::UNSPECIFIED) && addr.port() != 0 {
            slots.push(slot(
                SocketAddr::new(IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED), addr.port()),
                true,
            ));
        }
        HealthzServer {
            server: http::Server::new(handler, shared.limits).with_budget(shared.budget.clone()),
            slots,
        }
    }

    /// Binds every address not bound yet whose retry is due.
    fn try_bind_due(&mut self, shared: &Shared) {
        for slot in &mut self.slots {
            if slot.bound.is_some() || slot.unavailable || slot.retry.is_some_and(|r| !r.due()) {
                continue;
            }
            match http::bind(slot.want) {
                Ok(l) => {
                    slot.bound = Some(l.local_addr().unwrap_or(slot.want));
                    self.server.serve(l);
                    slot.retry = None;
                    slot.in_use = false;
                    tracing::info!(address = %slot.want, "serving /healthz and /livez");
                }
                Err(e) if slot.companion && e.raw_os_error() == Some(libc::EAFNOSUPPORT) => {
                    slot.unavailable = true;
                    tracing::debug!(address = %slot.want, "IPv6 unavailable; /healthz served on IPv4 only");
                }
                Err(e) => {
                    shared.metrics.healthz_bind_failures.inc();
                    slot.in_use = e.kind() == std::io::ErrorKind::AddrInUse;
                    let r = Retry::after_failure(slot.retry);
                    tracing::warn!(address = %slot.want, error = %e, attempt = r.attempts + 1, "cannot bind healthzBindAddress; retrying");
                    slot.retry = Some(r);
                }
            }
        }
    }

    fn in_use(&self) -> bool {
        self.slots.iter().any(|s| s.bound.is_none() && s.in_use)
    }

    fn bound_addrs(&self) -> Vec<SocketAddr> {
        self.slots.iter().filter_map(|s| s.bound).collect()
    }

    fn next_retry(&self) -> Option<tokio::time::Instant> {
        self.slots
            .iter()
            .filter(|s| s.bound.is_none() && !s.unavailable)
            .filter_map(|s| s.retry.map(|r| r.next))
            .min()
    }
}

/// One health-check node port server.
struct Running {
    check: Arc<CheckState>,
    server: http::Server,
    bound: BTreeMap<SocketAddr, http::Listener>,
    failing: BTreeMap<SocketAddr, (Retry, BindFailure)>,
    /// Selected node addresses this host does not have (reported once each).
    missing: BTreeSet<IpAddr>,
}

impl Running {
    fn new(shared: &Arc<Shared>, service: ServiceName, port: u16) -> Running {
        let check = Arc::new(CheckState {
            service,
            port,
            local_endpoints: AtomicU32::new(0),
            last_status: AtomicU16::new(0),
        });
        let (s, c) = (shared.clone(), check.clone());
        // Any path and method get the same answer (upstream ignores the request).
        let handler: http::Handler = Arc::new(move |_req: &::http::request::Parts| {
            let a = decide::service_answer(
                &c.service,
                c.local_endpoints.load(Ordering::Relaxed),
                s.service_proxy_healthy(),
            );
            s.note_status(&c, a.status);
            a
        });
        Running {
            check,
            server: http::Server::new(handler, shared.limits).with_budget(shared.budget.clone()),
            bound: BTreeMap::new(),
            failing: BTreeMap::new(),
            missing: BTreeSet::new(),
        }
    }

    /// Binds what is wanted and due, unbinds what is not wanted any more. `missing`:
    /// node addresses nodePortAddresses selects that are not on this host; each is a
    /// bind failure (logged and counted once when it goes missing), since the load
    /// balancer probing it finds nothing listening.
    async fn converge(&mut self, want: &[SocketAddr], missing: &[IpAddr], shared: &Shared) {
        let labels = PortLabels::of(&self.check.service, self.check.port);
        let failed = |why: &BindFailure| {
            shared
                .metrics
                .bind_failures
                .get_or_create(&BindLabels::of(
                    &self.check.service,
                    self.check.port,
                    why.label(),
                ))
                .inc();
        };
        for ip in missing {
            if self.missing.insert(*ip) {
                failed(&BindFailure::AddressAbsent);
                tracing::warn!(
                    service = %self.check.service, address = %ip, port = self.check.port,
                    "cannot serve health-check node port: the node address is not on this host"
                );
            }
        }
        self.missing.retain(|ip| missing.contains(ip));
        let unwanted: Vec<SocketAddr> = self
            .bound
            .keys()
            .filter(|a| !want.contains(a))
            .copied()
            .collect();
        for a in unwanted {
            if let Some(l) = self.bound.remove(&a) {
                l.close().await;
            }
        }
        self.failing.retain(|a, _| want.contains(a));
        for a in want {
            if self.bound.contains_key(a) || self.failing.get(a).is_some_and(|(r, _)| !r.due()) {
                continue;
            }
            match http::bind(*a) {
                Ok(l) => {
                    self.failing.remove(a);
                    self.bound.insert(*a, self.server.serve(l));
                    tracing::info!(service = %self.check.service, address = %a, "serving health-check node port");
                }
                Err(e) if a.is_ipv6() && e.raw_os_error() == Some(libc::EAFNOSUPPORT) => {
                    // IPv6 is disabled on this host: the family is not served, which
                    // is not a failure to retry.
                    self.failing.remove(a);
                    tracing::debug!(service = %self.check.service, address = %a, "IPv6 unavailable; not listening there");
                }
                Err(e) => {
                    let why = BindFailure::of(&e);
                    failed(&why);
                    let r = Retry::after_failure(self.failing.get(a).map(|(r, _)| *r));
                    // Upstream emits a FailedToStartServiceHealthcheck Event here.
                    tracing::warn!(
                        service = %self.check.service, address = %a, error = %e, reason = why.label(), attempt = r.attempts + 1,
                        "cannot bind health-check node port; retrying"
                    );
                    self.failing.insert(*a, (r, why));
                }
            }
        }
        shared
            .metrics
            .port_listening
            .get_or_create(&labels)
            .set(i64::from(
                self.failing.is_empty() && self.missing.is_empty(),
            ));
    }

    fn next_retry(&self) -> Option<tokio::time::Instant> {
        self.failing.values().map(|(r, _)| r.next).min()
    }

    /// Where this server listens, as [`Health::listening`] reports it.
    fn listening(&self) -> Listening {
        Listening {
            port: self.check.port,
            addrs: self.bound.keys().copied().collect(),
            failing: self.failing.keys().copied().collect(),
            unbound: self.unbound(),
            local_endpoints: self.check.local_endpoints.load(Ordering::Relaxed),
        }
    }

    /// Addresses wanted but not served, with the reason (see [`Listening::unbound`]).
    fn unbound(&self) -> Vec<(SocketAddr, BindFailure)> {
        let missing = self.missing.iter().map(|ip| {
            (
                SocketAddr::new(*ip, self.check.port),
                BindFailure::AddressAbsent,
            )
        });
        let failing = self.failing.iter().map(|(a, (_, why))| (*a, why.clone()));
        missing.chain(failing).collect()
    }

    async fn close(self, shared: &Shared) {
        let labels = PortLabels::of(&self.check.service, self.check.port);
        shared.metrics.port_listening.remove(&labels);
        shared.metrics.port_healthy.remove(&labels);
        for reason in BindFailure::LABELS {
            let labels = BindLabels::of(&self.check.service, self.check.port, reason);
            shared.metrics.bind_failures.remove(&labels);
        }
        tracing::info!(service = %self.check.service, port = self.check.port, "closing health-check node port");
        self.server.close().await;
    }
}

/// The runtime state of the health-check node ports as JSON (what the daemon serves on
/// `/health-check-node-ports` and `kproxy explain --server` reads): per Service, the
/// port, the count it answers with, where it listens, and where it cannot, with why.
pub fn listening_json(listening: &BTreeMap<ServiceName, Listening>) -> serde_json::Value {
    use serde_json::json;
    let ports: Vec<serde_json::Value> = listening
        .iter()
        .map(|(name, l)| {
            json!({
                "service": name.to_string(),
                "port": l.port,
                "localEndpoints": l.local_endpoints,
                "listening": l.addrs.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
                "unbound": l.unbound.iter().map(|(a, why)| json!({
                    "address": a.to_string(),
                    "reason": why.label(),
                    "message": why.to_string(),
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({ "healthCheckNodePorts": ports })
}

/// This host's interface addresses (for `nodePortAddresses` selections).
pub fn local_addresses() -> std::io::Result<Vec<LocalAddr>> {
    let mut out = Vec::new();
    for ifa in nix::ifaddrs::getifaddrs().map_err(std::io::Error::from)? {
        let Some(addr) = ifa.address else { continue };
        if let Some(v4) = addr.as_sockaddr_in() {
            out.push(LocalAddr {
                ip: IpAddr::V4(v4.ip()),
                scope_id: 0,
            });
        } else if let Some(v6) = addr.as_sockaddr_in6() {
            out.push(LocalAddr {
                ip: IpAddr::V6(v6.ip()),
                scope_id: v6.scope_id(),
            });
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// The reconciler task: each pass takes what changed, converges the servers of the
/// Services it visits, and publishes what listens; then it waits for a change, a retry
/// or the tick. On stop it closes every server.
async fn reconcile_loop(shared: Arc<Shared>, ctl: Arc<Control>, healthz: Option<HealthzServer>) {
    let mut r = Reconciler {
        shared,
        ctl,
        healthz,
        running: BTreeMap::new(),
        warned_addrs: false,
        seen: None,
        retrying: BTreeSet::new(),
    };
    loop {
        let generation = r.ctl.requested.load(Ordering::SeqCst);
        let (visit, whole) = r.visits();
        r.converge(&visit, whole).await;
        r.publish(&visit, generation);
        tokio::select! {
            _ = r.ctl.wake.notified() => {}
            _ = tokio::time::sleep_until(r.wake_at()) => {}
            _ = r.ctl.stop.cancelled() => break,
        }
    }
    r.shutdown().await;
}

/// A Service a pass visits, with its target (`None`: no server).
type Visit = (ServiceName, Option<decide::Target>);

/// What the reconciler task keeps between passes.
struct Reconciler {
    shared: Arc<Shared>,
    ctl: Arc<Control>,
    healthz: Option<HealthzServer>,
    running: BTreeMap<ServiceName, Running>,
    warned_addrs: bool,
    /// What the last pass saw besides the plans: when any of it changes, every Service
    /// is revisited; otherwise a pass visits the Services the sync loop reported changed
    /// and those with a bind to retry, so a sync costs health the change, not every
    /// check.
    seen: Option<(Vec<FamilyPlan>, Vec<LocalAddr>, bool)>,
    /// The servers with a bind to retry (visited by every pass, and timing the next one).
    retrying: BTreeSet<ServiceName>,
}

impl Reconciler {
    /// Takes the changes the sync loop reported and reads the node's facts; returns the
    /// Services this pass visits and whether that is every one.
    fn visits(&mut self) -> (Vec<Visit>, bool) {
        let (changed, families) = {
            let mut c = lock(&self.shared.core);
            let changed = std::mem::take(&mut c.changed);
            let families = c
                .applied
                .as_ref()
                .map(|p| p.families.clone())
                .unwrap_or_default();
            (changed, families)
        };
        let revisit = changed.revisit(true);
        let anything = !self.running.is_empty() || !changed.is_empty();
        let local = if anything && needs_local_addresses(&families) {
            self.local_addresses()
        } else {
            Vec::new()
        };
        let now_seen = (families, local, self.shared.service_proxy_healthy());
        let seen_changed = self.seen.as_ref() != Some(&now_seen);
        self.seen = Some(now_seen);
        // What the node's facts or the views say to revisit: everything, or these.
        let only = match revisit {
            Revisit::Services(names) if !seen_changed => Some(names),
            _ => None,
        };
        let whole = only.is_none();

        let shared = &self.shared;
        let c = lock(&shared.core);
        let (computed, applied) = (c.computed.as_ref(), c.applied.as_ref());
        let visit = if let Some(only) = only {
            let mut names: BTreeSet<ServiceName> = only.iter().cloned().collect();
            names.extend(self.retrying.iter().cloned());
            names
                .into_iter()
                .map(|n| {
                    let t = decide::health_check_target(shared.semantics, computed, applied, &n);
                    (n, t)
                })
                .collect()
        } else {
            let targets = decide::health_check_targets(shared.semantics, computed, applied);
            let gone: Vec<Visit> = self
                .running
                .keys()
                .filter(|n| !targets.contains_key(*n))
                .map(|n| (n.clone(), None))
                .collect();
            gone.into_iter()
                .chain(targets.into_iter().map(|(n, t)| (n, Some(t))))
                .collect()
        };
        (visit, whole)
    }

    /// This host's addresses; none (warned once) when they cannot be read.
    fn local_addresses(&mut self) -> Vec<LocalAddr> {
        match local_addresses() {
            Ok(l) => l,
            Err(e) => {
                if !self.warned_addrs {
                    tracing::warn!(error = %e, "cannot read local addresses; health-check ports wait for them");
                    self.warned_addrs = true;
                }
                Vec::new()
            }
        }
    }

    /// Closes, opens and rebinds the servers of the visited Services, and notes which
    /// still have a bind to retry.
    async fn converge(&mut self, visit: &[Visit], whole: bool) {
        let shared = &self.shared;
        // Close what is gone or moved to another port first, so a port handed from
        // one Service to another can be bound in the same pass.
        for (name, t) in visit {
            let moved = |r: &Running| t.as_ref().is_none_or(|t| t.port != r.check.port);
            if self.running.get(name).is_some_and(moved)
                && let Some(r) = self.running.remove(name)
            {
                r.close(shared).await;
            }
        }
        if whole {
            self.retrying.clear();
        }

        let (families, local, proxy_healthy) = self.seen.as_ref().expect("set by visits");
        let missing = decide::missing_node_addrs(families, local);
        for (name, t) in visit {
            let Some(t) = t else { continue };
            let r = self
                .running
                .entry(name.clone())
                .or_insert_with(|| Running::new(shared, name.clone(), t.port));
            r.check
                .local_endpoints
                .store(t.local_endpoints, Ordering::Relaxed);
            let want = decide::listen_addrs(families, local, t.port);
            r.converge(&want, &missing, shared).await;
            let status = decide::service_status(t.local_endpoints, *proxy_healthy);
            shared.note_status(&r.check, status);
        }
        for (name, _) in visit {
            if self
                .running
                .get(name)
                .is_some_and(|r| !r.failing.is_empty())
            {
                self.retrying.insert(name.clone());
            } else {
                self.retrying.remove(name);
            }
        }
        if let Some(h) = self.healthz.as_mut() {
            h.try_bind_due(shared);
        }
    }

    /// Publishes what the visited servers listen on, and that pass `generation` is done.
    fn publish(&self, visit: &[Visit], generation: u64) {
        {
            let mut o = lock(&self.ctl.observed);
            for (name, _) in visit {
                match self.running.get(name) {
                    Some(r) => {
                        o.checks.insert(name.clone(), r.listening());
                    }
                    None => {
                        o.checks.remove(name);
                    }
                }
            }
            o.healthz = self
                .healthz
                .as_ref()
                .map(HealthzServer::bound_addrs)
                .unwrap_or_default();
            o.healthz_in_use = self.healthz.as_ref().is_some_and(HealthzServer::in_use);
        }
        self.ctl.done.send_replace(generation);
    }

    /// The next pass: the earliest bind retry, at the latest one tick from now.
    fn wake_at(&self) -> tokio::time::Instant {
        let next_retry = self
            .retrying
            .iter()
            .filter_map(|n| self.running.get(n)?.next_retry())
            .chain(self.healthz.as_ref().and_then(HealthzServer::next_retry))
            .min();
        let tick = tokio::time::Instant::now() + TICK;
        next_retry.map_or(tick, |r| r.min(tick))
    }

    /// Stops accepting everywhere at once and gives in-flight requests a moment.
    async fn shutdown(mut self) {
        let shared = &self.shared;
        let mut closing: Vec<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>> =
            Vec::new();
        for (_, r) in std::mem::take(&mut self.running) {
            let labels = PortLabels::of(&r.check.service, r.check.port);
            shared.metrics.port_listening.remove(&labels);
            shared.metrics.port_healthy.remove(&labels);
            closing.push(Box::pin(r.server.shutdown(SHUTDOWN_GRACE)));
        }
        if let Some(h) = self.healthz.take() {
            closing.push(Box::pin(h.server.shutdown(SHUTDOWN_GRACE)));
        }
        futures_join_all(closing).await;
        {
            let mut o = lock(&self.ctl.observed);
            o.checks.clear();
            o.healthz.clear();
        }
        self.ctl.done.send_replace(u64::MAX);
        tracing::info!("health servers stopped");
    }
}

/// Whether the node's plan listens on specific addresses (nodePortAddresses), which
/// must then be read from the host.
fn needs_local_addresses(families: &[FamilyPlan]) -> bool {
    families.iter().any(|f| match &f.node_port_addresses {
        NodePortAddresses::Only(v) => !v.is_empty(),
        NodePortAddresses::Cidrs(_) => true,
        NodePortAddresses::AllLocal => false,
    })
}

/// Joins boxed futures concurrently without another dependency.
async fn futures_join_all(
    futs: Vec<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>>,
) {
    let mut set = tokio::task::JoinSet::new();
    for f in futs {
        set.spawn(f);
    }
    while set.join_next().await.is_some() {}
}
