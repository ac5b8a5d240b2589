//! Endpoint categorisation for one service port (docs/upstream-semantics.md §b, upstream
//! `CategorizeEndpoints`): which endpoints Cluster-policy and Local-policy traffic may
//! use, with topology and the serving+terminating fallback.
//!
//! "Usable" means: ready; or, only when no ready endpoint qualifies for that policy,
//! serving and terminating. The fallback is decided separately for Cluster and Local.
//! "Ready" is [`EndpointState::is_ready`]: an endpoint held for warm-up
//! (`crate::warmup`) counts as not ready.

use crate::model::EndpointAddr;
use crate::plan::{EndpointState, TopologyMode};

/// The four outputs of categorisation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Categorized {
    /// `None`: the port never uses Cluster policy. `Some([])`: it does, nothing qualifies.
    pub cluster: Option<Vec<EndpointAddr>>,
    /// `None`: the port never uses Local policy. `Some([])`: it does, nothing qualifies.
    pub local: Option<Vec<EndpointAddr>>,
    /// Union of both lists, sorted.
    pub all_reachable: Vec<EndpointAddr>,
    /// Usable endpoints exist anywhere (false ⇒ REJECT).
    pub has_any: bool,
    pub topology: TopologyMode,
    /// The Local list is the serving+terminating fallback.
    pub local_uses_terminating: bool,
    /// The Cluster list is the serving+terminating fallback.
    pub cluster_uses_terminating: bool,
}

/// Inputs that are not endpoints.
#[derive(Clone, Copy, Debug)]
pub struct Context<'a> {
    pub uses_cluster: bool,
    pub uses_local: bool,
    pub node_name: &'a str,
    /// This node's zone; `None` disables zone hints.
    pub zone: Option<&'a str>,
    pub prefer_same_node_hints: bool,
    pub proxy_terminating_endpoints: bool,
}

fn fallback_candidate(e: &EndpointState, ctx: &Context) -> bool {
    ctx.proxy_terminating_endpoints
        && !e.conditions.ready
        && e.conditions.serving
        && e.conditions.terminating
}

/// Picks the topology mode from the hints of the *ready* endpoints (docs/upstream-semantics.md §b.4).
pub fn topology_mode(endpoints: &[EndpointState], ctx: &Context) -> TopologyMode {
    let mut any_ready = false;
    let (mut all_node_hints, mut for_node) = (true, false);
    let (mut all_zone_hints, mut for_zone) = (true, false);
    for e in endpoints.iter().filter(|e| e.is_ready()) {
        any_ready = true;
        match &e.placement.node_hints {
            Some(h) if !h.is_empty() => for_node |= h.iter().any(|n| n == ctx.node_name),
            _ => all_node_hints = false,
        }
        match &e.placement.zone_hints {
            Some(h) if !h.is_empty() => {
                for_zone |= ctx.zone.is_some_and(|z| h.iter().any(|n| n == z))
            }
            _ => all_zone_hints = false,
        }
    }
    if !any_ready {
        return TopologyMode::None;
    }
    if ctx.prefer_same_node_hints && all_node_hints && for_node {
        return TopologyMode::PreferSameNode;
    }
    match ctx.zone {
        Some(zone) if all_zone_hints && for_zone => TopologyMode::PreferSameZone(zone.to_string()),
        _ => TopologyMode::None,
    }
}

/// Whether a ready endpoint passes the topology filter.
pub fn passes_topology(e: &EndpointState, mode: &TopologyMode, node_name: &str) -> bool {
    match mode {
        TopologyMode::None => true,
        TopologyMode::PreferSameNode => e
            .placement
            .node_hints
            .as_ref()
            .is_some_and(|h| h.iter().any(|n| n == node_name)),
        TopologyMode::PreferSameZone(z) => e
            .placement
            .zone_hints
            .as_ref()
            .is_some_and(|h| h.iter().any(|n| n == z)),
    }
}

/// Categorises the merged endpoints of one service port. `endpoints` must be sorted by
/// address; every output list is too.
pub fn categorize(endpoints: &[EndpointState], ctx: &Context) -> Categorized {
    let mut has_any = false;
    let mut topology = TopologyMode::None;
    let mut cluster_uses_terminating = false;
    let cluster = if ctx.uses_cluster {
        topology = topology_mode(endpoints, ctx);
        let mut list: Vec<EndpointAddr> = endpoints
            .iter()
            .filter(|e| e.is_ready() && passes_topology(e, &topology, ctx.node_name))
            .map(|e| e.addr)
            .collect();
        if list.is_empty() {
            list = endpoints
                .iter()
                .filter(|e| fallback_candidate(e, ctx))
                .map(|e| e.addr)
                .collect();
            cluster_uses_terminating = !list.is_empty();
        }
        has_any |= !list.is_empty();
        Some(list)
    } else {
        None
    };

    let mut local_uses_terminating = false;
    let local = if ctx.uses_local {
        let (mut local_ready, mut local_fallback) = (false, false);
        for e in endpoints {
            if e.is_ready() {
                has_any = true;
                local_ready |= e.is_local;
            } else if fallback_candidate(e, ctx) {
                has_any = true;
                local_fallback |= e.is_local;
            }
        }
        let list: Vec<EndpointAddr> = if local_ready {
            endpoints
                .iter()
                .filter(|e| e.is_local && e.is_ready())
                .map(|e| e.addr)
                .collect()
        } else if local_fallback {
            local_uses_terminating = true;
            endpoints
                .iter()
                .filter(|e| e.is_local && fallback_candidate(e, ctx))
                .map(|e| e.addr)
                .collect()
        } else {
            Vec::new()
        };
        Some(list)
    } else {
        None
    };

    let all_reachable = match (&cluster, &local) {
        (Some(c), None) => c.clone(),
        (None, Some(l)) => l.clone(),
        (None, None) => Vec::new(),
        (Some(c), Some(_)) if topology == TopologyMode::None && !local_uses_terminating => {
            c.clone()
        }
        (Some(c), Some(l)) => {
            let mut all: Vec<EndpointAddr> = c.iter().chain(l.iter()).copied().collect();
            all.sort();
            all.dedup();
            all
        }
    };

    Categorized {
        cluster,
        local,
        all_reachable,
        has_any,
        topology,
        local_uses_terminating,
        cluster_uses_terminating,
    }
}
