//! `ClusterState`: the one store of validated Services, EndpointSlices and this node's
//! Node, keyed like the API. It has a single writer (the source that feeds it) and
//! remembers which Services changed since the planner last looked, so a change
//! re-plans only what it touched.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

use crate::ingest::{self, IngestError, Kind, Ownership, ServiceOutcome, SliceOutcome};
use crate::manifest::Object;
use crate::model::{EndpointSlice, Node, Service, ServiceCidr, ServiceName};

/// What changed since the last [`ClusterState::take_changes`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Services whose Service object or EndpointSlices changed (including deletions).
    pub services: BTreeSet<ServiceName>,
    /// The Node changed (labels, addresses, pod CIDRs, deletion, taints).
    pub node: bool,
    /// The set of ServiceCIDR objects changed (every family's `service_cidrs` may differ:
    /// a full re-plan, like a Node change).
    pub service_cidrs: bool,
    /// Another node's addresses changed (no cluster IP may take them: a full re-plan).
    pub other_nodes: bool,
    /// Service objects added, changed or removed (upstream counts these for
    /// `sync_proxy_rules_service_changes_total`).
    pub service_events: u64,
    /// EndpointSlices added, changed or removed (`..._endpoint_changes_total`).
    pub slice_events: u64,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.services.is_empty() && !self.node && !self.service_cidrs && !self.other_nodes
    }
}

/// What applying one object does to a [`ClusterState`], computed from the object alone
/// (pure), so a source can keep it instead of the object and apply it again later: the
/// ingested Service or slice is shared by `Arc` with every state it is applied to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Update {
    Service(Arc<Service>),
    /// A valid Service that is not proxied: removes any earlier version.
    DeleteService(ServiceName),
    Slice(Arc<EndpointSlice>),
    /// A valid slice that is not used: removes any earlier version.
    DeleteSlice {
        namespace: String,
        name: String,
    },
    /// This node's Node (boxed: sources keep every file's updates, and this variant
    /// would make each of them as large as a Node).
    Node(Box<Node>),
    /// A ServiceCIDR object.
    ServiceCidr(ServiceCidr),
    /// Another node's Node: only its addresses matter here (no cluster IP may be one,
    /// `crate::conflicts`).
    OtherNode {
        name: String,
        addresses: Vec<IpAddr>,
    },
}

impl Update {
    /// Ingests `obj` (see [`ClusterState::apply`]): the update and the warnings about
    /// dropped pieces, or the error that makes the object skipped.
    pub fn of(
        obj: &Object,
        ownership: &Ownership,
        node_name: &str,
    ) -> Result<(Update, Vec<IngestError>), IngestError> {
        Ok(match obj {
            Object::Service(svc) => match ingest::service(svc, ownership)? {
                ServiceOutcome::Proxied(i) => (Update::Service(Arc::new(i.value)), i.warnings),
                ServiceOutcome::NotProxied(name, _) => (Update::DeleteService(name), Vec::new()),
            },
            Object::EndpointSlice(slice) => match ingest::endpoint_slice(slice, ownership)? {
                SliceOutcome::Used(i) => (Update::Slice(Arc::new(i.value)), i.warnings),
                SliceOutcome::Ignored {
                    namespace, name, ..
                } => (Update::DeleteSlice { namespace, name }, Vec::new()),
            },
            Object::Node(n) => {
                let i = ingest::node(n)?;
                if i.value.name != node_name {
                    let Node {
                        name, addresses, ..
                    } = i.value;
                    return Ok((Update::OtherNode { name, addresses }, i.warnings));
                }
                (Update::Node(Box::new(i.value)), i.warnings)
            }
            Object::ServiceCidr(c) => {
                let i = ingest::service_cidr(c)?;
                (Update::ServiceCidr(i.value), i.warnings)
            }
        })
    }
}

/// The slices of one Service, sorted by slice name. Most Services have one slice, for
/// which a sorted `Vec` is one 8-byte allocation where a `BTreeMap` is a 360-byte
/// node (3.4 MiB at 10k Services).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct ServiceSlices(Vec<Arc<EndpointSlice>>);

impl ServiceSlices {
    fn find(&self, name: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|s| s.name.as_str().cmp(name))
    }

    fn get(&self, name: &str) -> Option<&Arc<EndpointSlice>> {
        self.find(name).ok().map(|i| &self.0[i])
    }

    fn insert(&mut self, slice: Arc<EndpointSlice>) {
        match self.find(&slice.name) {
            Ok(i) => self.0[i] = slice,
            Err(i) => self.0.insert(i, slice),
        }
    }

    fn remove(&mut self, name: &str) {
        if let Ok(i) = self.find(name) {
            self.0.remove(i);
        }
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[derive(Clone, Debug, Default)]
pub struct ClusterState {
    services: BTreeMap<ServiceName, Arc<Service>>,
    /// Slices by the Service they belong to, then by slice name.
    slices: BTreeMap<ServiceName, ServiceSlices>,
    /// (namespace, slice name) → owning Service, so a delete by name (or a slice whose
    /// service-name label changed) finds its old owner.
    slice_owner: BTreeMap<(String, String), ServiceName>,
    node: Option<Node>,
    /// ServiceCIDR objects by name (cluster-scoped).
    service_cidrs: BTreeMap<String, ServiceCidr>,
    /// Other nodes' addresses, by Node name (what the input holds: manifests list
    /// every Node; the API source watches this node's alone).
    other_nodes: BTreeMap<String, Vec<IpAddr>>,
    changes: Changes,
}

impl ClusterState {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn service(&self, name: &ServiceName) -> Option<&Arc<Service>> {
        self.services.get(name)
    }

    pub fn services(&self) -> impl Iterator<Item = &Arc<Service>> {
        self.services.values()
    }

    pub fn service_count(&self) -> usize {
        self.services.len()
    }

    /// The slices of one Service, in slice-name order.
    pub fn slices_of(
        &self,
        name: &ServiceName,
    ) -> impl Iterator<Item = &Arc<EndpointSlice>> + Clone {
        self.slices.get(name).into_iter().flat_map(|m| m.0.iter())
    }

    /// Every Service name that has slices (whether or not the Service is known).
    pub fn services_with_slices(&self) -> impl Iterator<Item = &ServiceName> {
        self.slices.keys()
    }

    pub fn slice_count(&self) -> usize {
        self.slice_owner.len()
    }

    pub fn node(&self) -> Option<&Node> {
        self.node.as_ref()
    }

    /// The ServiceCIDR objects, by name.
    pub fn service_cidr_objects(&self) -> impl Iterator<Item = &ServiceCidr> {
        self.service_cidrs.values()
    }

    /// The union of every ServiceCIDR object's CIDRs, sorted and deduplicated.
    pub fn service_cidrs(&self) -> Vec<IpNet> {
        let set: BTreeSet<IpNet> = self
            .service_cidrs
            .values()
            .flat_map(|c| c.cidrs.iter().map(|n| n.trunc()))
            .collect();
        set.into_iter().collect()
    }

    /// Every other node's address, with the Node it belongs to (the first by name when
    /// two list the same).
    pub fn other_node_addresses(&self) -> BTreeMap<IpAddr, String> {
        let mut out = BTreeMap::new();
        for (name, addresses) in &self.other_nodes {
            for ip in addresses {
                out.entry(*ip).or_insert_with(|| name.clone());
            }
        }
        out
    }

    /// Sets another node's addresses. Returns whether anything changed.
    pub fn upsert_other_node(&mut self, name: &str, addresses: &[IpAddr]) -> bool {
        if self.other_nodes.get(name).map(Vec::as_slice) == Some(addresses) {
            return false;
        }
        self.other_nodes
            .insert(name.to_string(), addresses.to_vec());
        self.changes.other_nodes = true;
        true
    }

    /// Inserts or replaces a ServiceCIDR object. Returns whether anything changed.
    pub fn upsert_service_cidr(&mut self, cidr: ServiceCidr) -> bool {
        if self.service_cidrs.get(&cidr.name) == Some(&cidr) {
            return false;
        }
        self.service_cidrs.insert(cidr.name.clone(), cidr);
        self.changes.service_cidrs = true;
        true
    }

    pub fn delete_service_cidr(&mut self, name: &str) -> bool {
        if self.service_cidrs.remove(name).is_some() {
            self.changes.service_cidrs = true;
            true
        } else {
            false
        }
    }

    /// Inserts or replaces a Service. Returns whether anything changed.
    pub fn upsert_service(&mut self, svc: impl Into<Arc<Service>>) -> bool {
        let svc = svc.into();
        if self.services.get(&svc.name).is_some_and(|old| *old == svc) {
            return false;
        }
        self.changes.services.insert(svc.name.clone());
        self.changes.service_events += 1;
        self.services.insert(svc.name.clone(), svc);
        true
    }

    pub fn delete_service(&mut self, name: &ServiceName) -> bool {
        if self.services.remove(name).is_some() {
            self.changes.services.insert(name.clone());
            self.changes.service_events += 1;
            true
        } else {
            false
        }
    }

    /// Inserts or replaces an EndpointSlice. Re-applying an identical slice is a no-op.
    pub fn upsert_slice(&mut self, slice: impl Into<Arc<EndpointSlice>>) -> bool {
        let slice = slice.into();
        let key = (slice.service.namespace.to_string(), slice.name.clone());
        if let Some(old_owner) = self.slice_owner.get(&key) {
            if *old_owner != slice.service {
                let old_owner = old_owner.clone();
                self.delete_slice(&key.0, &key.1);
                debug_assert!(
                    !self.slice_owner.contains_key(&key),
                    "{old_owner} still owns the slice"
                );
            } else if self
                .slices
                .get(old_owner)
                .and_then(|m| m.get(&slice.name))
                .is_some_and(|s| *s == slice)
            {
                return false;
            }
        }
        self.changes.services.insert(slice.service.clone());
        self.changes.slice_events += 1;
        self.slice_owner.insert(key, slice.service.clone());
        self.slices
            .entry(slice.service.clone())
            .or_default()
            .insert(slice);
        true
    }

    pub fn delete_slice(&mut self, namespace: &str, name: &str) -> bool {
        let Some(owner) = self
            .slice_owner
            .remove(&(namespace.to_string(), name.to_string()))
        else {
            return false;
        };
        if let Some(m) = self.slices.get_mut(&owner) {
            m.remove(name);
            if m.is_empty() {
                self.slices.remove(&owner);
            }
        }
        self.changes.services.insert(owner);
        self.changes.slice_events += 1;
        true
    }

    /// This node's Node object is gone (deleted, or absent from a relist or from the
    /// manifests): `last` (the version known before) stays, marked deleted
    /// ([`crate::model::DrainSignal::NodeDeleted`]), so the node is not eligible for load balancers (`/healthz` 503, nodeEligible false) and keeps
    /// its addresses, as kube-proxy keeps the node IPs it started with. Upstream never turns a
    /// deleted Node eligible again: v1.28-v1.32 sync the deleted object, later releases exit
    /// and wait for the Node at restart (docs/upstream-semantics.md §d.2). A Node
    /// that reappears is applied as any other. Returns whether anything changed.
    pub fn node_gone(&mut self, last: Option<Node>) -> bool {
        match last {
            Some(mut node) => {
                node.deleted = true;
                self.set_node(Some(node))
            }
            None => self.set_node(None),
        }
    }

    pub fn set_node(&mut self, node: Option<Node>) -> bool {
        if self.node == node {
            return false;
        }
        self.node = node;
        self.changes.node = true;
        true
    }

    /// What changed since the last [`ClusterState::take_changes`], without clearing it.
    pub fn changes(&self) -> &Changes {
        &self.changes
    }

    /// Returns and clears what changed since the last call.
    pub fn take_changes(&mut self) -> Changes {
        std::mem::take(&mut self.changes)
    }

    /// Marks everything as changed (a forced full re-plan).
    pub fn mark_all_changed(&mut self) {
        let all: BTreeSet<ServiceName> = self
            .services
            .keys()
            .chain(self.slices.keys())
            .cloned()
            .collect();
        self.changes.services.extend(all);
        self.changes.node = true;
        self.changes.service_cidrs = true;
        self.changes.other_nodes = true;
    }

    /// Replaces the whole content with `other` (an atomic relist), recording as changed
    /// exactly the Services that differ, so a relist of an unchanged cluster re-plans
    /// nothing and a half-listed cluster is never visible.
    pub fn replace(&mut self, other: ClusterState) {
        let mut changed: BTreeSet<ServiceName> = BTreeSet::new();
        let (mut service_events, mut slice_events) = (0, 0);
        for name in self.services.keys().chain(other.services.keys()) {
            if self.services.get(name) != other.services.get(name) && changed.insert(name.clone()) {
                service_events += 1;
            }
        }
        let mut slices_changed: BTreeSet<&(String, String)> = BTreeSet::new();
        for key in self.slice_owner.keys().chain(other.slice_owner.keys()) {
            let get = |st: &ClusterState| {
                st.slice_owner
                    .get(key)
                    .and_then(|o| st.slices.get(o)?.get(&key.1))
                    .cloned()
            };
            if get(self) != get(&other) {
                slices_changed.insert(key);
            }
        }
        slice_events += slices_changed.len() as u64;
        for name in self.slices.keys().chain(other.slices.keys()) {
            if self.slices.get(name) != other.slices.get(name) {
                changed.insert(name.clone());
            }
        }
        let node_changed = self.node != other.node;
        let cidrs_changed = self.service_cidrs != other.service_cidrs;
        let other_nodes_changed = self.other_nodes != other.other_nodes;
        let mut pending = std::mem::take(&mut self.changes);
        self.services = other.services;
        self.slices = other.slices;
        self.slice_owner = other.slice_owner;
        self.node = other.node;
        self.service_cidrs = other.service_cidrs;
        self.other_nodes = other.other_nodes;
        pending.service_cidrs |= cidrs_changed;
        pending.other_nodes |= other_nodes_changed;
        pending.services.extend(changed);
        pending.node |= node_changed;
        pending.service_events += service_events;
        pending.slice_events += slice_events;
        self.changes = pending;
    }

    /// Ingests one Kubernetes object and applies it. A Service that is valid but not
    /// proxied (ExternalName, headless, another proxy's) removes any earlier version.
    /// `node_name` selects which Node object is this node's; other Nodes are ignored.
    /// Returns the warnings about dropped pieces; an error means the object was skipped
    /// and the state is unchanged.
    pub fn apply(
        &mut self,
        obj: &Object,
        ownership: &Ownership,
        node_name: &str,
    ) -> Result<Vec<IngestError>, IngestError> {
        let (update, warnings) = Update::of(obj, ownership, node_name)?;
        self.apply_update(&update);
        Ok(warnings)
    }

    /// Applies what [`Update::of`] computed (the ingested object shared, not copied).
    /// Returns whether anything changed.
    pub fn apply_update(&mut self, update: &Update) -> bool {
        match update {
            Update::Service(svc) => self.upsert_service(svc.clone()),
            Update::DeleteService(name) => self.delete_service(name),
            Update::Slice(slice) => self.upsert_slice(slice.clone()),
            Update::DeleteSlice { namespace, name } => self.delete_slice(namespace, name),
            Update::Node(node) => self.set_node(Some((**node).clone())),
            Update::ServiceCidr(c) => self.upsert_service_cidr(c.clone()),
            Update::OtherNode { name, addresses } => self.upsert_other_node(name, addresses),
        }
    }

    /// Deletes an object by kind and name (a watch DELETED event or a removed file).
    pub fn delete(&mut self, kind: Kind, namespace: &str, name: &str, node_name: &str) -> bool {
        match kind {
            Kind::Service => self.delete_service(&ServiceName::new(namespace, name)),
            Kind::EndpointSlice => self.delete_slice(namespace, name),
            Kind::Node if name == node_name => self.set_node(None),
            Kind::Node => {
                let gone = self.other_nodes.remove(name).is_some();
                self.changes.other_nodes |= gone;
                gone
            }
            Kind::ServiceCidr => self.delete_service_cidr(name),
        }
    }
}
