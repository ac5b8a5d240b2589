//! Reading a table's named objects (kproxy's traffic counters, and anything another
//! program put there) in time linear in their number: each object the table's own
//! references name is asked for by name (`NFT_MSG_GETOBJ` without `NLM_F_DUMP`, looked
//! up in the kernel's object name hash), the requests pipelined in batches over the one
//! socket; the object dump is the fallback when the references do not account for
//! every object the table holds.
//!
//! Why not the dump: the kernel's object dump (`nf_tables_dump_obj`) fills one
//! ≈ 32 KiB message per round and starts each round from the table's first object,
//! skipping the ones earlier rounds sent, so a dump of n objects walks ≈ n² / (2 × the
//! objects per message) of them: 140,000 counters (10k Services × 10 endpoints) took
//! 34 s to read, against 0.27 s for the rest of the table. A lookup by name
//! (`nf_tables_getobj`, `nft_obj_lookup`) touches one object.
//!
//! Why it is complete: the names asked for are those the table's object maps and
//! rules name (the kernel refuses a reference to an object that does not exist), each
//! port's fallback counter (named like its new-connection counter), and those the
//! caller knows (its record's counters, the counters it read before), which cover the
//! counters nothing names (an endpoint's while it is not ready). The table's use count
//! (`NFTA_TABLE_USE`: its chains, named sets, objects and flowtables; not its
//! anonymous sets, measured) minus the chains and named sets read says how many
//! objects it holds; when the objects found by name are that many, they are all of
//! them. A count too high only sends the reading to the dump; one too low would let
//! an object go unseen, which `tests/monitor.rs` holds against (another program's
//! counter in a table with an anonymous set). So another program's counter or quota,
//! a flowtable or a transaction in flight sends the reading to the dump: slower,
//! never wrong.

use std::collections::BTreeSet;

use super::{Reader, error_code, messages, object};
use crate::atom::Family;
use crate::counters::RawCounter;
use crate::error::NftError;
use crate::nfnl::*;

/// GETOBJ requests sent at once: each answer (≈ 200 bytes, its skb trimmed to about a
/// kilobyte by `netlink_trim`) waits in the socket's receive buffer until read, and an
/// answer that does not fit is lost (`ENOBUFS`), so a batch stays far below the buffer
/// ([`RCVBUF`]).
const BATCH: usize = 256;
/// The reading socket's receive buffer while objects are read by name.
const RCVBUF: usize = 4 << 20;

/// How a table's objects were read, and what it cost the kernel (a test's and the
/// readback bench's measure: deterministic, unlike a duration).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ObjectRead {
    /// Read by name (else by the dump).
    pub by_name: bool,
    /// Messages the kernel sent: one per object asked for by name, one per ≈ 32 KiB
    /// round of the dump.
    pub messages: usize,
    /// Objects the kernel walked to answer: one per lookup by name; for the dump,
    /// Σ over its rounds of (objects sent before + in it), as each round skips what
    /// earlier rounds sent.
    pub visits: u64,
}

/// The objects of table `family table` as `(type, name, counter values)`, and how they
/// were read: by name when the counters of `names` (those the table's elements and
/// rules name, and those the caller knows of) found are all `expected` objects (the
/// table's use count less its chains and named sets), else by one dump of the table's
/// objects.
pub(super) fn read_objects(
    r: &mut Reader,
    family: Family,
    table: &str,
    names: &BTreeSet<String>,
    expected: Option<usize>,
    mut each: impl FnMut(Object),
) -> Result<ObjectRead, NftError> {
    if let Some((found, messages)) = complete_by_name(r, family, table, names, expected)? {
        found.into_iter().for_each(&mut each);
        return Ok(ObjectRead {
            by_name: true,
            messages,
            visits: messages as u64,
        });
    }
    let (mut messages, mut sent) = (0usize, 0u64);
    let mut visits = 0u64;
    r.request(
        &format!("the named objects of table {family} {table}"),
        NFT_MSG_GETOBJ,
        NLM_F_DUMP,
        family.nfproto(),
        &[(NFTA_OBJ_TABLE, table)],
        |p| {
            let (tbl, name, kind, counter) = object(p);
            if tbl == table {
                each((kind, name, counter));
            }
            sent += 1;
            Ok(())
        },
    )?;
    // Rounds are not seen apart from here (several messages per datagram): model them
    // as the dump fills them, ≈ 32 KiB each, from the objects sent.
    if sent > 0 {
        let per_round = (DUMP_ROUND_BYTES / OBJECT_MESSAGE_BYTES).max(1) as u64;
        let mut before = 0u64;
        while before < sent {
            let this = per_round.min(sent - before);
            visits += before + this;
            before += this;
            messages += 1;
        }
        // The last round walks them all to find nothing left.
        visits += sent;
    }
    Ok(ObjectRead {
        by_name: false,
        messages,
        visits,
    })
}

/// An object as read: its type, name and, for a counter, its values.
pub(super) type Object = (u32, String, Option<RawCounter>);

/// The counters of `names` read by name, and the answers it took, when they are all
/// `expected` objects of the table; `None` when they cannot be or are not (the
/// caller dumps the objects, or reads more names first).
pub(super) fn complete_by_name(
    r: &mut Reader,
    family: Family,
    table: &str,
    names: &BTreeSet<String>,
    expected: Option<usize>,
) -> Result<Option<(Vec<Object>, usize)>, NftError> {
    let Some(expected) = expected.filter(|&e| names.len() >= e) else {
        return Ok(None);
    };
    let mut found = Vec::with_capacity(expected);
    let messages = by_name(r, family, table, names, |o| found.push(o))?;
    if found.len() == expected {
        return Ok(Some((found, messages)));
    }
    tracing::debug!(
        table,
        expected,
        found = found.len(),
        "the names known do not account for all the table's objects"
    );
    Ok(None)
}

/// The most one dump round holds (`netlink_dump`'s buffer, at most 32 KiB).
const DUMP_ROUND_BYTES: usize = 32 << 10;
/// A counter object's answer as the dump sends it (name, table, values, comment).
const OBJECT_MESSAGE_BYTES: usize = 180;

/// Asks for each of `names` (counters) in batches of [`BATCH`] requests sent at once;
/// hands each object found to `each`. An object that does not exist (`ENOENT`) is
/// skipped. Returns the answers received.
fn by_name(
    r: &mut Reader,
    family: Family,
    table: &str,
    names: &BTreeSet<String>,
    mut each: impl FnMut(Object),
) -> Result<usize, NftError> {
    use nix::sys::socket::{setsockopt, sockopt};
    let what = || format!("the counters of table {family} {table}");
    setsockopt(&r.sock, sockopt::RcvBufForce, &RCVBUF)
        .or_else(|_| setsockopt(&r.sock, sockopt::RcvBuf, &RCVBUF))
        .map_err(|e| NftError::Io {
            context: format!("raising the receive buffer to read {}", what()),
            source: e.into(),
        })?;
    let names: Vec<&String> = names.iter().collect();
    let mut answers = 0;
    let mut req = Vec::with_capacity(BATCH * 128);
    for batch in names.chunks(BATCH) {
        req.clear();
        let first = r.seq.wrapping_add(1);
        for name in batch {
            r.seq = r.seq.wrapping_add(1);
            getobj(&mut req, r.seq, family, table, name);
        }
        r.sock.send(&req, 0).map_err(|e| NftError::Io {
            context: format!("asking the kernel for {}", what()),
            source: e,
        })?;
        let mut pending = batch.len();
        while pending > 0 {
            let n = r
                .sock
                .recv(&mut &mut r.buf[..], 0)
                .map_err(|e| NftError::Io {
                    context: format!("reading the kernel's answers about {}", what()),
                    source: crate::nfnl::answer_error(e),
                })?;
            for m in messages(&r.buf[..n], &what())? {
                if m.seq.wrapping_sub(first) >= batch.len() as u32 {
                    continue; // a late answer to an earlier request
                }
                pending = pending.saturating_sub(1);
                answers += 1;
                if m.kind == NLMSG_ERROR {
                    match error_code(m.payload) {
                        0 => {}
                        // Gone since the names were read: not there.
                        c if c == -libc::ENOENT => {}
                        c => {
                            return Err(NftError::Read(format!(
                                "{}: {}",
                                what(),
                                std::io::Error::from_raw_os_error(-c)
                            )));
                        }
                    }
                    continue;
                }
                let (tbl, name, kind, counter) = object(m.payload.get(4..).unwrap_or_default());
                if tbl == table {
                    each((kind, name, counter));
                }
            }
        }
    }
    Ok(answers)
}

/// Appends one GETOBJ request for counter `name` of table `family table`: no
/// `NLM_F_DUMP` (a lookup by name) and no `NLM_F_ACK` (the answer is the object, or an
/// error), so one answer per request.
fn getobj(req: &mut Vec<u8>, seq: u32, family: Family, table: &str, name: &str) {
    let (table, name) = (format!("{table}\0"), format!("{name}\0"));
    let kind = NFT_OBJECT_COUNTER.to_be_bytes();
    let attrs: [(u16, &[u8]); 3] = [
        (NFTA_OBJ_TABLE, table.as_bytes()),
        (NFTA_OBJ_NAME, name.as_bytes()),
        (NFTA_OBJ_TYPE, &kind),
    ];
    super::append_request(req, NFT_MSG_GETOBJ, 0, seq, family.nfproto(), &attrs);
}
