//! UDP conntrack cleanup after a sync (spec §e.6, the current reconciler): a UDP flow
//! whose original destination is a UDP frontend of a service port (cluster IP, external
//! IP or LB IP with the port, or the NodePort) and whose reply source is not one of that
//! port's serving endpoints is stale and deleted. Ports without any serving endpoint are
//! skipped. This also removes flows cached before the Service had endpoints (their reply
//! source is the frontend itself). Never a blanket flush.
//!
//! `stale_flows` is the pure decision; `cleanup` dumps the table through ctnetlink and
//! deletes each stale flow by its original tuple (one netlink socket, no process).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use kproxy_core::NodePlan;
use kproxy_core::model::{EndpointAddr, Protocol};
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

use crate::NftError;

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

/// The flows of `flows` that are stale under `plan`. Pure.
pub fn stale_flows(plan: &NodePlan, flows: &[Flow]) -> Vec<Flow> {
    // Frontend (addr, port) and NodePort → serving endpoints of that UDP service port.
    let mut by_ip: BTreeMap<(IpAddr, u16), BTreeSet<EndpointAddr>> = BTreeMap::new();
    let mut by_node_port: BTreeMap<(bool, u16), BTreeSet<EndpointAddr>> = BTreeMap::new();
    for sp in plan
        .service_ports()
        .filter(|sp| sp.protocol == Protocol::UDP)
    {
        let serving: BTreeSet<EndpointAddr> = sp.serving_endpoints().collect();
        if serving.is_empty() {
            continue;
        }
        for ip in std::iter::once(&sp.cluster_ip)
            .chain(&sp.external_ips)
            .chain(&sp.load_balancer_ips)
        {
            by_ip
                .entry((*ip, sp.port))
                .or_default()
                .extend(serving.iter().copied());
        }
        if let Some(np) = sp.node_port {
            by_node_port
                .entry((sp.cluster_ip.is_ipv6(), np))
                .or_default()
                .extend(serving.iter().copied());
        }
    }
    flows
        .iter()
        .filter(|f| f.proto == IPPROTO_UDP)
        .filter(|f| {
            let serving = by_ip
                .get(&(f.orig_dst, f.orig_dport))
                .or_else(|| by_node_port.get(&(f.orig_dst.is_ipv6(), f.orig_dport)));
            serving.is_some_and(|s| !s.contains(&EndpointAddr::new(f.reply_src, f.reply_sport)))
        })
        .copied()
        .collect()
}

/// Dumps the calling thread's netns conntrack table (both families), deletes the stale
/// UDP flows, returns how many were deleted.
pub fn cleanup(plan: &NodePlan) -> Result<usize, NftError> {
    let has_udp = plan.service_ports().any(|sp| sp.protocol == Protocol::UDP);
    if !has_udp {
        return Ok(0);
    }
    let sock = open()?;
    let mut deleted = 0;
    for fam in [NetfilterProtoFamily::IPv4, NetfilterProtoFamily::IPv6] {
        let flows = dump(&sock, fam)?;
        for f in stale_flows(plan, &flows) {
            if delete(&sock, fam, &f)? {
                deleted += 1;
            }
        }
    }
    Ok(deleted)
}

/// Every flow of one family (for tests and tools).
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
    crate::netlink::open()
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
        let size = sock
            .recv(&mut &mut buf[..], 0)
            .map_err(|e| NftError::Conntrack(format!("receiving: {e}")))?;
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
