//! Folding watch events into the ClusterState: pure, no I/O, so tables of events can
//! drive it. [`Folder::step`] turns one watcher event of one kind into at most one
//! [`Change`]; [`apply_change`] applies it to the state inside one `Writer::update`.
//!
//! A (re)list arrives as `Init`, `Listed`…, `InitDone`. A relist (the kind was listed
//! before) is buffered and applied as ONE change, which also deletes the objects of that
//! kind that the list no longer holds, so the sync loop never plans a half-listed kind
//! (a 410 Gone relist of 10k Services must not look like 10k deletions followed by 10k
//! additions). A kind's first list is applied object by object as it arrives: nothing
//! is planned before every kind has been listed once ([`Folder::all_listed`], the
//! source's readiness), so the state is built while the list streams in, and its end
//! costs nothing (at 44k Services × 1 endpoint, buffering then applying took 20–50 ms
//! per kind after its last object; BENCHMARKS.md). A first list that breaks off after
//! applying objects and starts again is buffered from then on, as a relist, so that its
//! end removes what only the broken attempt held.
//!
//! An object that cannot be decoded or ingested is skipped with a warning naming kind,
//! namespace, name and field; its previous good version (if any) stays, exactly as
//! when a watch event carries it, and its neighbours are unaffected.

use std::collections::BTreeSet;

use kproxy_core::ClusterState;
use kproxy_core::ingest::{IngestError, Kind, ObjectRef, Ownership};
use kproxy_core::manifest::Object;
use kproxy_core::state::Update;

/// Namespace and name of an object (namespace empty for Nodes).
pub type Key = (String, String);

/// Something the fold can apply to the state: an object (ingested when applied), or an
/// [`Update`] already ingested when it was decoded (what the API source buffers: the
/// ingested value, shared by `Arc` with the state it ends up in, is far smaller than
/// the object).
pub trait Applicable {
    /// Applies to `state`: the warnings, or the error that makes the object skipped.
    fn apply_to(
        &self,
        state: &mut ClusterState,
        ownership: &Ownership,
        node_name: &str,
    ) -> Result<Vec<IngestError>, IngestError>;
}

impl Applicable for Object {
    fn apply_to(
        &self,
        state: &mut ClusterState,
        ownership: &Ownership,
        node_name: &str,
    ) -> Result<Vec<IngestError>, IngestError> {
        state.apply(self, ownership, node_name)
    }
}

/// Its warnings were reported when it was ingested.
impl Applicable for Update {
    fn apply_to(
        &self,
        state: &mut ClusterState,
        _: &Ownership,
        _: &str,
    ) -> Result<Vec<IngestError>, IngestError> {
        state.apply_update(self);
        Ok(Vec::new())
    }
}

/// One watcher event, with its object already decoded (or the reason it could not be).
#[derive(Debug)]
pub enum Input<T = Object> {
    /// A relist starts.
    Init,
    /// One object of the relist.
    Listed(Key, Result<T, IngestError>),
    /// The relist is complete.
    InitDone,
    /// ADDED or MODIFIED.
    Apply(Key, Result<T, IngestError>),
    /// DELETED.
    Delete(Key),
    /// The API answered again after failures (sent after the relist it brought), at
    /// this time. Changes nothing in the state; the source notes it for the sync loop.
    Returned(tokio::time::Instant),
    /// The kind has heard nothing usable from the API since this time (errors,
    /// refusals, throttling), until [`Input::Returned`]. Changes nothing in the state;
    /// the source's status says it (`/healthz`'s `sourceStalledSince`).
    Failing(tokio::time::Instant),
    /// Objects of the kind could not be decoded (`true`), or a list decoded whole
    /// again (`false`). Changes nothing in the state (what could not be decoded keeps
    /// its last good version); the source's status says the input is partial, which
    /// the restart guard reads.
    Lost(bool),
}

/// What one event does to the state.
#[derive(Debug)]
pub enum Change<T = Object> {
    /// A complete list of one kind: apply `objects`, delete every object of `kind` whose
    /// key is not in `seen` (`seen` also holds the keys of objects that failed to decode,
    /// so their last good version stays).
    Relisted {
        kind: Kind,
        objects: Vec<T>,
        seen: BTreeSet<Key>,
    },
    Apply(T),
    Delete(Kind, Key),
}

struct Progress<T> {
    listed: bool,
    relist: Option<(Vec<T>, BTreeSet<Key>)>,
    /// Objects of a first list were applied as they arrived.
    applied: bool,
}

impl<T> Default for Progress<T> {
    fn default() -> Self {
        Progress {
            listed: false,
            relist: None,
            applied: false,
        }
    }
}

/// Per-kind progress of the four watchers: the relist being buffered and whether the
/// kind has been listed once.
pub struct Folder<T = Object> {
    progress: [Progress<T>; 4],
}

impl<T> Default for Folder<T> {
    fn default() -> Self {
        Folder {
            progress: Default::default(),
        }
    }
}

fn index(kind: Kind) -> usize {
    match kind {
        Kind::Service => 0,
        Kind::EndpointSlice => 1,
        Kind::Node => 2,
        Kind::ServiceCidr => 3,
    }
}

impl<T> Folder<T> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether this kind has completed one list.
    pub fn listed(&self, kind: Kind) -> bool {
        self.progress[index(kind)].listed
    }

    /// Services, EndpointSlices and the Node have all been listed once
    /// (docs/upstream-semantics.md §f: nothing is programmed before, so no Service is
    /// blackholed for lack of its endpoints). ServiceCIDRs do not gate the first sync, as
    /// upstream's `isInitialized` waits only for Services and EndpointSlices: an API server
    /// without the resource must not keep a node from serving.
    pub fn all_listed(&self) -> bool {
        [Kind::Service, Kind::EndpointSlice, Kind::Node]
            .into_iter()
            .all(|k| self.listed(k))
    }

    /// Folds one event. Returns the change to apply (if any) and the warnings about
    /// objects skipped because they could not be decoded.
    pub fn step(&mut self, kind: Kind, input: Input<T>) -> (Option<Change<T>>, Vec<IngestError>) {
        let p = &mut self.progress[index(kind)];
        let mut warnings = Vec::new();
        // A first list goes straight into the state, unless an attempt of it broke off
        // after applying objects: then it is buffered, as a relist.
        let direct = !p.listed && p.relist.is_none();
        let change = match input {
            Input::Init if direct && !p.applied => None,
            Input::Init => {
                p.relist = Some((Vec::new(), BTreeSet::new()));
                None
            }
            Input::Listed(_, decoded) if direct => match decoded {
                Ok(o) => {
                    p.applied = true;
                    Some(Change::Apply(o))
                }
                Err(e) => {
                    warnings.push(e);
                    None
                }
            },
            Input::Listed(key, decoded) => {
                let (objects, seen) = p.relist.get_or_insert_with(Default::default);
                seen.insert(key);
                match decoded {
                    Ok(o) => objects.push(o),
                    Err(e) => warnings.push(e),
                }
                None
            }
            Input::InitDone if direct => {
                p.listed = true;
                None
            }
            Input::InitDone => {
                let (objects, seen) = p.relist.take().unwrap_or_default();
                p.listed = true;
                Some(Change::Relisted {
                    kind,
                    objects,
                    seen,
                })
            }
            Input::Apply(_, Ok(o)) => Some(Change::Apply(o)),
            Input::Apply(_, Err(e)) => {
                warnings.push(e);
                None
            }
            Input::Delete(key) => Some(Change::Delete(kind, key)),
            Input::Returned(_) | Input::Failing(_) | Input::Lost(_) => None,
        };
        (change, warnings)
    }
}

/// The keys of one kind currently in the state.
fn keys_of(state: &ClusterState, kind: Kind, node_name: &str) -> BTreeSet<Key> {
    match kind {
        Kind::Service => state
            .services()
            .map(|s| (s.name.namespace.to_string(), s.name.name.to_string()))
            .collect(),
        Kind::EndpointSlice => state
            .services_with_slices()
            .flat_map(|svc| {
                state
                    .slices_of(svc)
                    .map(|s| (s.service.namespace.to_string(), s.name.clone()))
            })
            .collect(),
        Kind::Node => state
            .node()
            .map(|_| (String::new(), node_name.to_string()))
            .into_iter()
            .collect(),
        Kind::ServiceCidr => state
            .service_cidr_objects()
            .map(|c| (String::new(), c.name.clone()))
            .collect(),
    }
}

/// Applies one change. Returns the warnings (dropped pieces, rejected objects).
pub fn apply_change<T: Applicable>(
    state: &mut ClusterState,
    change: Change<T>,
    ownership: &Ownership,
    node_name: &str,
) -> Vec<IngestError> {
    let mut warnings = Vec::new();
    let mut apply = |state: &mut ClusterState, o: &T| match o.apply_to(state, ownership, node_name)
    {
        Ok(w) => warnings.extend(w),
        Err(e) => warnings.push(e),
    };
    match change {
        Change::Relisted {
            kind,
            objects,
            seen,
        } => {
            for o in &objects {
                apply(state, o);
            }
            for (ns, name) in keys_of(state, kind, node_name) {
                if seen.contains(&(ns.clone(), name.clone())) {
                    continue;
                }
                if kind == Kind::Node {
                    state.node_gone(state.node().cloned());
                } else {
                    state.delete(kind, &ns, &name, node_name);
                }
            }
        }
        Change::Apply(o) => apply(state, &o),
        Change::Delete(Kind::Node, (_, name)) if name == node_name => {
            state.node_gone(state.node().cloned());
        }
        Change::Delete(kind, (ns, name)) => {
            state.delete(kind, &ns, &name, node_name);
        }
    }
    warnings
}

/// The warning for an object the typed decode refused. Field and reason are shown
/// escaped: both can carry bytes from the object (map keys, bad values).
pub fn decode_warning(kind: Kind, key: &Key, field: &str, reason: &str) -> IngestError {
    IngestError {
        object: ObjectRef {
            kind,
            namespace: (kind != Kind::Node).then(|| key.0.clone()),
            name: Some(key.1.clone()),
        },
        field: field.escape_debug().to_string(),
        reason: reason.escape_debug().to_string(),
    }
}
