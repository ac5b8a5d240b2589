//! The first sync into absent tables (a node's first start, or after `kproxy
//! cleanup`), in nfnetlink transactions: the structure created dormant, the Services'
//! elements in pieces (encoded on a thread while the structure loads), then one
//! transaction that wakes the tables. Why this is safe and what it saves:
//! [`first_sync_into_absent_tables`].

use crate::error::NftError;
use crate::model::{self, Transaction};
use crate::netlink;
use crate::record::FamilyRecord;

/// Elements per nfnetlink transaction of a first sync into absent tables (≈ 180 KB
/// encoded, ≈ 330 KB typed): small against the ≈ 106k elements at 10k × 10, large
/// enough that a transaction's own cost (a `sendmsg`, the commit) stays a few percent.
pub(crate) const ELEMENTS_PER_PIECE: usize = 4096;

/// Encoded pieces waiting for the socket: the encoder runs ahead of the kernel by this
/// many (and no more, so memory stays bounded) while the structure loads.
const PIECES_AHEAD: usize = 2;

/// What a first sync into absent tables sent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PhasedSync {
    /// What the one transaction creating both tables would count.
    pub counts: model::Counts,
    pub netlink_bytes: usize,
    /// The transactions sent (structure, elements, wake).
    pub batches: usize,
}

/// The first sync into absent tables, in the steps of the transaction that creates
/// them ([`Transaction::dormant_for_absent_tables`]), each an nfnetlink transaction
/// handed to `send`: the tables (created dormant), sets, chains and rules and the
/// structure's own elements (from the tables without the Services' elements,
/// [`FamilyRecord::assemble_structure`]), then the Services' elements in transactions
/// of [`ELEMENTS_PER_PIECE`] elements each, typed and encoded piece by piece from the
/// records ([`FamilyRecord::element_pieces`]) by a thread that runs at most
/// [`PIECES_AHEAD`] pieces ahead, and last the transaction that wakes both tables
/// ([`netlink::Batch::wake_tables`]), hooking their base chains.
///
/// Why several transactions are safe here: a dormant table's base chains are not
/// hooked, so no packet meets the tables while they fill, whatever order or grouping
/// the elements arrive in; a failure at any step leaves dormant tables, which the next
/// (full, replacing, one-transaction) sync replaces (adoption refuses a table with
/// flags, [`crate::adopt::adopt`]). A batch must reach the kernel in one `sendmsg` (nfnetlink
/// runs it from one skb), so one transaction of all elements had to be held whole (4.6
/// MB at 10k × 10, on top of their 8 MiB typed); in pieces neither is. It also lets the
/// kernel grow each set's hash table between pieces: a set starts with 4 buckets and
/// its resize runs in a worker that cannot run during one long `sendmsg` on a
/// non-preemptible kernel, so one batch of 80k elements into one map spent a third of
/// its time in `rhashtable_insert_slow` (`perf`; crates/nft/BENCHMARKS.md).
///
/// [`NftError::Encode`] when something does not encode (nothing kproxy writes; the
/// tables may then exist, dormant: a one-transaction replacement must follow). Public
/// so a bench can run it with a sink for `send`.
#[cfg(any(test, feature = "internals"))]
pub fn first_sync_into_absent_tables(
    recs: &[FamilyRecord; 2],
    send: &mut dyn FnMut(netlink::Batch) -> Result<(), NftError>,
) -> Result<PhasedSync, NftError> {
    first_sync_into_absent_tables_with(recs, &mut |_| {}, send)
}

/// [`first_sync_into_absent_tables`], the structure handed to `fill` before it is
/// encoded (its counters stamped, `crate::counters::CounterMemory::fill`).
pub(crate) fn first_sync_into_absent_tables_with(
    recs: &[FamilyRecord; 2],
    fill: &mut dyn FnMut(&mut Transaction),
    send: &mut dyn FnMut(netlink::Batch) -> Result<(), NftError>,
) -> Result<PhasedSync, NftError> {
    let mut bare = Transaction::default();
    for rec in recs {
        bare.extend(Transaction::create(rec.assemble_structure()));
    }
    fill(&mut bare);
    // The structure's own elements (a NodePort address set's) go with it; the base
    // chains' rules go with the wake.
    let (structure, own_elements) = bare.dormant_for_absent_tables();
    let (structure, base_rules) = base_chain_rules_apart(structure);
    let tables: Vec<(model::Family, &str)> = structure
        .ops
        .iter()
        .filter_map(|op| match op {
            model::Op::AddTable { family, table, .. } => Some((*family, table.as_str())),
            _ => None,
        })
        .collect();
    let mut done = PhasedSync {
        counts: structure.counts,
        ..PhasedSync::default()
    };
    let n = std::thread::scope(|s| {
        let (pieces, encoded) = std::sync::mpsc::sync_channel(PIECES_AHEAD);
        let encoder = s.spawn(move || {
            let mut n = 0;
            for rec in recs {
                n += rec.element_pieces(ELEMENTS_PER_PIECE, &mut |tx| {
                    // An element that does not encode ends the pieces; a closed channel
                    // (the sender failed) stops the encoder.
                    let batch = netlink::Batch::transaction(&tx);
                    let last = batch.is_err();
                    pieces.send(batch).map_err(|_| ())?;
                    if last { Err(()) } else { Ok(()) }
                })?;
            }
            Ok::<usize, ()>(n)
        });
        let mut first = netlink::Batch::transaction(&structure)?;
        first.extend(&own_elements)?;
        done.netlink_bytes += first.len();
        done.batches += 1;
        send(first)?;
        for batch in encoded {
            let batch = batch?;
            done.netlink_bytes += batch.len();
            done.batches += 1;
            send(batch)?;
        }
        // Every piece was sent, so the encoder ended without a failure.
        let n = encoder
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p));
        Ok::<usize, NftError>(n.unwrap_or_default())
    })?;
    done.counts.elements_added += n;
    let wake = netlink::Batch::wake_tables(&tables, &base_rules)?;
    done.netlink_bytes += wake.len();
    done.batches += 1;
    send(wake)?;
    Ok(done)
}

/// `structure` without the rules of its base chains, and those rules (in their order).
/// Why they wait for the wake: the kernel validates a table's jumps (loops, depth) at
/// the commit of every transaction that adds a jump or a verdict-map element to it,
/// walking from each base chain every chain and verdict map it reaches
/// (`nft_table_validate`), so with the base chains' rules in place each piece of
/// elements walked every verdict-map element loaded before it: at 40k Services × 10 a
/// piece's commit grew from 9 to 35 ms, the kernel's nftables lock (every other
/// writer of the namespace waits on it) held throughout. With the base chains empty
/// nothing is reachable and a piece's validation is nothing; the wake, which adds them,
/// walks the tables once. The tables are dormant until then, so no packet sees them
/// either way.
fn base_chain_rules_apart(structure: Transaction) -> (Transaction, Transaction) {
    let base: std::collections::BTreeSet<(model::Family, String, String)> = structure
        .ops
        .iter()
        .filter_map(|op| match op {
            model::Op::AddChain {
                family,
                table,
                name,
                hook: Some(_),
            } => Some((*family, table.clone(), name.clone())),
            _ => None,
        })
        .collect();
    let (mut rest, mut rules) = (Transaction::default(), Transaction::default());
    for op in structure.ops {
        match &op {
            model::Op::AddRule {
                family,
                table,
                chain,
                ..
            } if base.contains(&(*family, table.clone(), chain.clone())) => rules.ops.push(op),
            _ => rest.ops.push(op),
        }
    }
    rest.counts = structure.counts;
    (rest, rules)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DataplaneConfig;
    use crate::model::Table;
    use kproxy_core::model::IpFamily;
    use kproxy_core::synthetic::{self, Spec};

    /// A first sync into absent tables sends the base chains' rules in its last
    /// transaction, the one that wakes the tables, and in no other: with them in place
    /// from the first, the kernel's validation of every later piece walked every
    /// verdict-map element loaded before it, holding the nftables lock ever longer.
    #[test]
    fn the_base_chains_rules_come_with_the_wake() {
        let plan = kproxy_core::plan(
            &synthetic::cluster(&Spec::new(3000, 4)),
            "node-0",
            &Default::default(),
        );
        let recs = IpFamily::ALL.map(|f| FamilyRecord::full(&plan, &DataplaneConfig::default(), f));
        let mut batches = Vec::new();
        first_sync_into_absent_tables(&recs, &mut |b| {
            batches.push(b.descriptions());
            Ok(())
        })
        .unwrap();
        assert!(batches.len() > 3, "{} batches", batches.len());
        let base_rule = |d: &String| {
            crate::ruleset::BASE_CHAINS.iter().any(|(chain, ..)| {
                d.starts_with("add rule") && d.contains(&format!(" kproxy {chain} "))
            })
        };
        let (wake, before) = batches.split_last().unwrap();
        for (i, b) in before.iter().enumerate() {
            assert!(!b.iter().any(base_rule), "batch {i}: {b:?}");
        }
        // Both families' three base chains have rules, and the tables are woken after
        // them.
        let chains: std::collections::BTreeSet<String> = wake
            .iter()
            .filter(|d| base_rule(d))
            .map(|d| d.split(' ').take(5).collect::<Vec<_>>().join(" "))
            .collect();
        assert_eq!(chains.len(), 6, "{wake:?}");
        assert_eq!(
            wake.iter().rev().take(2).cloned().collect::<Vec<_>>(),
            ["add table ip6 kproxy", "add table ip kproxy"]
        );
    }

    /// The elements a first sync sends in pieces, split from the transaction that creates
    /// the tables, all encode as nfnetlink messages: the interval set `local-pods` (whose
    /// prefixes are start and end elements) stays with the structure.
    #[test]
    fn the_elements_split_from_the_structure_encode() {
        for pc in crate::record::tests::plan_configs() {
            let plan = kproxy_core::plan(&synthetic::cluster(&Spec::new(60, 4)), "node-0", &pc);
            for family in IpFamily::ALL {
                let rec = FamilyRecord::full(&plan, &DataplaneConfig::default(), family);
                let table = rec.assemble();
                let absent = Table::absent(table.family, &table.name);
                let (_, elements) = model::diff(&absent, &table)
                    .unwrap()
                    .dormant_for_absent_tables();
                assert!(elements.elements_only());
                assert!(netlink::Batch::transaction(&elements).is_ok());
            }
        }
    }
}
