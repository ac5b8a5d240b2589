//! UDP conntrack cleanup after a sync (docs/upstream-semantics.md §e.6, the current reconciler): a UDP flow
//! whose original destination is a UDP frontend of a service port (cluster IP, external
//! IP or LB IP with the port, or the NodePort) and whose reply source is not one of that
//! port's serving endpoints is stale and deleted. Ports without any serving endpoint are
//! skipped. This also removes flows cached before the Service had endpoints (their reply
//! source is the frontend itself). Never a blanket flush.
//!
//! [`UdpFrontends`] is the pure decision's index (every UDP frontend and its serving
//! endpoints), kept by the dataplane between syncs and moved by the changed Services only,
//! so a sync's cleanup costs the change plus the conntrack dump (none at all while no UDP
//! port has a serving endpoint), not a walk over every Service of the cluster;
//! [`UdpFrontends::stale`] is the decision. `cleanup` dumps the table through ctnetlink
//! and deletes each stale flow by its original tuple (one netlink socket, no process).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use kproxy_core::NodePlan;
use kproxy_core::model::{EndpointAddr, Protocol, ServiceName};
use kproxy_core::plan::ServicePlan;
use netlink_packet_core::{
    NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_netfilter::conntrack::{
    ConntrackAttribute, ConntrackMessage, IPTuple, ProtoTuple, Protocol as CtProto, Tuple,
};
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
};
use netlink_sys::Socket;

use crate::error::NftError;

/// One conntrack entry, as far as cleanup cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Flow {
    pub proto: u8,
    pub orig_src: IpAddr,
    pub orig_dst: IpAddr,
    pub orig_sport: u16,
    pub orig_dport: u16,
    /// Reply source: the endpoint the flow was DNATed to (or the frontend if it was not).
    pub reply_src: IpAddr,
    pub reply_sport: u16,
}

const IPPROTO_UDP: u8 = 17;

/// A UDP frontend as a flow's original destination shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Frontend {
    /// Cluster, external or LB IP with the service port.
    Ip(IpAddr, u16),
    /// A NodePort on any node address of the family (true: IPv6).
    NodePort(bool, u16),
}

/// Serving endpoints, sorted and deduplicated (binary-searched).
type Serving = Arc<[EndpointAddr]>;

/// Every UDP frontend of a plan with the serving endpoints of its service ports: what
/// [`UdpFrontends::stale`] checks flows against. Built whole ([`UdpFrontends::of`]) or
/// moved by the Services that changed ([`UdpFrontends::advance`]); both give the same
/// index for the same plan. Service ports without a serving endpoint are left out (their
/// flows are not touched).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UdpFrontends {
    /// What each Service contributes, to take it out again when the Service changes.
    by_service: HashMap<ServiceName, Vec<(Frontend, Serving)>>,
    /// Frontend → the serving endpoints of every Service port behind it (a frontend
    /// several Services claim accepts the endpoints of all of them, as before).
    by_frontend: HashMap<Frontend, Vec<(ServiceName, Serving)>>,
}

impl UdpFrontends {
    /// The index of a whole plan. Pure.
    pub fn of(plan: &NodePlan) -> UdpFrontends {
        let mut ix = UdpFrontends::default();
        for (name, svc) in &plan.services {
            ix.insert(name, svc);
        }
        ix
    }

    /// Moves the index to `plan` for the Services named in `changed` (added, changed or
    /// removed); every other Service is assumed unchanged. Pure; work ∝ `changed`.
    pub fn advance(&mut self, plan: &NodePlan, changed: &[ServiceName]) {
        for name in changed {
            self.remove(name);
            if let Some(svc) = plan.services.get(name) {
                self.insert(name, svc);
            }
        }
    }

    /// True when no UDP service port has a serving endpoint: nothing can be stale.
    pub fn is_empty(&self) -> bool {
        self.by_frontend.is_empty()
    }

    /// The flows of `flows` that are stale. Pure.
    pub fn stale(&self, flows: &[Flow]) -> Vec<Flow> {
        flows
            .iter()
            .filter(|f| f.proto == IPPROTO_UDP)
            .filter(|f| {
                let reply = EndpointAddr::new(f.reply_src, f.reply_sport);
                let behind = self
                    .by_frontend
                    .get(&Frontend::Ip(f.orig_dst, f.orig_dport))
                    .or_else(|| {
                        self.by_frontend
                            .get(&Frontend::NodePort(f.orig_dst.is_ipv6(), f.orig_dport))
                    });
                behind.is_some_and(|b| b.iter().all(|(_, s)| s.binary_search(&reply).is_err()))
            })
            .copied()
            .collect()
    }

    fn insert(&mut self, name: &ServiceName, svc: &ServicePlan) {
        let mut own: BTreeMap<Frontend, BTreeSet<EndpointAddr>> = BTreeMap::new();
        for sp in svc.ports.iter().filter(|sp| sp.protocol == Protocol::UDP) {
            let serving: BTreeSet<EndpointAddr> = sp.serving_endpoints().collect();
            if serving.is_empty() {
                continue;
            }
            let ips = std::iter::once(&sp.cluster_ip)
                .chain(&sp.external_ips)
                .chain(&sp.load_balancer_ips);
            let node_port = sp
                .node_port
                .map(|np| Frontend::NodePort(sp.cluster_ip.is_ipv6(), np));
            for fe in ips.map(|ip| Frontend::Ip(*ip, sp.port)).chain(node_port) {
                own.entry(fe).or_default().extend(serving.iter().copied());
            }
        }
        if own.is_empty() {
            return;
        }
        let own: Vec<(Frontend, Serving)> = own
            .into_iter()
            .map(|(fe, s)| (fe, s.into_iter().collect()))
            .collect();
        for (fe, s) in &own {
            // Sorted by Service, so the index does not depend on the order of changes.
            let behind = self.by_frontend.entry(*fe).or_default();
            let at = behind.partition_point(|(n, _)| n < name);
            behind.insert(at, (name.clone(), s.clone()));
        }
        self.by_service.insert(name.clone(), own);
    }

    fn remove(&mut self, name: &ServiceName) {
        let Some(own) = self.by_service.remove(name) else {
            return;
        };
        for (fe, _) in own {
            if let Some(behind) = self.by_frontend.get_mut(&fe) {
                behind.retain(|(n, _)| n != name);
                if behind.is_empty() {
                    self.by_frontend.remove(&fe);
                }
            }
        }
    }
}

/// The flows of `flows` that are stale under `plan`. Pure; the tests' door to the
/// decision `cleanup` takes from the record's [`UdpFrontends`].
#[cfg(any(test, feature = "internals"))]
pub fn stale_flows(plan: &NodePlan, flows: &[Flow]) -> Vec<Flow> {
    UdpFrontends::of(plan).stale(flows)
}

/// Dumps the calling thread's netns conntrack table (both families), deletes the flows
/// stale under `frontends`, returns how many were deleted. Nothing is dumped when no UDP
/// service port has a serving endpoint.
pub fn cleanup(frontends: &UdpFrontends) -> Result<usize, NftError> {
    if frontends.is_empty() {
        return Ok(0);
    }
    let sock = open()?;
    let mut deleted = 0;
    for fam in [NetfilterProtoFamily::IPv4, NetfilterProtoFamily::IPv6] {
        let flows = dump(&sock, fam)?;
        for f in frontends.stale(&flows) {
            if delete(&sock, fam, &f)? {
                deleted += 1;
            }
        }
    }
    Ok(deleted)
}

/// Every flow of one family (for tests and tools).
#[cfg(feature = "internals")]
pub fn list(family_v6: bool) -> Result<Vec<Flow>, NftError> {
    let sock = open()?;
    dump(
        &sock,
        if family_v6 {
            NetfilterProtoFamily::IPv6
        } else {
            NetfilterProtoFamily::IPv4
        },
    )
}

fn open() -> Result<Socket, NftError> {
    crate::nfnl::open()
        .map_err(|e| NftError::Conntrack(format!("opening a netfilter netlink socket: {e}")))
}

fn send(
    sock: &Socket,
    fam: NetfilterProtoFamily,
    flags: u16,
    msg: ConntrackMessage,
) -> Result<(), NftError> {
    let mut hdr = NetlinkHeader::default();
    hdr.flags = flags;
    let mut packet = NetlinkMessage::new(
        hdr,
        NetlinkPayload::from(NetfilterMessage::new(NetfilterHeader::new(fam, 0, 0), msg)),
    );
    packet.finalize();
    let mut buf = vec![0; packet.buffer_len()];
    packet.serialize(&mut buf[..]);
    sock.send(&buf[..], 0)
        .map_err(|e| NftError::Conntrack(format!("sending a ctnetlink request: {e}")))?;
    Ok(())
}

/// Receives messages until `Done` (dump) or the ACK/error (request), calling `each` on
/// conntrack payloads. Returns the errno of an error message (0 = ACK).
fn receive(sock: &Socket, mut each: impl FnMut(&ConntrackMessage)) -> Result<i32, NftError> {
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let size = sock.recv(&mut &mut buf[..], 0).map_err(|e| {
            NftError::Conntrack(format!("receiving: {}", crate::nfnl::answer_error(e)))
        })?;
        let mut offset = 0;
        while offset < size {
            let msg = <NetlinkMessage<NetfilterMessage>>::deserialize(&buf[offset..size])
                .map_err(|e| NftError::Conntrack(format!("decoding a ctnetlink message: {e}")))?;
            let len = msg.header.length as usize;
            match msg.payload {
                NetlinkPayload::Done(_) => return Ok(0),
                NetlinkPayload::Error(e) => return Ok(e.code.map(|c| c.get()).unwrap_or(0)),
                NetlinkPayload::InnerMessage(NetfilterMessage {
                    inner: NetfilterMessageInner::Conntrack(ct),
                    ..
                }) => each(&ct),
                _ => {}
            }
            if len == 0 {
                break;
            }
            offset += (len + 3) & !3;
        }
    }
}

fn dump(sock: &Socket, fam: NetfilterProtoFamily) -> Result<Vec<Flow>, NftError> {
    send(
        sock,
        fam,
        NLM_F_REQUEST | NLM_F_DUMP,
        ConntrackMessage::Get(vec![]),
    )?;
    let mut flows = Vec::new();
    let code = receive(sock, |ct| {
        if let ConntrackMessage::New(attrs) = ct
            && let Some(f) = parse_flow(attrs)
        {
            flows.push(f);
        }
    })?;
    if code != 0 {
        return Err(NftError::Conntrack(format!("dump failed: errno {}", -code)));
    }
    Ok(flows)
}

fn parse_tuple(t: &[Tuple]) -> Option<(IpAddr, IpAddr, u8, u16, u16)> {
    let (mut src, mut dst, mut proto, mut sport, mut dport) = (None, None, None, 0, 0);
    for x in t {
        match x {
            Tuple::Ip(ips) => {
                for ip in ips {
                    match ip {
                        IPTuple::SourceAddress(a) => src = Some(*a),
                        IPTuple::DestinationAddress(a) => dst = Some(*a),
                        _ => {}
                    }
                }
            }
            Tuple::Proto(ps) => {
                for p in ps {
                    match p {
                        ProtoTuple::Protocol(pr) => proto = Some(u8::from(*pr)),
                        ProtoTuple::SourcePort(p) => sport = *p,
                        ProtoTuple::DestinationPort(p) => dport = *p,
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some((src?, dst?, proto?, sport, dport))
}

fn parse_flow(attrs: &[ConntrackAttribute]) -> Option<Flow> {
    let mut orig = None;
    let mut reply = None;
    for a in attrs {
        match a {
            ConntrackAttribute::CtaTupleOrig(t) => orig = parse_tuple(t),
            ConntrackAttribute::CtaTupleReply(t) => reply = parse_tuple(t),
            _ => {}
        }
    }
    let (os, od, proto, osp, odp) = orig?;
    let (rs, _rd, _, rsp, _) = reply?;
    Some(Flow {
        proto,
        orig_src: os,
        orig_dst: od,
        orig_sport: osp,
        orig_dport: odp,
        reply_src: rs,
        reply_sport: rsp,
    })
}

/// Deletes one flow by its original tuple; `false` when it was already gone (expired
/// between dump and delete).
fn delete(sock: &Socket, fam: NetfilterProtoFamily, f: &Flow) -> Result<bool, NftError> {
    let tuple = vec![
        Tuple::Ip(vec![
            IPTuple::SourceAddress(f.orig_src),
            IPTuple::DestinationAddress(f.orig_dst),
        ]),
        Tuple::Proto(vec![
            ProtoTuple::Protocol(CtProto::from(f.proto)),
            ProtoTuple::SourcePort(f.orig_sport),
            ProtoTuple::DestinationPort(f.orig_dport),
        ]),
    ];
    send(
        sock,
        fam,
        NLM_F_REQUEST | NLM_F_ACK,
        ConntrackMessage::Delete(vec![ConntrackAttribute::CtaTupleOrig(tuple)]),
    )?;
    let code = receive(sock, |_| {})?;
    match -code {
        0 => Ok(true),
        libc::ENOENT => Ok(false),
        e => Err(NftError::Conntrack(format!("deleting {f:?}: errno {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kproxy_core::synthetic::{self, Spec};
    use kproxy_core::{PlanConfig, Planner};

    /// Every third Service (and its slice) UDP, so the index has something to hold.
    fn udp_service(spec: &Spec, i: usize) -> kproxy_core::model::Service {
        let mut s = synthetic::service(spec, i);
        if i.is_multiple_of(3) {
            s.ports[0].protocol = Protocol::UDP;
        }
        s
    }

    fn udp_slice(spec: &Spec, i: usize, generation: usize) -> kproxy_core::model::EndpointSlice {
        let mut s = synthetic::slice(spec, i, generation);
        if i.is_multiple_of(3) {
            s.ports[0].protocol = Protocol::UDP;
        }
        s
    }

    /// The cluster of `spec` with every third Service UDP, planned for node 0.
    fn planned(spec: &Spec) -> (kproxy_core::ClusterState, Planner) {
        let mut state = kproxy_core::ClusterState::new();
        state.set_node(Some(synthetic::node(0)));
        for i in 0..spec.services {
            state.upsert_service(udp_service(spec, i));
            state.upsert_slice(udp_slice(spec, i, 0));
        }
        let mut planner = Planner::new("node-0", PlanConfig::default());
        planner.update(&mut state);
        (state, planner)
    }

    #[test]
    fn advanced_index_equals_the_index_of_the_new_plan() {
        let spec = Spec::new(60, 4);
        let (mut state, mut planner) = planned(&spec);
        let mut ix = UdpFrontends::of(planner.plan());
        assert!(!ix.is_empty());
        for step in 1..=20 {
            let i = (step * 7) % spec.services;
            match step % 4 {
                // A Service goes away, or comes back.
                0 => {
                    if state.service(&synthetic::service(&spec, i).name).is_some() {
                        state.delete_service(&synthetic::service(&spec, i).name);
                    } else {
                        state.upsert_service(udp_service(&spec, i));
                    }
                }
                // TCP → UDP and back.
                1 => {
                    let mut s = udp_service(&spec, i);
                    s.ports[0].protocol = if step % 8 == 1 {
                        Protocol::UDP
                    } else {
                        Protocol::TCP
                    };
                    state.upsert_service(s);
                }
                _ => {
                    state.upsert_slice(udp_slice(&spec, i, step));
                }
            }
            let up = planner.update(&mut state);
            ix.advance(planner.plan(), &up.services);
            assert_eq!(ix, UdpFrontends::of(planner.plan()), "step {step}");
        }
    }

    #[test]
    fn only_udp_flows_to_a_frontend_not_answered_by_a_serving_endpoint_are_stale() {
        let spec = Spec::new(3, 2);
        let (_state, planner) = planned(&spec);
        let plan = planner.plan();
        let udp = plan
            .service_ports()
            .find(|sp| sp.protocol == Protocol::UDP)
            .expect("a UDP port");
        let serving = udp.serving_endpoints().next().expect("a serving endpoint");
        let flow = |proto: u8, reply: EndpointAddr| Flow {
            proto,
            orig_src: "10.1.1.1".parse().unwrap(),
            orig_dst: udp.cluster_ip,
            orig_sport: 40000,
            orig_dport: udp.port,
            reply_src: reply.ip,
            reply_sport: reply.port,
        };
        let gone = EndpointAddr::new("10.9.9.9".parse().unwrap(), serving.port);
        let ix = UdpFrontends::of(plan);
        assert!(ix.stale(&[flow(17, serving)]).is_empty());
        assert_eq!(ix.stale(&[flow(17, gone)]), vec![flow(17, gone)]);
        assert!(
            ix.stale(&[flow(6, gone)]).is_empty(),
            "TCP is never touched"
        );
        assert_eq!(stale_flows(plan, &[flow(17, gone)]), vec![flow(17, gone)]);
    }
}
