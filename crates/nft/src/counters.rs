//! kproxy's traffic counters: named counter objects in its own tables, one per Service
//! port and verdict and one per Service port and endpoint, each counting new
//! connections only (they are hit from nat chains, which see a connection's first
//! packet). This module owns their names (written by `crate::ruleset`, parsed back here
//! for `kproxy top` and the metrics, which need no plan to label them), their values as
//! read ([`RawCounter`], [`KernelCounter`]) and what kproxy remembers of them
//! ([`CounterMemory`]). Pure: their one reading from the kernel is the readers'
//! (`crate::dump::read_counters`), above it.
//!
//! Why named objects (crates/nft/README.md, "Counters"): a counter object lives apart
//! from the rules and elements that hit it, so a chain rewrite, an element change or a
//! dispatch group moving never touches it; kproxy creates one when the thing it counts
//! appears and deletes it only when that goes, and the diff compares counters by name,
//! never by value, so adoption after a restart keeps them. When the kernel lost them (a
//! flush, a replacement), they are created again from the last values kproxy read
//! (`crate::dataplane`).

use std::collections::BTreeMap;

use kproxy_core::model::EndpointAddr;

use crate::model::{Family, Op, Transaction};

/// What one counter counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CounterKind {
    /// New connections DNATed to one of the Service port's endpoints.
    New,
    /// New connections rejected: the Service port has no endpoint at all.
    Rejected,
    /// New connections dropped: endpoints exist, none this traffic may use here (a
    /// Local traffic policy without a local endpoint).
    NoLocal,
    /// New connections to an LB IP dropped by `loadBalancerSourceRanges`.
    SourceRange,
    /// New connections sent to a terminating endpoint by the serving+terminating
    /// fallback.
    Fallback,
    /// New connections DNATed to this endpoint (every frontend kind together).
    Endpoint(EndpointAddr),
}

impl CounterKind {
    /// The prefix of its name.
    fn prefix(&self) -> &'static str {
        match self {
            CounterKind::New => "new-",
            CounterKind::Rejected => "rejected-",
            CounterKind::NoLocal => "no-local-",
            CounterKind::SourceRange => "source-range-",
            CounterKind::Fallback => "fallback-",
            CounterKind::Endpoint(_) => "endpoint-",
        }
    }

    /// A short word for reports (`rejected`, `no-local`, …, `endpoint`).
    pub fn word(&self) -> &'static str {
        self.prefix().trim_end_matches('-')
    }
}

/// The node's counter of new connections to an address of a service CIDR that no
/// Service holds (dropped; upstream's `cluster-ips-check`).
pub const UNALLOCATED_CLUSTER_IPS: &str = "unallocated-cluster-ips";

/// The name of the counter of `kind` of the Service port whose id is `port_id`
/// (`crate::ruleset::port_id`: `HASH-NAMESPACE/NAME/PROTO/PORTNAME`). Names are nft
/// identifiers (`nft -f` takes no quoted object name): an endpoint's adds
/// `/IP/PORT`, an IPv6 address's colons written as dashes (no address has a dash).
pub fn counter_name(port_id: &str, kind: &CounterKind) -> String {
    let mut s = String::with_capacity(port_id.len() + 32);
    s.push_str(kind.prefix());
    s.push_str(port_id);
    if let CounterKind::Endpoint(ep) = kind {
        use std::fmt::Write as _;
        let ip = ep.ip.to_string().replace(':', "-");
        let _ = write!(s, "/{ip}/{}", ep.port);
    }
    s
}

/// A Service port's counter, its name parsed.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceCounter {
    pub namespace: String,
    pub service: String,
    /// `tcp`, `udp` or `sctp`.
    pub protocol: String,
    /// The port's name (empty for an unnamed port).
    pub port: String,
    pub kind: CounterKind,
}

/// The Service port and kind a counter's name says; `None` for a name kproxy does not
/// write (the node's own counters, another program's).
pub fn parse_counter_name(name: &str) -> Option<ServiceCounter> {
    let kinds = [
        CounterKind::New,
        CounterKind::Rejected,
        CounterKind::NoLocal,
        CounterKind::SourceRange,
        CounterKind::Fallback,
    ];
    let (kind, rest) = match name.strip_prefix("endpoint-") {
        Some(rest) => {
            let (rest, port) = rest.rsplit_once('/')?;
            let (id, ip) = rest.rsplit_once('/')?;
            let ip: std::net::IpAddr = ip.replace('-', ":").parse().ok()?;
            let ep = EndpointAddr::new(ip, port.parse().ok()?);
            (CounterKind::Endpoint(ep), id)
        }
        None => kinds
            .into_iter()
            .find_map(|k| Some((k, name.strip_prefix(k.prefix())?)))?,
    };
    // HASH-NAMESPACE/NAME/PROTO/PORTNAME, HASH eight hex digits.
    let (hash, path) = rest.split_once('-')?;
    if hash.len() != 8 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut parts = path.splitn(4, '/');
    let (namespace, service, protocol, port) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    Some(ServiceCounter {
        namespace: namespace.into(),
        service: service.into(),
        protocol: protocol.into(),
        port: port.into(),
        kind,
    })
}

/// A counter object's values as the kernel holds them and, from its comment, since when
/// it counts (Unix seconds; `None` for a counter kproxy did not stamp).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RawCounter {
    pub packets: u64,
    pub bytes: u64,
    pub since: Option<u64>,
}

/// One counter as read from the kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelCounter {
    pub family: Family,
    pub name: String,
    pub packets: u64,
    pub bytes: u64,
    /// Since when it counts (Unix seconds), from its comment: when kproxy created it,
    /// or restored it after the kernel lost it (`None`: not stamped by kproxy).
    pub since: Option<u64>,
}

/// Unix seconds now.
fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What kproxy last read of its counters, per family and name: a counter the kernel
/// lost (another process flushed or deleted kproxy's tables; a replacement deleted and
/// created them in one transaction) is created again from these values, so its count
/// goes on from the last reading instead of from 0, and its `since` moves to the
/// restore (the counts between the reading and the loss are gone, as a Prometheus
/// counter's `_created` says). A counter kproxy deletes (its Service or endpoint went)
/// is forgotten.
#[derive(Clone, Debug, Default)]
pub struct CounterMemory {
    /// The last reading of each counter, and which reading it was.
    seen: BTreeMap<(Family, String), (RawCounter, u64)>,
    /// Readings so far, per family.
    readings: BTreeMap<Family, u64>,
    /// The counters kproxy created and has not deleted since, per family: with those
    /// read, the names a reading asks the kernel for ([`CounterMemory::names`]).
    created: std::collections::BTreeSet<(Family, String)>,
}

impl CounterMemory {
    /// Notes a reading of `family`'s counters (one call per reading) (the kernel's values replace the
    /// remembered ones; counters absent from the reading are kept: the kernel may have
    /// lost them).
    pub fn observe<'a>(
        &mut self,
        family: Family,
        read: impl IntoIterator<Item = (&'a String, &'a RawCounter)>,
    ) {
        let n = self.readings.entry(family).or_default();
        *n += 1;
        for (name, c) in read {
            self.seen.insert((family, name.clone()), (*c, *n));
        }
    }

    /// The names of `family`'s counters kproxy read or created (and did not delete):
    /// what a reading asks the kernel for by name (`crate::dump::objects`).
    pub fn names(&self, family: Family) -> std::collections::BTreeSet<String> {
        let of = |(f, n): &(Family, String)| (*f == family).then(|| n.clone());
        let seen = self.seen.keys().filter_map(of);
        seen.chain(self.created.iter().filter_map(of)).collect()
    }

    /// Stamps the transaction's new counters before it is sent: each starts from its
    /// remembered values or from 0, since now (a restored counter lost what it counted
    /// between the reading and the loss; `fresh`: the reading was made for this very
    /// transaction, a replacement that deletes and creates the tables at once, so it
    /// keeps its `since`); a counter the transaction deletes is forgotten. Returns the
    /// counters restored with remembered values (not `fresh`), by name.
    pub fn fill(&mut self, tx: &mut Transaction, fresh: bool) -> Vec<String> {
        let now = now();
        let mut restored = Vec::new();
        for op in &mut tx.ops {
            match op {
                Op::AddCounter {
                    family,
                    name,
                    packets,
                    bytes,
                    since,
                    ..
                } => {
                    *since = now;
                    self.created.insert((*family, name.clone()));
                    let latest = self.readings.get(family).copied().unwrap_or_default();
                    if let Some((c, reading)) = self.seen.get_mut(&(*family, name.clone())) {
                        (*packets, *bytes) = (c.packets, c.bytes);
                        // Fresh only when the last reading found it.
                        match (fresh && *reading == latest, c.since) {
                            (true, Some(s)) => *since = s,
                            _ if c.packets > 0 || c.bytes > 0 => restored.push(name.clone()),
                            _ => {}
                        }
                        c.since = Some(*since);
                    }
                }
                Op::DeleteObject {
                    family, kind, name, ..
                } if *kind == crate::nfnl::NFT_OBJECT_COUNTER => {
                    self.seen.remove(&(*family, name.clone()));
                    self.created.remove(&(*family, name.clone()));
                }
                // A table deleted (a replacement, `kproxy cleanup`): its counters are
                // created again in the same transaction, or gone with it.
                _ => {}
            }
        }
        restored
    }
}

/// A family's reading as [`KernelCounter`]s.
pub(crate) fn kernel_counters(
    family: Family,
    read: BTreeMap<String, RawCounter>,
) -> impl Iterator<Item = KernelCounter> {
    read.into_iter().map(move |(name, c)| KernelCounter {
        family,
        name,
        packets: c.packets,
        bytes: c.bytes,
        since: c.since,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        let id = "0a1b2c3d-shop/web/tcp/http";
        for kind in [
            CounterKind::New,
            CounterKind::Rejected,
            CounterKind::NoLocal,
            CounterKind::SourceRange,
            CounterKind::Fallback,
            CounterKind::Endpoint(EndpointAddr::new("10.244.1.5".parse().unwrap(), 8080)),
            CounterKind::Endpoint(EndpointAddr::new("fd00::5".parse().unwrap(), 53)),
        ] {
            let name = counter_name(id, &kind);
            let parsed = parse_counter_name(&name).unwrap_or_else(|| panic!("{name}"));
            assert_eq!(
                (
                    parsed.namespace.as_str(),
                    parsed.service.as_str(),
                    parsed.protocol.as_str(),
                    parsed.port.as_str(),
                    parsed.kind
                ),
                ("shop", "web", "tcp", "http", kind),
                "{name}"
            );
        }
        let unnamed = parse_counter_name("rejected-0a1b2c3d-shop/web/udp/").unwrap();
        assert_eq!(unnamed.port, "");
        assert_eq!(parse_counter_name(UNALLOCATED_CLUSTER_IPS), None);
        assert_eq!(parse_counter_name("evil"), None);
        assert_eq!(parse_counter_name("rejected-nothex00-a/b/tcp/x"), None);
    }
}
