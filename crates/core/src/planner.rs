//! The planner: `ClusterState` + this node + `PlanConfig` → `NodePlan`
//! (docs/upstream-semantics.md §a.4, §b, §c, §d.1). Pure and deterministic: the order
//! in which objects arrived never changes the output. [`Planner`] keeps the last plan and
//! re-plans only the Services that changed; [`plan`] is the same computation from scratch.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

use crate::categorize::Context;
use crate::config::{LocalDetectorConfig, NodePortAddressesConfig, PlanConfig};
use crate::model::{
    DrainSignal, EndpointAddr, EndpointSlice, IpFamily, Node, Protocol, Service, ServiceName,
    ServicePortName, ServiceType, TrafficPolicy,
};
use crate::plan::{
    EndpointSet, EndpointState, FamilyPlan, Firewall, HealthCheck, LocalPods, NodePlan,
    NodePortAddresses, ServicePlan, ServicePortPlan, SourceClass, TrafficRule, Verdict,
};
use crate::state::{Changes, ClusterState};
pub use crate::update::PlanUpdate;
use crate::warmup::{self, Clock, Moment};

/// Plans the whole node from scratch. This node's Node object is read from `state`
/// (it may be absent: no zone, no addresses, eligible).
/// A plan from scratch is a first view of the cluster: it holds no endpoint for warm-up.
pub fn plan(state: &ClusterState, node_name: &str, config: &PlanConfig) -> NodePlan {
    plan_at(state, node_name, config, &Clock::OFF, &BTreeMap::new())
}

/// [`plan`] at `clock`, each Service's holds continued from its plan in `before`.
fn plan_at(
    state: &ClusterState,
    node_name: &str,
    config: &PlanConfig,
    clock: &Clock,
    before: &BTreeMap<ServiceName, Arc<ServicePlan>>,
) -> NodePlan {
    let facts = NodeFacts::new(node_name, state.node(), &state.service_cidrs(), config);
    let services = state
        .services()
        .map(|svc| {
            (
                svc.name.clone(),
                Arc::new(plan_service(
                    svc,
                    state.slices_of(&svc.name),
                    &facts,
                    config,
                    clock,
                    before.get(&svc.name).map(|p| &**p),
                )),
            )
        })
        .collect();
    let mut plan = facts.into_plan(services);
    crate::conflicts::apply(
        &mut plan,
        |n| state.service(n).and_then(|s| s.created),
        |n, family| state.service(n).map(|s| s.cluster_ips.field(family)),
        state.other_node_addresses(),
        config.allow_external_ip_overlap,
    );
    plan
}

/// Holds the current plan and updates it from the changes recorded in a
/// [`ClusterState`], re-planning only the Services that changed (all of them when the
/// Node or the config changed).
#[derive(Clone, Debug)]
pub struct Planner {
    node_name: String,
    config: PlanConfig,
    plan: NodePlan,
    /// Every Service's plan before conflicts are resolved; `plan.services` is this with
    /// the losers' plans replaced (`crate::conflicts`).
    raw: BTreeMap<ServiceName, Arc<ServicePlan>>,
    config_changed: bool,
    /// How many whole re-plans [`Planner::apply`] made ([`Planner::whole_plans`]).
    whole_plans: u64,
    /// The first plan was made: an endpoint seen ready from now on is new
    /// (`crate::warmup`).
    primed: bool,
    /// The clock of the last [`Planner::apply_at`].
    now: Moment,
    /// The earliest warm-up release of every Service whose plan holds an endpoint.
    releases: BTreeMap<ServiceName, Moment>,
    /// Holds begun and ended since [`Planner::take_warmup_events`].
    warmup_events: Vec<warmup::Event>,
}

impl Planner {
    pub fn new(node_name: impl Into<String>, config: PlanConfig) -> Planner {
        let node_name = node_name.into();
        let facts = NodeFacts::new(&node_name, None, &[], &config);
        Planner {
            plan: facts.into_plan(BTreeMap::new()),
            raw: BTreeMap::new(),
            node_name,
            config,
            config_changed: true,
            whole_plans: 0,
            primed: false,
            now: Moment::default(),
            releases: BTreeMap::new(),
            warmup_events: Vec::new(),
        }
    }

    /// When the next warm-up hold ends: the caller re-plans then ([`Planner::apply_at`]
    /// re-plans the Services whose holds are due).
    pub fn next_release(&self) -> Option<Moment> {
        self.releases.values().min().copied()
    }

    /// The Services whose plan holds an endpoint for warm-up now.
    pub fn held_services(&self) -> impl Iterator<Item = &ServiceName> {
        self.releases.keys()
    }

    /// The holds begun and ended since the last call, in the order the re-plans made
    /// them.
    pub fn take_warmup_events(&mut self) -> Vec<warmup::Event> {
        std::mem::take(&mut self.warmup_events)
    }

    /// How many times a change re-planned every Service (the first plan, a Node,
    /// ServiceCIDR, other Nodes' or config change); an endpoint change never does.
    pub fn whole_plans(&self) -> u64 {
        self.whole_plans
    }

    pub fn plan(&self) -> &NodePlan {
        &self.plan
    }

    pub fn config(&self) -> &PlanConfig {
        &self.config
    }

    /// Applies the changes recorded in `state` since the last update.
    pub fn update(&mut self, state: &mut ClusterState) -> PlanUpdate {
        let changes = state.take_changes();
        self.apply(state, changes)
    }

    /// Applies `changes`, taken from `state` (the sync loop takes them through its
    /// read-only view of the store, `kproxy_source::Reader::take`), at the time of the
    /// last [`Planner::apply_at`].
    pub fn apply(&mut self, state: &ClusterState, changes: Changes) -> PlanUpdate {
        self.apply_at(state, changes, self.now)
    }

    /// Applies `changes` at `now` (a clock that never goes back: an earlier `now` counts
    /// as the last one): endpoints that became ready are held for warm-up
    /// (`crate::warmup`), and the Services whose holds are due are re-planned too.
    pub fn apply_at(
        &mut self,
        state: &ClusterState,
        mut changes: Changes,
        now: Moment,
    ) -> PlanUpdate {
        self.now = self.now.max(now);
        let clock = Clock {
            now: self.now,
            period: self.config.endpoint_warmup,
            primed: std::mem::replace(&mut self.primed, true),
        };
        changes.services.extend(
            self.releases
                .iter()
                .filter(|(_, at)| **at <= clock.now)
                .map(|(name, _)| name.clone()),
        );
        // The flag is taken whatever else changed: behind a short-circuiting `||` it
        // outlived the first plan (made for the Node's arrival), and the first endpoint
        // change after it re-planned all Services (60 ms at 10k × 10, on the real API
        // the first change after start).
        let config_changed = std::mem::take(&mut self.config_changed);
        let full = config_changed || changes.node || changes.service_cidrs || changes.other_nodes;
        let facts = NodeFacts::new(
            &self.node_name,
            state.node(),
            &state.service_cidrs(),
            &self.config,
        );
        let mut update = PlanUpdate::default();
        if full {
            self.whole_plans += 1;
            let before = std::mem::take(&mut self.raw);
            let new = plan_at(state, &self.node_name, &self.config, &clock, &before);
            self.raw = new.services.clone();
            for c in &new.conflicts {
                if let Some(svc) = state.service(&c.service) {
                    self.raw.insert(
                        c.service.clone(),
                        Arc::new(plan_service(
                            svc,
                            state.slices_of(&c.service),
                            &facts,
                            &self.config,
                            &clock,
                            before.get(&c.service).map(|p| &**p),
                        )),
                    );
                }
            }
            if clock.holds() || !self.releases.is_empty() {
                let names: BTreeSet<ServiceName> =
                    before.keys().chain(self.raw.keys()).cloned().collect();
                for name in &names {
                    follow_holds(
                        &self.raw,
                        &mut self.releases,
                        &mut self.warmup_events,
                        name,
                        before.get(name).map(|p| &**p),
                        clock.now,
                    );
                }
            }
            update.node = new.zone != self.plan.zone
                || new.node_drain_signals != self.plan.node_drain_signals
                || new.families != self.plan.families;
            // A set, not `Vec::contains`: that was quadratic (30k Services: seconds).
            let changed: BTreeSet<&ServiceName> = self
                .plan
                .services
                .keys()
                .chain(new.services.keys())
                .filter(|name| self.plan.services.get(*name) != new.services.get(*name))
                .collect();
            update.services = changed.into_iter().cloned().collect();
            // Keep the old Arcs of unchanged Services so consumers can diff by pointer.
            let mut merged = new;
            for (name, svc) in &mut merged.services {
                if let Some(old) = self.plan.services.get(name).filter(|old| *old == svc) {
                    *svc = old.clone();
                }
            }
            self.plan = merged;
            return update;
        }
        // Whether any changed Service claims other frontends than before: only then can
        // the conflicts change (an endpoint change, the hot path, never does).
        let mut frontends_changed = false;
        for name in changes.services {
            let new = state.service(&name).map(|svc| {
                Arc::new(plan_service(
                    svc,
                    state.slices_of(&name),
                    &facts,
                    &self.config,
                    &clock,
                    self.raw.get(&name).map(|p| &**p),
                ))
            });
            let before = self.raw.get(&name).cloned();
            let claims = |p: Option<&Arc<ServicePlan>>| -> Vec<crate::frontend::Frontend> {
                p.into_iter()
                    .flat_map(|p| crate::conflicts::service_frontends(p))
                    .collect()
            };
            frontends_changed |= claims(self.raw.get(&name)) != claims(new.as_ref());
            match (self.raw.entry(name.clone()), new) {
                (Entry::Occupied(mut o), Some(new)) => {
                    if **o.get() != *new {
                        o.insert(new);
                        update.services.push(name.clone());
                    }
                }
                (Entry::Occupied(o), None) => {
                    o.remove();
                    update.services.push(name.clone());
                }
                (Entry::Vacant(v), Some(new)) => {
                    v.insert(new);
                    update.services.push(name.clone());
                }
                (Entry::Vacant(_), None) => {}
            }
            if clock.holds() || self.releases.contains_key(&name) {
                follow_holds(
                    &self.raw,
                    &mut self.releases,
                    &mut self.warmup_events,
                    &name,
                    before.as_deref(),
                    clock.now,
                );
            }
        }
        if frontends_changed {
            self.resolve_conflicts(state, &mut update);
        } else {
            self.reapply_conflicts(&mut update);
        }
        update
    }

    /// The conflicts are as before: the changed Services' plans are their raw plans with
    /// their known conflicts applied. O(changed Services).
    fn reapply_conflicts(&mut self, update: &mut PlanUpdate) {
        let mut changed = Vec::with_capacity(update.services.len());
        for name in update.services.drain(..) {
            let new = self
                .raw
                .get(&name)
                .map(|raw| crate::conflicts::patch(raw, &self.plan.conflicts));
            let differs = match (self.plan.services.get(&name), &new) {
                (Some(old), Some(new)) => old != new,
                (None, None) => false,
                _ => true,
            };
            match new {
                Some(new) if differs => {
                    self.plan.services.insert(name.clone(), new);
                }
                Some(_) => {}
                None => {
                    self.plan.services.remove(&name);
                }
            }
            if differs {
                changed.push(name);
            }
        }
        update.services = changed;
    }

    /// Rebuilds `plan.services` from `raw` with conflicts resolved, adding to `update`
    /// every Service whose resolved plan changed (a conflict won or lost elsewhere
    /// changes a Service that did not change itself).
    fn resolve_conflicts(&mut self, state: &ClusterState, update: &mut PlanUpdate) {
        let reserved = crate::conflicts::Reserved::of(&self.plan, state.other_node_addresses());
        let field = |n: &ServiceName, family| state.service(n).map(|s| s.cluster_ips.field(family));
        let (conflicts, patched) = crate::conflicts::resolve(
            &self.raw,
            |n| state.service(n).and_then(|s| s.created),
            field,
            &reserved,
            self.config.allow_external_ip_overlap,
        );
        let mut touched: BTreeSet<ServiceName> = update.services.drain(..).collect();
        touched.extend(self.plan.conflicts.iter().map(|c| c.service.clone()));
        touched.extend(conflicts.iter().map(|c| c.service.clone()));
        for name in touched {
            let new = patched.get(&name).or_else(|| self.raw.get(&name)).cloned();
            let changed = match (self.plan.services.get(&name), &new) {
                (Some(old), Some(new)) => old != new,
                (None, None) => false,
                _ => true,
            };
            match new {
                Some(new) if changed => {
                    self.plan.services.insert(name.clone(), new);
                }
                Some(_) => {}
                None => {
                    self.plan.services.remove(&name);
                }
            }
            if changed {
                update.services.push(name);
            }
        }
        self.plan.conflicts = conflicts;
        self.plan.cluster_ip_warnings =
            crate::conflicts::cluster_ip_warnings(&self.plan.services, field, &reserved);
    }
}

/// Records what changed in `name`'s holds since `before` (its previous raw plan, `raw`
/// holding the new one): the events, and when its next hold ends.
fn follow_holds(
    raw: &BTreeMap<ServiceName, Arc<ServicePlan>>,
    releases: &mut BTreeMap<ServiceName, Moment>,
    events: &mut Vec<warmup::Event>,
    name: &ServiceName,
    before: Option<&ServicePlan>,
    now: Moment,
) {
    let after = raw.get(name).map(|p| &**p);
    warmup::events(name, before, after, now, events);
    match after.and_then(warmup::next_release) {
        Some(at) => {
            releases.insert(name.clone(), at);
        }
        None => {
            releases.remove(name);
        }
    }
}

/// Node-level facts every Service's plan depends on.
struct NodeFacts<'a> {
    name: &'a str,
    zone: Option<String>,
    drain_signals: Vec<DrainSignal>,
    families: Vec<FamilyPlan>,
    primary: BTreeMap<IpFamily, IpAddr>,
}

impl<'a> NodeFacts<'a> {
    /// `object_cidrs`: the union of the state's ServiceCIDR objects; the planned
    /// `service_cidrs` are that plus `config.service_cidrs` (a union: either source alone
    /// names ranges no Service may be reached in, so neither overrides the other).
    fn new(
        name: &'a str,
        node: Option<&Node>,
        object_cidrs: &[IpNet],
        config: &PlanConfig,
    ) -> NodeFacts<'a> {
        let all_cidrs: Vec<IpNet> = {
            let set: BTreeSet<IpNet> = config
                .service_cidrs
                .iter()
                .chain(object_cidrs)
                .map(|n| n.trunc())
                .collect();
            set.into_iter().collect()
        };
        let node_addrs: Vec<IpAddr> = if config.node_ips.is_empty() {
            node.map(|n| n.addresses.clone()).unwrap_or_default()
        } else {
            config.node_ips.clone()
        };
        let mut primary = BTreeMap::new();
        let families = IpFamily::ALL
            .into_iter()
            .map(|family| {
                let node_ips: Vec<IpAddr> = node_addrs
                    .iter()
                    .copied()
                    .filter(|ip| family.contains(ip))
                    .collect();
                let prim = node
                    .and_then(|n| n.primary_ip(family))
                    .or_else(|| node_ips.first().copied());
                if let Some(p) = prim {
                    primary.insert(family, p);
                }
                let node_port_addresses = match &config.node_port_addresses {
                    // Without any known address, "primary" cannot be resolved; serving
                    // NodePorts on every local address is what an operator expects then.
                    NodePortAddressesConfig::Primary => match prim {
                        Some(p) => NodePortAddresses::Only(vec![p]),
                        None => NodePortAddresses::AllLocal,
                    },
                    // Upstream NewNodePortAddresses: no CIDR of this family, or a
                    // zero CIDR among them, means every local address of the family.
                    NodePortAddressesConfig::Cidrs(cidrs) => {
                        let fam: Vec<IpNet> = cidrs
                            .iter()
                            .filter(|c| family.contains(&c.addr()))
                            .map(|c| c.trunc())
                            .collect();
                        if fam.is_empty() || fam.iter().any(|c| c.prefix_len() == 0) {
                            NodePortAddresses::AllLocal
                        } else {
                            NodePortAddresses::Cidrs(fam)
                        }
                    }
                };
                let of_family = |nets: &[IpNet]| -> Vec<IpNet> {
                    nets.iter()
                        .copied()
                        .filter(|n| family.contains(&n.addr()))
                        .collect()
                };
                let local_pods = match &config.local_detector {
                    LocalDetectorConfig::None => LocalPods::None,
                    LocalDetectorConfig::ClusterCidr(c) => cidrs_or_none(of_family(c)),
                    LocalDetectorConfig::NodeCidr => {
                        cidrs_or_none(of_family(node.map(|n| &n.pod_cidrs[..]).unwrap_or(&[])))
                    }
                    LocalDetectorConfig::InterfaceNamePrefix(p) => {
                        LocalPods::InterfacePrefix(p.clone())
                    }
                    LocalDetectorConfig::BridgeInterface(b) => LocalPods::Bridge(b.clone()),
                };
                FamilyPlan {
                    family,
                    node_ips,
                    node_port_addresses,
                    local_pods,
                    service_cidrs: of_family(&all_cidrs),
                }
            })
            .collect();
        NodeFacts {
            name,
            zone: node.and_then(|n| n.zone.clone()),
            drain_signals: node
                .map(|n| n.drain_signals().filter(|s| config.counts(*s)).collect())
                .unwrap_or_default(),
            families,
            primary,
        }
    }

    fn has_local_pod_detector(&self, family: IpFamily) -> bool {
        self.families
            .iter()
            .any(|f| f.family == family && f.local_pods != LocalPods::None)
    }

    fn into_plan(self, services: BTreeMap<ServiceName, Arc<ServicePlan>>) -> NodePlan {
        NodePlan {
            node: self.name.to_string(),
            zone: self.zone,
            node_eligible: self.drain_signals.is_empty(),
            node_drain_signals: self.drain_signals,
            families: self.families,
            services,
            conflicts: Vec::new(),
            cluster_ip_warnings: Vec::new(),
        }
    }
}

fn cidrs_or_none(c: Vec<IpNet>) -> LocalPods {
    if c.is_empty() {
        LocalPods::None
    } else {
        LocalPods::Cidrs(c)
    }
}

/// Merges a Service's slices of one family per (port name, protocol) into sorted
/// endpoint lists (docs/upstream-semantics.md §a.4). When the same `ip:port` appears twice, a
/// non-terminating copy beats a terminating one, then a ready copy beats a not-ready
/// one, then a local copy beats a remote one; a full tie keeps the copy from the slice
/// whose name sorts first (upstream leaves that case to map order).
pub fn merge_endpoints<'a>(
    slices: impl Iterator<Item = &'a Arc<EndpointSlice>>,
    family: IpFamily,
    node_name: &str,
) -> BTreeMap<(&'a str, Protocol), Vec<EndpointState>> {
    let mut by_port: BTreeMap<(&'a str, Protocol), Vec<EndpointState>> = BTreeMap::new();
    for slice in slices.filter(|s| s.family == family) {
        for port in &slice.ports {
            let list = by_port
                .entry((port.name.as_str(), port.protocol))
                .or_default();
            list.reserve(slice.endpoints.len());
            for e in &slice.endpoints {
                let is_local =
                    !node_name.is_empty() && e.placement.node_name.as_deref() == Some(node_name);
                list.push(EndpointState {
                    addr: EndpointAddr::new(e.ip, port.port),
                    is_local,
                    conditions: e.conditions,
                    placement: e.placement.clone(),
                    warmup: None,
                });
            }
        }
    }
    for list in by_port.values_mut() {
        // Stable sort keeps slice order among equal addresses, so the tie-break is
        // "first slice by name".
        list.sort_by(|a, b| a.addr.cmp(&b.addr).then_with(|| rank(b).cmp(&rank(a))));
        list.dedup_by(|later, earlier| later.addr == earlier.addr);
    }
    by_port
}

fn rank(e: &EndpointState) -> (bool, bool, bool) {
    (!e.conditions.terminating, e.conditions.ready, e.is_local)
}

/// Plans one Service: every port, for every family that has a cluster IP.
fn plan_service<'a>(
    svc: &Service,
    slices: impl Iterator<Item = &'a Arc<EndpointSlice>> + Clone,
    facts: &NodeFacts,
    config: &PlanConfig,
    clock: &Clock,
    before: Option<&ServicePlan>,
) -> ServicePlan {
    // Exact capacity: a pushed Vec would keep room for 4 ports of 344 bytes each, 10 MiB
    // of a 10k-Service plan.
    let mut ports = Vec::with_capacity(svc.cluster_ips.len() * svc.ports.len());
    let mut local_ready = Vec::new();
    let externally_accessible_service = matches!(
        svc.service_type,
        ServiceType::NodePort | ServiceType::LoadBalancer
    ) || !svc.external_ips.is_empty();
    let etp = if externally_accessible_service {
        svc.external_traffic_policy
    } else {
        TrafficPolicy::Cluster
    };
    for (family, cluster_ip) in svc.cluster_ips.iter() {
        let mut merged = merge_endpoints(slices.clone(), family, facts.name);
        let first = ports.len();
        for sp in &svc.ports {
            // Service ports are unique per (name, protocol), so each list is taken once.
            let endpoints = merged
                .remove(&(sp.name.as_str(), sp.protocol))
                .unwrap_or_default();
            let before = before.and_then(|b| b.port(&sp.name, sp.protocol, family));
            ports.push(plan_port(
                svc,
                sp,
                (family, cluster_ip),
                etp,
                (endpoints, before),
                facts,
                config,
                clock,
            ));
        }
        // Every port's endpoints as planned (held ones not ready), and those of the
        // slices' ports the Service does not name.
        local_ready.push(crate::plan::local_ready_ips(
            ports[first..]
                .iter()
                .flat_map(|p: &ServicePortPlan| &p.endpoints)
                .chain(merged.values().flatten()),
        ));
    }
    ports.sort_by(|a, b| {
        (&a.service_port.port_name, a.protocol, a.family).cmp(&(
            &b.service_port.port_name,
            b.protocol,
            b.family,
        ))
    });
    let health_check = match (
        svc.service_type,
        svc.external_traffic_policy,
        svc.health_check_node_port,
    ) {
        (ServiceType::LoadBalancer, TrafficPolicy::Local, Some(port)) => Some(HealthCheck {
            service: svc.name.clone(),
            health_check_node_port: port,
            local_endpoints: crate::plan::local_ready_count(local_ready),
        }),
        _ => None,
    };
    ServicePlan {
        service: svc.name.clone(),
        ports,
        health_check,
    }
}

#[allow(clippy::too_many_arguments)]
fn plan_port(
    svc: &Service,
    sp: &crate::model::ServicePort,
    (family, cluster_ip): (IpFamily, IpAddr),
    etp: TrafficPolicy,
    (mut endpoints, before): (Vec<EndpointState>, Option<&ServicePortPlan>),
    facts: &NodeFacts,
    config: &PlanConfig,
    clock: &Clock,
) -> ServicePortPlan {
    let external_ips: Vec<IpAddr> = svc
        .external_ips
        .iter()
        .copied()
        .filter(|ip| family.contains(ip))
        .collect();
    let load_balancer_ips: Vec<IpAddr> = svc
        .load_balancer_ips
        .iter()
        .copied()
        .filter(|ip| family.contains(ip))
        .collect();
    let node_port = sp.node_port;
    let ext_acc = node_port.is_some() || !external_ips.is_empty() || !load_balancer_ips.is_empty();
    let itp = svc.internal_traffic_policy;
    let ctx = Context {
        uses_cluster: itp != TrafficPolicy::Local || ext_acc,
        uses_local: itp == TrafficPolicy::Local || (etp == TrafficPolicy::Local && ext_acc),
        node_name: facts.name,
        zone: facts.zone.as_deref(),
        prefer_same_node_hints: config.prefer_same_node_hints,
        proxy_terminating_endpoints: config.proxy_terminating_endpoints,
    };
    let cat = warmup::hold_and_categorize(&mut endpoints, before, clock, &ctx);
    let detector = facts.has_local_pod_detector(family);

    let nonempty = |set: EndpointSet| match set {
        EndpointSet::Cluster => cat.cluster.as_ref().is_some_and(|l| !l.is_empty()),
        EndpointSet::Local => cat.local.as_ref().is_some_and(|l| !l.is_empty()),
    };
    let none_verdict = if cat.has_any {
        Verdict::Drop
    } else {
        Verdict::Reject
    };
    let forward = |set: EndpointSet, masquerade: bool| {
        if nonempty(set) {
            Verdict::Forward {
                endpoints: set,
                masquerade,
            }
        } else {
            none_verdict
        }
    };
    let rule = |from, verdict| TrafficRule { from, verdict };

    // Internal (cluster IP) traffic: docs/upstream-semantics.md §c.1.
    let internal_set = if itp == TrafficPolicy::Local {
        EndpointSet::Local
    } else {
        EndpointSet::Cluster
    };
    let internal = if !nonempty(internal_set) {
        vec![rule(SourceClass::Any, none_verdict)]
    } else if config.masquerade_all {
        vec![rule(SourceClass::Any, forward(internal_set, true))]
    } else if detector {
        vec![
            rule(SourceClass::LocalPod, forward(internal_set, false)),
            rule(SourceClass::Any, forward(internal_set, true)),
        ]
    } else {
        vec![rule(SourceClass::Any, forward(internal_set, false))]
    };

    // External (NodePort, external IP, LB IP) traffic: docs/upstream-semantics.md §c.2, §c.3.
    let external = if !ext_acc {
        Vec::new()
    } else if !cat.has_any {
        vec![rule(SourceClass::Any, Verdict::Reject)]
    } else if etp == TrafficPolicy::Cluster {
        vec![rule(SourceClass::Any, forward(EndpointSet::Cluster, true))]
    } else {
        let mut rules = Vec::new();
        // The local-pod short-circuit is never masqueraded, masqueradeAll or not:
        // upstream's masqueradeAll rule matches the cluster IP only.
        if detector {
            rules.push(rule(
                SourceClass::LocalPod,
                forward(EndpointSet::Cluster, false),
            ));
        }
        rules.push(rule(
            SourceClass::ThisNode,
            forward(EndpointSet::Cluster, true),
        ));
        rules.push(rule(SourceClass::Any, forward(EndpointSet::Local, false)));
        rules
    };

    // Source ranges: LB IPs only (docs/upstream-semantics.md §c.5).
    let ranges: Vec<IpNet> = svc
        .load_balancer_source_ranges
        .iter()
        .copied()
        .filter(|n| family.contains(&n.addr()))
        .collect();
    let firewall = if load_balancer_ips.is_empty() || ranges.is_empty() {
        None
    } else {
        let mut allowed_sources = ranges.clone();
        if facts
            .primary
            .get(&family)
            .is_some_and(|p| ranges.iter().any(|r| r.contains(p)))
        {
            allowed_sources.extend(load_balancer_ips.iter().map(|ip| IpNet::from(*ip)));
        }
        Some(Firewall { allowed_sources })
    };

    ServicePortPlan {
        service_port: ServicePortName {
            service: svc.name.clone(),
            port_name: sp.name.clone(),
            protocol: sp.protocol,
        },
        family,
        protocol: sp.protocol,
        port: sp.port,
        cluster_ip,
        node_port,
        external_ips,
        load_balancer_ips,
        firewall,
        internal_traffic_policy: itp,
        external_traffic_policy: etp,
        session_affinity_timeout: svc.session_affinity_timeout,
        topology: cat.topology,
        cluster_endpoints: cat.cluster,
        local_endpoints: cat.local,
        all_reachable_endpoints: cat.all_reachable,
        has_any_endpoints: cat.has_any,
        cluster_uses_terminating: cat.cluster_uses_terminating,
        local_uses_terminating: cat.local_uses_terminating,
        internal,
        external,
        endpoints,
    }
}
