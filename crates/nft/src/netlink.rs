//! Set and map elements written to the kernel over nfnetlink, without the `nft` tool:
//! the delta of a sync that only adds and deletes elements (an endpoint became ready,
//! terminating or gone; a Service port gained or lost endpoints) goes out as one
//! nfnetlink batch — one transaction, all or nothing, like `nft -f` — on a socket kept
//! open between syncs.
//!
//! Why not `nft` for these: at 10k Services one `nft -f` costs ≈ 5 ms to start, a few
//! ms to fetch its cache and parse, and 10–20 ms *closing its netlink socket* after a
//! transaction that deleted elements (the close waits for the kernel to release the
//! deleted elements; measured with `strace -T`: `close(3)` 18.6 ms). A socket that
//! stays open does not wait. Chains, rules and set declarations stay on `nft -f`: the
//! netlink crates cannot express kproxy's rules (numgen maps, dynsets), and those change
//! rarely.
//!
//! Elements are kept as nft text in the record; this module parses them back by the
//! set's declared type (`type …` / `typeof …`) and encodes them as nft does: each field
//! of a concatenation padded to 4 bytes, addresses and ports in network order, the
//! `numgen` index in host order. A type it does not know makes the caller fall back to
//! `nft -f` ([`SetType::parse`] returns `None`), never a guess.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_netfilter::nftables::{
    DataAttribute, ListAttribute, NfTablesMessage, SetElementAttribute, SetElementList,
    SetElementMessage, TableAttribute, TableMessage, Verdict, VerdictAttribute,
};
use netlink_packet_netfilter::none::ControlMessage;
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

use crate::NftError;

/// `NFNL_SUBSYS_NFTABLES`: the batch header's resource id names the subsystem.
const NFNL_SUBSYS_NFTABLES: u16 = 10;
/// Elements per message are capped so the nested element list stays under the 64 KiB
/// an attribute length can say.
const MAX_ELEMENTS_BYTES: usize = 48 * 1024;
/// The send buffer a new socket starts with; raised to the size of a larger batch (a
/// batch must reach the kernel in one `sendmsg`, as `nft` sends it too).
const INITIAL_SNDBUF: usize = 1 << 20;

/// Opens a netfilter netlink socket in the calling thread's network namespace.
pub(crate) fn open() -> Result<Socket, std::io::Error> {
    let mut sock = Socket::new(NETLINK_NETFILTER)?;
    sock.bind_auto()?;
    sock.connect(&SocketAddr::new(0, 0))?;
    Ok(sock)
}

/// One field of a set key or map value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Field {
    Ipv4,
    Ipv6,
    /// `inet_proto` / `meta l4proto`: one byte.
    Proto,
    /// `inet_service` / `th dport`: two bytes, network order.
    Service,
    /// `numgen random mod N`: a 32-bit register in host order.
    Numgen,
}

impl Field {
    fn parse(s: &str) -> Option<Field> {
        Some(match s.trim() {
            "ipv4_addr" | "ip daddr" | "ip saddr" => Field::Ipv4,
            "ipv6_addr" | "ip6 daddr" | "ip6 saddr" => Field::Ipv6,
            "inet_proto" | "meta l4proto" => Field::Proto,
            "inet_service" | "th dport" => Field::Service,
            s if s.starts_with("numgen random mod ") => Field::Numgen,
            _ => return None,
        })
    }

    fn encode(self, s: &str, out: &mut Vec<u8>) -> Option<()> {
        let s = s.trim();
        match self {
            Field::Ipv4 => out.extend_from_slice(&s.parse::<Ipv4Addr>().ok()?.octets()),
            Field::Ipv6 => out.extend_from_slice(&s.parse::<Ipv6Addr>().ok()?.octets()),
            Field::Proto => out.push(match s {
                "tcp" => 6,
                "udp" => 17,
                "sctp" => 132,
                n => n.parse().ok()?,
            }),
            Field::Service => out.extend_from_slice(&s.parse::<u16>().ok()?.to_be_bytes()),
            Field::Numgen => out.extend_from_slice(&s.parse::<u32>().ok()?.to_ne_bytes()),
        }
        Some(())
    }
}

/// Encodes `a . b . c` by `fields`: a single field as is, each field of a
/// concatenation padded to 4 bytes (nft's register layout).
fn encode_fields(fields: &[Field], s: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(fields.len() * 16);
    let mut parts = s.split(" . ");
    for f in fields {
        f.encode(parts.next()?, &mut out)?;
        if fields.len() > 1 {
            out.resize(out.len().next_multiple_of(4), 0);
        }
    }
    parts.next().is_none().then_some(out)
}

/// What a map's elements point to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Data {
    Verdict,
    Value(Vec<Field>),
}

/// A set's or map's element type, from its declaration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SetType {
    pub key: Vec<Field>,
    pub data: Option<Data>,
}

impl SetType {
    /// `None` for anything this module does not encode (intervals, dynamic sets,
    /// unknown types): those elements go through `nft -f`.
    pub fn parse(decl: &str) -> Option<SetType> {
        let spec = decl.split(';').next()?.trim();
        if decl.contains("interval") || decl.contains("dynamic") {
            return None;
        }
        let spec = spec
            .strip_prefix("typeof ")
            .or_else(|| spec.strip_prefix("type "))?;
        let (key, data) = match spec.split_once(" : ") {
            Some((k, d)) => (k, Some(d)),
            None => (spec, None),
        };
        let fields = |s: &str| s.split(" . ").map(Field::parse).collect::<Option<Vec<_>>>();
        Some(SetType {
            key: fields(key)?,
            data: match data.map(str::trim) {
                None => None,
                Some("verdict") => Some(Data::Verdict),
                Some(d) => Some(Data::Value(fields(d)?)),
            },
        })
    }

    /// One element's attributes: its key, and for a map its value (`value` is nft text:
    /// `goto CHAIN`, `drop`, or `a . b`).
    fn element(&self, key: &str, value: Option<&str>) -> Option<Vec<SetElementAttribute>> {
        let mut attrs = vec![SetElementAttribute::Key(DataAttribute::Value(
            encode_fields(&self.key, key)?,
        ))];
        if let Some(v) = value {
            let data = match self.data.as_ref()? {
                Data::Verdict => DataAttribute::Verdict(verdict(v)?),
                Data::Value(fields) => DataAttribute::Value(encode_fields(fields, v)?),
            };
            attrs.push(SetElementAttribute::Data(data));
        }
        Some(attrs)
    }
}

fn verdict(s: &str) -> Option<Vec<VerdictAttribute>> {
    const NF_DROP: u32 = 0;
    const NF_ACCEPT: u32 = 1;
    let code = |v| vec![VerdictAttribute::Code(v)];
    Some(match s.trim().split_once(' ') {
        None => match s.trim() {
            "drop" => code(Verdict::Other(NF_DROP)),
            "accept" => code(Verdict::Other(NF_ACCEPT)),
            "return" => code(Verdict::Return),
            "continue" => code(Verdict::Continue),
            _ => return None,
        },
        Some((kind, chain)) => {
            let v = match kind {
                "goto" => Verdict::Goto,
                "jump" => Verdict::Jump,
                _ => return None,
            };
            vec![
                VerdictAttribute::Code(v),
                VerdictAttribute::Chain(chain.trim().to_string()),
            ]
        }
    })
}

/// One transaction of element changes, encoded and ready to send.
#[derive(Debug, Default)]
pub struct Batch {
    bytes: Vec<u8>,
    /// Per element message: (sequence number, offset in `bytes`, what it does).
    messages: Vec<(u32, usize, String)>,
    /// Messages so far, batch header included (the next sequence number).
    count: u32,
}

impl Batch {
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    fn push(
        &mut self,
        family: NetfilterProtoFamily,
        flags: u16,
        inner: impl Into<NetfilterPayload>,
        what: String,
    ) {
        self.count += 1;
        let seq = self.count;
        let mut hdr = NetlinkHeader::default();
        hdr.flags = NLM_F_REQUEST | flags;
        hdr.sequence_number = seq;
        let msg = match inner.into() {
            NetfilterPayload::Control(c) => {
                NetfilterMessage::new(NetfilterHeader::new(family, 0, NFNL_SUBSYS_NFTABLES), c)
            }
            NetfilterPayload::Tables(t) => {
                NetfilterMessage::new(NetfilterHeader::new(family, 0, 0), t)
            }
        };
        let mut packet = NetlinkMessage::new(hdr, NetlinkPayload::from(msg));
        packet.finalize();
        let start = self.bytes.len();
        self.bytes.resize(start + packet.buffer_len(), 0);
        packet.serialize(&mut self.bytes[start..]);
        if matches!(
            packet.payload,
            NetlinkPayload::InnerMessage(NetfilterMessage {
                inner: NetfilterMessageInner::NfTables(_),
                ..
            })
        ) {
            self.messages.push((seq, start, what));
        }
    }

    /// Adds (`add`) or deletes the elements `items` (key, value) of `set` in `table`
    /// of `family` (`ip`/`ip6`). `None` when an element does not fit `ty`.
    pub fn elements<'a>(
        &mut self,
        add: bool,
        family: &str,
        table: &str,
        set: &str,
        ty: &SetType,
        items: impl Iterator<Item = (&'a str, &'a str)>,
    ) -> Option<()> {
        if self.bytes.is_empty() {
            self.push(
                NetfilterProtoFamily::Unspec,
                0,
                ControlMessage::BatchBegin,
                String::new(),
            );
        }
        let fam = proto_family(family).ok()?;
        let mut chunk = Vec::new();
        let mut size = 0;
        let flush = |b: &mut Batch, chunk: &mut Vec<ListAttribute<SetElementAttribute>>| {
            if chunk.is_empty() {
                return;
            }
            let list = vec![
                SetElementList::Table(table.to_string()),
                SetElementList::Set(set.to_string()),
                SetElementList::Elements(std::mem::take(chunk)),
            ];
            let m = SetElementMessage { attributes: list };
            let (msg, flags, verb) = if add {
                (NfTablesMessage::NewSetElement(m), NLM_F_CREATE, "add")
            } else {
                (NfTablesMessage::DeleteSetElement(m), 0, "delete")
            };
            b.push(
                fam,
                flags,
                msg,
                format!("{verb} element {family} {table} {set}"),
            );
        };
        for (k, v) in items {
            let value = (add && ty.data.is_some()).then_some(v);
            let attrs = ty.element(k, value)?;
            // Key, value and the nesting headers; chain names dominate.
            size += 32 + k.len() + v.len() + 24;
            chunk.push(ListAttribute::Element(attrs));
            if size >= MAX_ELEMENTS_BYTES {
                flush(self, &mut chunk);
                size = 0;
            }
        }
        flush(self, &mut chunk);
        Some(())
    }

    /// Closes the batch (nothing can be added after). Only its last message asks for
    /// an acknowledgement: the kernel runs the whole batch inside `sendmsg`, so that
    /// answer arrives after any error of an earlier message (a few hundred answers
    /// would overflow the socket's receive buffer on a full sync).
    fn finish(mut self) -> Batch {
        if let Some((_, offset, _)) = self.messages.last() {
            let at = offset + 6;
            let flags = u16::from_ne_bytes([self.bytes[at], self.bytes[at + 1]]) | NLM_F_ACK;
            self.bytes[at..at + 2].copy_from_slice(&flags.to_ne_bytes());
        }
        if !self.bytes.is_empty() {
            self.push(
                NetfilterProtoFamily::Unspec,
                0,
                ControlMessage::BatchEnd,
                String::new(),
            );
        }
        self
    }
}

enum NetfilterPayload {
    Control(ControlMessage),
    Tables(NfTablesMessage),
}

impl From<ControlMessage> for NetfilterPayload {
    fn from(c: ControlMessage) -> Self {
        NetfilterPayload::Control(c)
    }
}

impl From<NfTablesMessage> for NetfilterPayload {
    fn from(t: NfTablesMessage) -> Self {
        NetfilterPayload::Tables(t)
    }
}

/// A netfilter netlink socket kept between syncs, in the network namespace of the
/// thread that opened it; reopened if a later call comes from another namespace.
pub struct Writer {
    sock: Socket,
    netns: u64,
    sndbuf: usize,
}

fn current_netns() -> Result<u64, NftError> {
    std::fs::metadata("/proc/thread-self/ns/net")
        .map(|m| m.ino())
        .map_err(|e| NftError::Io {
            context: "reading /proc/thread-self/ns/net".into(),
            source: e,
        })
}

fn setsockopt<T>(sock: &Socket, opt: libc::c_int, value: &T) -> std::io::Result<()> {
    // SAFETY: `value` is a valid T for the duration of the call, and its size is passed.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            (value as *const T).cast(),
            std::mem::size_of::<T>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn set_sndbuf(sock: &Socket, size: usize) -> std::io::Result<()> {
    let size = libc::c_int::try_from(size).unwrap_or(libc::c_int::MAX);
    // SO_SNDBUFFORCE needs CAP_NET_ADMIN, which kproxy has; fall back to the capped one.
    setsockopt(sock, libc::SO_SNDBUFFORCE, &size)
        .or_else(|_| setsockopt(sock, libc::SO_SNDBUF, &size))
}

/// The netlink messages in one datagram, decoded (undecodable ones skipped).
fn messages(buf: &[u8]) -> impl Iterator<Item = NetlinkPayload<NetfilterMessage>> + '_ {
    let mut offset = 0;
    std::iter::from_fn(move || {
        while offset + 16 <= buf.len() {
            let len =
                u32::from_ne_bytes(buf[offset..offset + 4].try_into().expect("4 bytes")) as usize;
            if len < 16 || offset + len > buf.len() {
                return None;
            }
            let m = <NetlinkMessage<NetfilterMessage>>::deserialize(&buf[offset..offset + len]);
            offset += len.next_multiple_of(4);
            if let Ok(m) = m {
                return Some(m.payload);
            }
        }
        None
    })
}

fn proto_family(family: &str) -> Result<NetfilterProtoFamily, NftError> {
    match family {
        "ip" => Ok(NetfilterProtoFamily::IPv4),
        "ip6" => Ok(NetfilterProtoFamily::IPv6),
        f => Err(NftError::Invalid(format!("nft family {f:?}"))),
    }
}

impl Writer {
    /// Opens the socket in the calling thread's network namespace.
    pub fn open() -> Result<Writer, NftError> {
        let io = |context: &str| {
            let context = context.to_string();
            move |source| NftError::Io { context, source }
        };
        let sock = open().map_err(io("opening a netfilter netlink socket"))?;
        // Errors carry only the failing message's header, not the whole batch back.
        sock.set_cap_ack(true)
            .map_err(io("setting NETLINK_CAP_ACK"))?;
        set_sndbuf(&sock, INITIAL_SNDBUF).map_err(io("raising the netlink send buffer"))?;
        let rcvbuf: libc::c_int = 1 << 20;
        setsockopt(&sock, libc::SO_RCVBUFFORCE, &rcvbuf)
            .or_else(|_| setsockopt(&sock, libc::SO_RCVBUF, &rcvbuf))
            .map_err(io("raising the netlink receive buffer"))?;
        // The kernel answers while processing the batch inside sendmsg, so replies are
        // queued before we read; the timeout only guards against a kernel that does not.
        let timeout = libc::timeval {
            tv_sec: 5,
            tv_usec: 0,
        };
        setsockopt(&sock, libc::SO_RCVTIMEO, &timeout)
            .map_err(io("setting the netlink receive timeout"))?;
        Ok(Writer {
            sock,
            netns: current_netns()?,
            sndbuf: INITIAL_SNDBUF,
        })
    }

    /// Whether table `family name` exists (one GETTABLE request).
    pub fn table_exists(&self, family: &str, name: &str) -> Result<bool, NftError> {
        self.drain();
        let mut hdr = NetlinkHeader::default();
        hdr.flags = NLM_F_REQUEST | NLM_F_ACK;
        let msg = NetfilterMessage::new(
            NetfilterHeader::new(proto_family(family)?, 0, 0),
            NfTablesMessage::GetTable(TableMessage {
                attributes: vec![TableAttribute::Name(name.to_string())],
            }),
        );
        let mut packet = NetlinkMessage::new(hdr, NetlinkPayload::from(msg));
        packet.finalize();
        let mut buf = vec![0; packet.buffer_len()];
        packet.serialize(&mut buf);
        self.sock.send(&buf, 0).map_err(|e| NftError::Io {
            context: format!("asking the kernel for table {family} {name}"),
            source: e,
        })?;
        let mut found = false;
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let size = self
                .sock
                .recv(&mut &mut buf[..], 0)
                .map_err(|e| NftError::Io {
                    context: format!("waiting for the kernel's answer about table {family} {name}"),
                    source: e,
                })?;
            for m in messages(&buf[..size]) {
                match m {
                    NetlinkPayload::Error(e) => {
                        return match e.code.map_or(0, |c| c.get()) {
                            0 => Ok(found),
                            c if c == -libc::ENOENT => Ok(false),
                            c => Err(NftError::Netlink(format!(
                                "get table {family} {name}: {}",
                                std::io::Error::from_raw_os_error(-c)
                            ))),
                        };
                    }
                    NetlinkPayload::InnerMessage(_) => found = true,
                    _ => {}
                }
            }
        }
    }

    /// Drops replies left from an aborted batch, so they are not read as answers to the
    /// next one.
    fn drain(&self) {
        let mut buf = vec![0u8; 1 << 16];
        while self
            .sock
            .recv(&mut &mut buf[..], libc::MSG_DONTWAIT)
            .is_ok_and(|n| n > 0)
        {}
    }

    /// True when the calling thread is in the namespace the socket was opened in.
    pub fn in_current_netns(&self) -> Result<bool, NftError> {
        Ok(current_netns()? == self.netns)
    }

    /// Sends the batch as one transaction and waits for the kernel's answer to every
    /// message; the first error names the message it failed on.
    pub fn send(&mut self, batch: Batch) -> Result<(), NftError> {
        let batch = batch.finish();
        if batch.is_empty() {
            return Ok(());
        }
        self.drain();
        if batch.bytes.len() + (64 << 10) > self.sndbuf {
            let size = batch.bytes.len() + (64 << 10);
            set_sndbuf(&self.sock, size).map_err(|e| NftError::Io {
                context: format!("raising the netlink send buffer to {size} bytes"),
                source: e,
            })?;
            self.sndbuf = size;
        }
        let sent = self.sock.send(&batch.bytes, 0).map_err(|e| NftError::Io {
            context: format!("sending a {}-byte nfnetlink batch", batch.bytes.len()),
            source: e,
        })?;
        if sent != batch.bytes.len() {
            return Err(NftError::Netlink(format!(
                "sent {sent} of {} bytes of the batch",
                batch.bytes.len()
            )));
        }
        let last = batch.messages.last().map_or(0, |(seq, _, _)| *seq);
        let (mut acked, mut first_error) = (false, None::<(u32, i32)>);
        let mut buf = vec![0u8; 1 << 16];
        // Everything the kernel says about the batch is queued before `send` returns:
        // read it all, blocking (up to the receive timeout) only until the last message's
        // acknowledgement or an error has come.
        loop {
            let flags = if acked || first_error.is_some() {
                libc::MSG_DONTWAIT
            } else {
                0
            };
            let size = match self.sock.recv(&mut &mut buf[..], flags) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && flags != 0 => break,
                Err(e) => {
                    return Err(NftError::Io {
                        context: format!(
                            "reading the kernel's answer to a {}-message nfnetlink batch",
                            batch.messages.len()
                        ),
                        source: e,
                    });
                }
            };
            for m in messages(&buf[..size]) {
                if let NetlinkPayload::Error(e) = m {
                    let seq = e
                        .header
                        .get(8..12)
                        .map_or(0, |b| u32::from_ne_bytes(b.try_into().expect("4 bytes")));
                    match e.code.map_or(0, |c| c.get()) {
                        0 => acked |= seq == last,
                        code => {
                            first_error.get_or_insert((seq, code));
                        }
                    }
                }
            }
        }
        match first_error {
            None => Ok(()),
            Some((seq, code)) => {
                let what = batch
                    .messages
                    .iter()
                    .find(|(s, _, _)| *s == seq)
                    .map_or("the batch", |(_, _, w)| w.as_str());
                Err(NftError::Netlink(format!(
                    "{what}: {}",
                    std::io::Error::from_raw_os_error(-code)
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_types_from_kproxy_declarations() {
        use Field::*;
        let cases: &[(&str, Option<SetType>)] = &[
            (
                "type ipv4_addr . inet_proto . inet_service : verdict; comment \"x\";",
                Some(SetType {
                    key: vec![Ipv4, Proto, Service],
                    data: Some(Data::Verdict),
                }),
            ),
            (
                "typeof ip6 daddr . meta l4proto . th dport . numgen random mod 3 : ip6 daddr . th dport;",
                Some(SetType {
                    key: vec![Ipv6, Proto, Service, Numgen],
                    data: Some(Data::Value(vec![Ipv6, Service])),
                }),
            ),
            (
                "type ipv4_addr . ipv4_addr; comment \"endpoint IP . endpoint IP\";",
                Some(SetType {
                    key: vec![Ipv4, Ipv4],
                    data: None,
                }),
            ),
            ("type ipv4_addr; flags interval; auto-merge;", None),
            ("type ipv4_addr; flags dynamic,timeout; timeout 600s;", None),
            ("type ether_addr;", None),
        ];
        for (decl, want) in cases {
            assert_eq!(&SetType::parse(decl), want, "{decl}");
        }
    }

    /// Byte layouts as `nft --debug=netlink` prints them for the same elements (words
    /// shown little-endian there): e.g. `0100000a 00000006 00005000 00000001 :
    /// 0201f40a 0000901f` for `10.0.0.1 . tcp . 80 . 1 : 10.244.1.2 . 8080`.
    #[test]
    fn encodings_match_nft() {
        use Field::*;
        let n = 1u32.to_ne_bytes();
        let cases: &[(&[Field], &str, Vec<u8>)] = &[
            (
                &[Ipv4, Proto, Service, Numgen],
                "10.0.0.1 . tcp . 80 . 1",
                [&[10, 0, 0, 1, 6, 0, 0, 0, 0, 80, 0, 0][..], &n].concat(),
            ),
            (
                &[Ipv4, Service],
                "10.244.1.2 . 8080",
                vec![10, 244, 1, 2, 0x1f, 0x90, 0, 0],
            ),
            (
                &[Proto, Service],
                "udp . 30053",
                vec![17, 0, 0, 0, 0x75, 0x65, 0, 0],
            ),
            (&[Ipv4], "10.96.0.1", vec![10, 96, 0, 1]),
            (&[Service], "443", vec![1, 0xbb]),
            (
                &[Ipv6],
                "fd00::1",
                vec![0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
            ),
        ];
        for (fields, s, want) in cases {
            assert_eq!(encode_fields(fields, s).as_ref(), Some(want), "{s}");
        }
        // Wrong arity or unparsable fields are refused, not guessed.
        assert_eq!(encode_fields(&[Ipv4, Service], "10.0.0.1"), None);
        assert_eq!(encode_fields(&[Ipv4], "10.0.0.1 . 80"), None);
        assert_eq!(encode_fields(&[Ipv4], "fd00::1"), None);
        assert_eq!(encode_fields(&[Proto], "icmp"), None);
    }

    #[test]
    fn verdicts() {
        assert_eq!(
            verdict("goto svc-1"),
            Some(vec![
                VerdictAttribute::Code(Verdict::Goto),
                VerdictAttribute::Chain("svc-1".into())
            ])
        );
        assert_eq!(
            verdict("drop"),
            Some(vec![VerdictAttribute::Code(Verdict::Other(0))])
        );
        assert_eq!(verdict("reject"), None);
        assert_eq!(verdict("dnat to 1.2.3.4"), None);
    }
}
