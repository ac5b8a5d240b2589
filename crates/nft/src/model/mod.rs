//! The typed nftables model: what kproxy wants in (or reads back from) the kernel, as
//! values, and the one way to get from one state to another.
//!
//! - [`Table`] holds [`Chain`]s (an optional base-chain [`Hook`] and typed rules,
//!   [`crate::rule::Rule`], each identified by [`rule_id`] of its text) and [`Set`]s (a typed [`SetDecl`]
//!   and typed [`Elem`]ents).
//! - [`diff`]`(old, new)` returns a [`Transaction`], an ordered list of [`Op`]s that,
//!   applied to `old`, gives `new`. It decides what changed between the kernel's tables
//!   as read back and the record (adoption, repair, verification: `crate::readback`,
//!   which diffs the structure and runs diff's element step, [`ElementDiff`], over the
//!   kernel's elements packed as read and the record's offered in pieces), and, in a
//!   delta, for the base objects, a changed Service's own chains and sets and
//!   the dispatch groups that appear or go (`crate::record::FamilyRecord::advance`).
//!   A delta's element changes are diff's element step too, over the touched part of
//!   each set (the frontends and shared elements the changed Services touch, before
//!   and after); a full sync's transaction is built from the record's one walk over its
//!   elements (`FamilyRecord::walk_elements`: `create`, `element_pieces`). Tests hold deltas equal to `diff` of whole tables
//!   (crates/nft/tests/incremental.rs) and the full transactions to `diff` from an
//!   absent table (the tests of `record.rs`).
//! - A transaction is rendered as `nft -f` input by [`Transaction::nft_text`] /
//!   [`Transaction::write_nft_to`] (`sync --dry-run`, golden tests, the sameness
//!   test) and as nfnetlink bytes by
//!   `crate::netlink::Batch::transaction` (what is sent: every operation, elements
//!   encoded from the typed elements).
//!
//! By topic: `objects.rs` (set declarations, elements and values, hooks, chains, the
//! table), `tuple.rs` (an element's atoms packed in slots), `transaction.rs` ([`Op`],
//! [`Transaction`], [`Counts`]), `text.rs` (the transaction's nft text) and `diff.rs`
//! ([`diff`] and its element step). For tools and tests the whole table has one door,
//! the record's (`crate::record::desired`, and `render` for its text).
//!
//! Element keys and values are typed ([`Atom`]: addresses, prefixes, protocols, ports,
//! `numgen` indexes; [`Verdict`]), so the netlink writer never parses text, and two
//! elements compare by value (how an adopted kernel table is compared with the desired
//! one).

mod diff;
mod objects;
mod text;
mod transaction;
mod tuple;

pub(crate) use crate::atom::write_u32;
pub use crate::atom::{Atom, Family, Field, MAX_FIELDS, RULE_ID_PREFIX, Verdict};

pub use diff::*;
pub use objects::*;
pub use transaction::*;
pub use tuple::*;

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::net::IpAddr;

    use super::*;
    use crate::atom::rule_id;
    use crate::rule::Rule;
    use crate::rule::{Dir, Expr, Sel};

    /// What applying `tx` to `t` gives (a model of the kernel's transaction, for
    /// checking that `diff` says everything and only what changed).
    fn apply(t: &Table, tx: &Transaction) -> Table {
        let mut t = t.clone();
        for op in &tx.ops {
            match op {
                Op::AddTable { comment, .. } => {
                    if !t.exists {
                        t.exists = true;
                        t.comment = comment.clone();
                    }
                }
                Op::DeleteTable { .. } => {
                    t = Table::absent(t.family, &t.name);
                }
                Op::AddSet { name, decl, .. } => {
                    t.sets.entry(name.clone()).or_insert(Set::new(decl.clone()));
                }
                Op::DeleteSet { name, .. } => {
                    t.sets.remove(name).expect("deleted set exists");
                }
                Op::AddChain { name, hook, .. } => {
                    t.chains.entry(name.clone()).or_insert(Chain {
                        hook: *hook,
                        rules: Vec::new(),
                    });
                }
                Op::FlushChain { name, .. } => t.chains.get_mut(name).unwrap().rules.clear(),
                Op::DeleteChain { name, .. } => {
                    let c = t.chains.remove(name).expect("deleted chain exists");
                    assert!(c.rules.is_empty(), "chain {name} deleted while not empty");
                }
                Op::AddRule { chain, rule, .. } => {
                    t.chains.get_mut(chain).unwrap().rules.push(rule.clone())
                }
                Op::AddElements { set, elems, .. } => {
                    let s = t.sets.get_mut(set).unwrap();
                    for e in elems {
                        assert!(s.elements.insert(e.key.clone(), e.value.clone()).is_none());
                    }
                }
                Op::DeleteElements { set, keys, .. } => {
                    let s = t.sets.get_mut(set).unwrap();
                    for k in keys {
                        assert!(s.elements.remove(k).is_some(), "deleted element exists");
                    }
                }
                Op::AddCounter { name, .. } => {
                    t.counters.insert(name.clone());
                }
                Op::DeleteObject { name, .. } => {
                    t.counters.remove(name);
                }
            }
        }
        t
    }

    /// A full sync holds ≈ 106k elements (key in a `Set`'s map, and again in an `Elem`
    /// of the transaction): their size is most of its transient memory. An upper bound,
    /// so that a change that grows them fails here.
    #[test]
    fn element_sizes() {
        use std::mem::size_of;
        let sizes = [
            ("Atom", size_of::<Atom>()),
            ("Tuple", size_of::<Tuple>()),
            ("Value", size_of::<Value>()),
            ("Option<Value>", size_of::<Option<Value>>()),
            ("Elem", size_of::<Elem>()),
        ];
        println!("{sizes:?}");
        assert!(size_of::<Elem>() <= 80, "{sizes:?}");
    }

    /// A tuple gives back its atoms, and tuples (inline, boxed, or one of each) order
    /// and compare as `(atoms padded with FILLER, len)` do: the order elements are
    /// listed in must not depend on the representation.
    #[test]
    fn tuple_atoms_and_order() {
        let atoms: Vec<Atom> = [
            "0.0.0.0",
            "10.96.0.1",
            "10.96.0.2",
            "255.255.255.255",
            "::",
            "fd00::1",
            "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        ]
        .iter()
        .flat_map(|s| {
            let ip: IpAddr = s.parse().unwrap();
            [Atom::Addr(ip), Atom::Prefix(ip, 0), Atom::Prefix(ip, 24)]
        })
        .chain([0, 6, 17, 255].map(Atom::Proto))
        .chain([0, 80, 65535].map(Atom::Port))
        .chain([0, 1, u32::MAX].map(Atom::Index))
        .collect();
        let mut lists: Vec<Vec<Atom>> = vec![vec![]];
        for a in &atoms {
            lists.push(vec![*a]);
            for b in &atoms {
                lists.push(vec![*a, *b]);
            }
            lists.push(vec![*a, Atom::Proto(6), Atom::Port(80), Atom::Index(3)]);
            lists.push(vec![Atom::Port(80), *a, FILLER]);
        }
        let old = |l: &[Atom]| {
            let mut p = [FILLER; MAX_FIELDS];
            p[..l.len()].copy_from_slice(l);
            (p, l.len())
        };
        let tuples: Vec<Tuple> = lists.iter().map(|l| Tuple::new(l)).collect();
        for (l, t) in lists.iter().zip(&tuples) {
            assert_eq!(&*t.atoms(), &l[..]);
            assert_eq!(t.len(), l.len());
        }
        for (l, t) in lists.iter().zip(&tuples) {
            for (m, u) in lists.iter().zip(&tuples) {
                assert_eq!(t.cmp(u), old(l).cmp(&old(m)), "{l:?} vs {m:?}");
                assert_eq!(t == u, l == m, "{l:?} vs {m:?}");
            }
        }
    }

    fn ip(s: &str) -> Atom {
        Atom::Addr(s.parse().unwrap())
    }

    fn vmap() -> SetDecl {
        SetDecl::map(
            vec![Field::Ipv4Addr, Field::InetProto, Field::InetService],
            SetData::Verdict,
        )
        .with_comment("cluster IPs")
    }

    fn sample() -> Table {
        let mut t = Table::new(Family::Ip, "kproxy");
        t.chains.insert(
            "nat-prerouting".into(),
            Chain {
                hook: Some(Hook::nat(HookPoint::Prerouting, -100)),
                rules: vec![Rule::verdict(Verdict::Jump("services".into()))],
            },
        );
        t.chains.insert(
            "services".into(),
            Chain {
                hook: None,
                rules: vec![Rule::new(vec![Expr::Vmap {
                    sel: vec![Sel::Addr(Family::Ip, Dir::Dst), Sel::L4proto, Sel::Dport],
                    map: "service-ips".into(),
                }])],
            },
        );
        t.chains.insert(
            "svc-a".into(),
            Chain {
                hook: None,
                rules: vec![Rule::verdict(Verdict::Drop)],
            },
        );
        let mut s = Set::new(vmap());
        let key = |a: &str| Tuple::new(&[ip(a), Atom::Proto(6), Atom::Port(80)]);
        s.elements.insert(
            key("10.96.0.1"),
            Some(Value::Verdict(Verdict::Goto("svc-a".into()))),
        );
        s.elements
            .insert(key("10.96.0.2"), Some(Value::Verdict(Verdict::Drop)));
        t.sets.insert("service-ips".into(), s);
        let mut h = Set::new(SetDecl::set(vec![Field::Ipv4Addr]));
        h.elements.insert(Tuple::new(&[ip("10.96.0.1")]), None);
        t.sets.insert("cluster-ips".into(), h);
        t
    }

    /// Variants of `sample`, each one kind of change.
    fn variants() -> Vec<(&'static str, Table)> {
        let key = |a: &str| Tuple::new(&[ip(a), Atom::Proto(6), Atom::Port(80)]);
        let mut v = Vec::new();
        let mut t = sample();
        t.chains.get_mut("svc-a").unwrap().rules =
            vec![Rule::verdict(Verdict::Accept), Rule::verdict(Verdict::Drop)];
        v.push(("rules changed", t));
        let mut t = sample();
        t.chains.remove("svc-a");
        t.sets
            .get_mut("service-ips")
            .unwrap()
            .elements
            .remove(&key("10.96.0.1"));
        v.push(("chain and its element removed", t));
        let mut t = sample();
        t.sets.get_mut("service-ips").unwrap().elements.insert(
            key("10.96.0.2"),
            Some(Value::Verdict(Verdict::Goto("svc-a".into()))),
        );
        v.push(("element re-valued", t));
        let mut t = sample();
        t.sets.remove("cluster-ips");
        t.sets.insert(
            "dnat-c-2".into(),
            Set::new(SetDecl {
                by_expr: true,
                ..SetDecl::map(
                    vec![
                        Field::Ipv4Addr,
                        Field::InetProto,
                        Field::InetService,
                        Field::Numgen(2),
                    ],
                    SetData::Fields(vec![Field::Ipv4Addr, Field::InetService]),
                )
            }),
        );
        t.chains.insert(
            "disp-c-2".into(),
            Chain {
                hook: None,
                rules: vec![Rule::new(vec![Expr::DnatMap {
                    family: Family::Ip,
                    sel: vec![
                        Sel::Addr(Family::Ip, Dir::Dst),
                        Sel::L4proto,
                        Sel::Dport,
                        Sel::Numgen(2),
                    ],
                    map: "dnat-c-2".into(),
                }])],
            },
        );
        v.push(("set removed, map and chain added", t));
        v.push(("same", sample()));
        v.push(("empty table", Table::new(Family::Ip, "kproxy")));
        v
    }

    /// Applying diff(old, new) to old gives new, for every pair of variants, and the
    /// counts say what changed.
    #[test]
    fn diff_applied_to_old_gives_new() {
        let mut all = variants();
        all.push(("absent", Table::absent(Family::Ip, "kproxy")));
        for (a, old) in &all {
            for (b, new) in &all {
                let tx = diff(old, new).unwrap();
                assert!(!tx.replaces, "{a} -> {b}");
                assert_eq!(&apply(old, &tx), new, "{a} -> {b}:\n{}", tx.nft_text());
                if old == new {
                    assert!(tx.is_empty(), "{a} -> {b}: {tx:?}");
                    assert!(tx.counts.is_empty());
                } else {
                    assert!(!tx.is_empty(), "{a} -> {b}");
                }
                // Ordered by phase already: `order` changes nothing.
                let mut o = tx.clone();
                o.order();
                assert_eq!(o, tx, "{a} -> {b}");
            }
        }
    }

    /// `create` is the diff from an absent table.
    #[test]
    fn create_is_the_diff_from_absent() {
        for (name, t) in variants() {
            let absent = Table::absent(t.family, &t.name);
            assert_eq!(
                Transaction::create(t.clone()),
                diff(&absent, &t).unwrap(),
                "{name}"
            );
        }
    }

    /// `create_with` is `create` of the table holding the extra elements too: merged
    /// in key order, the table's value kept on a key both hold, none for an undeclared
    /// set.
    #[test]
    fn create_with_merges_in_key_order() {
        let key = |a: &str| Tuple::new(&[ip(a), Atom::Proto(6), Atom::Port(80)]);
        let goto = |c: &str| Some(Value::Verdict(Verdict::Goto(c.into())));
        let extra = |a: &str, c: &str| Elem {
            key: key(a),
            value: goto(c),
        };
        let more: BTreeMap<String, Vec<Elem>> = [
            (
                "service-ips".to_string(),
                vec![
                    extra("10.96.0.0", "x"),
                    extra("10.96.0.1", "y"),
                    extra("10.96.0.3", "z"),
                ],
            ),
            ("undeclared".to_string(), vec![extra("10.96.0.9", "w")]),
        ]
        .into();
        let mut whole = sample();
        let s = whole.sets.get_mut("service-ips").unwrap();
        s.elements.insert(key("10.96.0.0"), goto("x"));
        s.elements.insert(key("10.96.0.3"), goto("z"));
        assert_eq!(
            Transaction::create_with(sample(), more),
            Transaction::create(whole)
        );
    }

    #[test]
    fn diff_counts_and_text() {
        let old = sample();
        let mut new = sample();
        new.chains.get_mut("svc-a").unwrap().rules = vec![Rule::verdict(Verdict::Accept)];
        let key = Tuple::new(&[ip("10.96.0.2"), Atom::Proto(6), Atom::Port(80)]);
        new.sets
            .get_mut("service-ips")
            .unwrap()
            .elements
            .insert(key, Some(Value::Verdict(Verdict::Goto("svc-a".into()))));
        let tx = diff(&old, &new).unwrap();
        assert_eq!(
            tx.counts,
            Counts {
                chains_changed: 1,
                elements_added: 1,
                elements_deleted: 1,
                ..Counts::default()
            }
        );
        assert_eq!(
            tx.nft_text(),
            format!(
                "flush chain ip kproxy svc-a\n\
                 add rule ip kproxy svc-a accept comment \"kp:{}\"\n\
                 delete element ip kproxy service-ips {{ 10.96.0.2 . tcp . 80 }}\n\
                 add element ip kproxy service-ips {{ 10.96.0.2 . tcp . 80 : goto svc-a }}\n",
                rule_id("accept")
            )
        );
        assert!(!tx.elements_only());
    }

    /// A declaration that cannot change in place replaces the table.
    #[test]
    fn changed_declarations_replace_the_table() {
        let old = sample();
        let mut new = sample();
        new.sets.get_mut("cluster-ips").unwrap().decl.comment = Some("x".into());
        let tx = diff(&old, &new).unwrap();
        assert!(tx.replaces);
        assert_eq!(apply(&old, &tx), new);
        let mut new = sample();
        new.chains.get_mut("nat-prerouting").unwrap().hook =
            Some(Hook::nat(HookPoint::Prerouting, -99));
        let tx = diff(&old, &new).unwrap();
        assert!(tx.replaces);
        assert_eq!(apply(&old, &tx), new);
        assert!(diff(&old, &Table::new(Family::Ip6, "kproxy")).is_err());
        assert!(diff(&old, &Table::new(Family::Ip, "other")).is_err());
    }

    /// Declarations render as kproxy has always written them.
    #[test]
    fn declarations_render_as_nft_text() {
        let text = |d: &SetDecl| {
            let mut s = String::new();
            d.write(&mut s);
            s
        };
        assert_eq!(
            text(&vmap()),
            "type ipv4_addr . inet_proto . inet_service : verdict; comment \"cluster IPs\";"
        );
        let dnat = SetDecl {
            by_expr: true,
            ..SetDecl::map(
                vec![
                    Field::Ipv6Addr,
                    Field::InetProto,
                    Field::InetService,
                    Field::Numgen(3),
                ],
                SetData::Fields(vec![Field::Ipv6Addr, Field::InetService]),
            )
        };
        assert_eq!(
            text(&dnat),
            "typeof ip6 daddr . meta l4proto . th dport . numgen random mod 3 : ip6 daddr . th dport;"
        );
        let aff = SetDecl {
            dynamic: true,
            timeout_secs: Some(10800),
            ..SetDecl::set(vec![Field::Ipv4Addr])
        };
        assert_eq!(
            text(&aff),
            "type ipv4_addr; flags dynamic,timeout; timeout 10800s;"
        );
        let pods = SetDecl {
            interval: true,
            auto_merge: true,
            ..SetDecl::set(vec![Field::Ipv4Addr]).with_comment("local pod CIDRs")
        };
        assert_eq!(
            text(&pods),
            "type ipv4_addr; flags interval; auto-merge; comment \"local pod CIDRs\";"
        );
        let mut h = String::new();
        Hook::nat(HookPoint::Postrouting, 100).write(&mut h);
        assert_eq!(
            h,
            "type nat hook postrouting priority srcnat; policy accept;"
        );
    }

    #[test]
    fn elements_parse_typed_and_write_back() {
        let d = vmap();
        let e = d.parse_elem("10.96.0.1 . udp . 53", "goto svc-x").unwrap();
        assert_eq!(
            e.key,
            Tuple::new(&[ip("10.96.0.1"), Atom::Proto(17), Atom::Port(53)])
        );
        let mut s = String::new();
        e.write(&mut s);
        assert_eq!(s, "10.96.0.1 . udp . 53 : goto svc-x");
        assert!(d.parse_elem("10.96.0.1 . udp", "drop").is_none());
        assert!(d.parse_elem("10.96.0.1 . udp . 53", "reject").is_none());
        assert!(d.parse_elem("fd00::1 . udp . 53", "drop").is_none());
    }

    /// FNV-1a 64 test vectors: the ids a reader of the kernel recomputes.
    #[test]
    fn rule_ids_are_fnv1a_64() {
        assert_eq!(rule_id(""), "cbf29ce484222325");
        assert_eq!(rule_id("a"), "af63dc4c8601ec8c");
        assert_eq!(rule_id("foobar"), "85944171f73967e8");
    }
}
