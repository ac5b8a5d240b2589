//! Adoption, the pure half of reading kproxy's tables back: a [`RawTable`] (what
//! [`crate::dump`] read from the kernel) and the desired model [`Table`] → the kernel's
//! structure in the model's vocabulary, so that `model::diff(kernel, desired)` moves
//! the structure and [`crate::readback`] then compares the elements set by set. Rules
//! count as the desired ones only when they do what those do ([`crate::dump::rule`]),
//! not by their `kp:` ids alone; anything it cannot account for is an [`AdoptError`] and
//! the caller replaces the table as a whole. Apart from [`crate::dump`], above it: the
//! reading and its rule decoder (`crate::dump::rule`) know the kernel's bytes, this
//! module the desired model's terms.

use std::collections::BTreeMap;

use crate::atom::{concat_type, fields_len};
use crate::dump::rule::decode;
use crate::dump::{
    RawData, RawElement, RawHook, RawRule, RawSet, RawTable, decode_intervals, decode_tuple,
};
use crate::model::{
    Chain, ChainType, Family, Field, Hook, RULE_ID_PREFIX, Set, SetData, SetDecl, Table, Tuple,
    Value, Verdict,
};
use crate::nfnl::{
    NF_ACCEPT, NFT_DATA_VERDICT, NFT_SET_INTERVAL, NFT_SET_MAP, NFT_SET_OBJECT, NFT_SET_TIMEOUT,
};
use crate::rule::Rule;

/// Why a table cannot be adopted (the caller replaces it as a whole).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("table {family} {table}: {what}")]
pub struct AdoptError {
    pub family: Family,
    pub table: String,
    pub what: String,
}

/// Marks a chain whose rules do what the desired ones do but lack their `kp:` ids: it
/// differs from every desired chain, so the diff flushes it and adds the desired rules.
const UNTAGGED_RULES: &str = "rules whose comments are not kproxy's ids";

/// Does the kernel's base chain have hook `h` (policy accept, as kproxy declares)?
fn hook_matches(raw: &RawHook, h: &Hook) -> bool {
    let ty = match h.ty {
        ChainType::Filter => "filter",
        ChainType::Nat => "nat",
    };
    raw.kind == ty
        && raw.hooknum == h.hook.number()
        && raw.priority == h.priority
        && raw.policy == NF_ACCEPT
}

/// Does the kernel's set have the declaration `decl`? Checks what the dump shows: key
/// and data types and lengths, interval/timeout flags, timeout, comment.
fn set_matches(raw: &RawSet, decl: &SetDecl) -> Result<(), String> {
    let flag = |f: u32| raw.flags & f != 0;
    if flag(NFT_SET_INTERVAL) != decl.interval {
        return Err("interval flag differs".into());
    }
    if flag(NFT_SET_TIMEOUT) != decl.timeout_secs.is_some() {
        return Err("timeout flag differs".into());
    }
    if let Some(t) = decl.timeout_secs
        && raw.timeout != Some(u64::from(t) * 1000)
    {
        return Err(format!("timeout {:?} ms instead of {t} s", raw.timeout));
    }
    if decl.comment.as_deref() != raw.comment.as_deref() {
        return Err(format!(
            "comment {:?} instead of {:?}",
            raw.comment, decl.comment
        ));
    }
    if raw.key_len != fields_len(&decl.key) {
        return Err(format!("key length {} bytes", raw.key_len));
    }
    // `typeof` keys may be stored with other type ids; lengths cover them.
    if !decl.by_expr && raw.key_type != concat_type(&decl.key) {
        return Err(format!("key type {:#x}", raw.key_type));
    }
    match &decl.data {
        _ if flag(NFT_SET_OBJECT) != (decl.data == Some(SetData::Counter)) => {
            Err("object map flag differs".into())
        }
        None if flag(NFT_SET_MAP) => Err("a map where a set is declared".into()),
        None => Ok(()),
        Some(SetData::Counter) => Ok(()),
        Some(_) if !flag(NFT_SET_MAP) => Err("a set where a map is declared".into()),
        Some(SetData::Verdict) => match raw.data_type {
            Some(NFT_DATA_VERDICT) => Ok(()),
            t => Err(format!("data type {t:?} instead of verdict")),
        },
        Some(SetData::Fields(fields)) => match raw.data_len {
            Some(n) if n == fields_len(fields) => Ok(()),
            n => Err(format!("data length {n:?}")),
        },
    }
}

/// The kernel's elements of a set declared `decl`, typed.
pub(crate) fn decode_elements(
    raw: &RawSet,
    decl: &SetDecl,
    v6: bool,
) -> Result<BTreeMap<Tuple, Option<Value>>, String> {
    if raw.elements.misfits() > 0 {
        return Err(format!(
            "{} elements that do not fit the set's own declaration",
            raw.elements.misfits()
        ));
    }
    if decl.interval {
        let prefixes = decode_intervals(v6, raw.elements.iter())
            .ok_or_else(|| "interval elements that are not prefixes".to_string())?;
        return Ok(prefixes.into_iter().map(|t| (t, None)).collect());
    }
    let mut out = BTreeMap::new();
    for e in raw.elements.iter() {
        let (key, value) = decode_element(e, decl)?;
        out.insert(key, value);
    }
    Ok(out)
}

/// One element of a set declared `decl` (not an interval set), typed.
pub(crate) fn decode_element(
    e: RawElement<'_>,
    decl: &SetDecl,
) -> Result<(Tuple, Option<Value>), String> {
    let key = decode_tuple(&decl.key, e.key)
        .ok_or_else(|| format!("element key {:02x?} does not fit the type", e.key))?;
    let value = match (&decl.data, e.data) {
        (None, None) => None,
        (Some(SetData::Verdict), Some(RawData::Verdict { code, chain })) => Some(Value::Verdict(
            Verdict::from_netlink(code, chain)
                .ok_or_else(|| format!("element {key}: verdict {code:#x} {chain:?}"))?,
        )),
        (Some(SetData::Counter), Some(RawData::Object(name))) => Some(Value::Counter(name.into())),
        (Some(SetData::Fields(f)), Some(RawData::Value(b))) => {
            Some(Value::Data(decode_tuple(f, b).ok_or_else(|| {
                format!("element {key}: value {b:02x?} does not fit")
            })?))
        }
        _ => return Err(format!("element {key}: data does not fit the declaration")),
    };
    Ok((key, value))
}

/// The kernel's table as a model [`Table`] in the desired one's terms: `diff(kernel,
/// desired)` is then the transaction that brings the kernel to the desired state.
/// Chains holding exactly the desired rules (by their ids) take the desired rules'
/// text; other chains are marked so that the diff flushes and refills them. Objects the
/// diff cannot repair in place (a foreign table comment, a base chain hooked otherwise,
/// a set declared otherwise, elements that do not decode) are an error.
pub fn adopt(raw: &RawTable, desired: &Table) -> Result<Table, AdoptError> {
    let mut kernel = adopt_structure(raw, desired)?;
    let v6 = desired.family == Family::Ip6;
    for (name, set) in kernel.sets.iter_mut() {
        let Some(want) = desired.sets.get(name) else {
            continue;
        };
        // A dynamic set is filled by the datapath (affinity), never by kproxy.
        if want.decl.dynamic {
            continue;
        }
        let rs = &raw.sets[name];
        set.elements = decode_elements(rs, &want.decl, v6)
            .map_err(|e| adopt_error(desired, format!("set {name}: {e}")))?;
    }
    Ok(kernel)
}

fn adopt_error(desired: &Table, what: String) -> AdoptError {
    AdoptError {
        family: desired.family,
        table: desired.name.clone(),
        what,
    }
}

/// [`adopt`] without the sets' elements: the kernel's table header, chains, rules and
/// set declarations in the desired table's terms, every set empty. Adoption compares
/// the elements set by set against the record ([`crate::readback`]) instead of holding
/// them typed.
pub fn adopt_structure(raw: &RawTable, desired: &Table) -> Result<Table, AdoptError> {
    let err = |what: String| adopt_error(desired, what);
    if raw.comment != desired.comment || raw.flags != 0 {
        return Err(err(format!(
            "comment {:?} and flags {:#x}: not a table kproxy made",
            raw.comment, raw.flags
        )));
    }
    let mut kernel = Table::new(desired.family, &desired.name);
    kernel.comment = raw.comment.clone();
    kernel.counters = raw.counters.keys().cloned().collect();
    for (name, rc) in &raw.chains {
        let want = desired.chains.get(name);
        let hook = match (&rc.hook, want) {
            (None, Some(w)) if w.hook.is_none() => None,
            (None, None) => None,
            (Some(h), Some(w)) if w.hook.as_ref().is_some_and(|wh| hook_matches(h, wh)) => w.hook,
            (h, _) => {
                return Err(err(format!(
                    "chain {name}: hook {h:?} is not the declared {:?}",
                    want.map(|w| w.hook)
                )));
            }
        };
        let decoded: Vec<Rule> = rc
            .rules
            .iter()
            .map(|k| decode(&k.exprs, desired.family, raw))
            .collect();
        // A rule is kproxy's when it does what the wanted rule does and carries its id.
        let tagged = |r: &Rule, k: &RawRule| {
            k.comment
                .as_deref()
                .and_then(|c| c.strip_prefix(RULE_ID_PREFIX))
                == Some(r.id().as_str())
        };
        let same = want.is_some_and(|w| {
            w.rules.len() == rc.rules.len()
                && w.rules
                    .iter()
                    .zip(&rc.rules)
                    .zip(&decoded)
                    .all(|((r, k), d)| d.same(r) && tagged(r, k))
        });
        let rules = match want {
            Some(w) if same => w.rules.clone(),
            // The same rules under other comments: still not what kproxy wrote.
            Some(w) if w.rules == decoded => {
                let mut rules = decoded;
                rules.push(Rule::unknown(UNTAGGED_RULES));
                rules
            }
            _ => decoded,
        };
        kernel.chains.insert(name.clone(), Chain { hook, rules });
    }
    for (name, rs) in &raw.sets {
        let set = match desired.sets.get(name) {
            Some(w) => {
                set_matches(rs, &w.decl).map_err(|e| err(format!("set {name}: {e}")))?;
                Set::new(w.decl.clone())
            }
            // Deleted whole by the diff: only whether it is a map matters (the delete
            // command says which).
            None => Set::new(if rs.flags & NFT_SET_OBJECT != 0 {
                SetDecl::map(vec![Field::Ipv4Addr], SetData::Counter)
            } else if rs.flags & NFT_SET_MAP != 0 {
                SetDecl::map(vec![Field::Ipv4Addr], SetData::Verdict)
            } else {
                SetDecl::set(vec![Field::Ipv4Addr])
            }),
        };
        kernel.sets.insert(name.clone(), set);
    }
    Ok(kernel)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::HookPoint;

    #[test]
    fn hooks_match() {
        let raw = |hooknum, priority| RawHook {
            hooknum,
            priority,
            kind: "nat".into(),
            policy: 1,
        };
        let out = Hook::nat(HookPoint::Output, -100);
        assert!(hook_matches(&raw(3, -100), &out));
        assert!(!hook_matches(&raw(3, 0), &out));
        assert!(!hook_matches(&raw(1, -100), &out));
        assert!(!hook_matches(
            &RawHook {
                policy: 0,
                ..raw(3, -100)
            },
            &out
        ));
    }
}
