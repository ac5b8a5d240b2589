//! JSON manifests as a stream of documents, each read by a serde visitor that hands the
//! elements of the `items` array of a `kind: …List` document to the caller one by one
//! instead of building the array. `kubectl get -o json` prints `items` before `kind`, so
//! a first pass over the stream reads each document's `kind` (allocating nothing else)
//! and the second knows a List before its items: memory holds the text plus one item,
//! whatever the items contain (kind-less items used to wait for the List's
//! kind, all of them). Each item, and each document read whole, has the YAML reader's
//! per-document budget of nodes; duplicate keys and a budget overrun cost that item or
//! document only, as in YAML.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

use super::{
    Location, MAX_NODES_PER_OBJECT, ManifestError, describe, doc_error, first_line, item_kind,
    with_kind,
};

type Sink<'a> = dyn FnMut(Result<(Location, Value), ManifestError>) + 'a;

pub fn stream(file: &str, bytes: &[u8], f: &mut Sink<'_>) {
    let kinds = document_kinds(bytes);
    let mut de = serde_json::Deserializer::from_slice(bytes);
    for document in 0.. {
        if de.end().is_ok() {
            return;
        }
        let location = Location {
            file: file.to_string(),
            document,
            item: None,
        };
        let list_kind = kinds
            .get(document)
            .cloned()
            .flatten()
            .filter(|k| k.ends_with("List"));
        let mut judge = Judge::default();
        let seed = Document {
            location: location.clone(),
            list_kind,
            judge: &mut judge,
            f: &mut *f,
        };
        match seed.deserialize(&mut de) {
            Ok(Some(v)) => f(judge.verdict(v, location)),
            Ok(None) => {}
            Err(e) => {
                // The stream has no known position after a syntax error: stop.
                f(Err(doc_error(
                    location,
                    "document",
                    ".",
                    first_line(&e.to_string()),
                )));
                return;
            }
        }
    }
}

/// The `kind` of each top-level document (`None`: none, or not a string), up to the
/// first syntax error.
fn document_kinds(bytes: &[u8]) -> Vec<Option<String>> {
    serde_json::Deserializer::from_slice(bytes)
        .into_iter::<KindOnly>()
        .map_while(Result::ok)
        .map(|k| k.0)
        .collect()
}

/// A document's `kind`, everything else skipped unbuilt.
struct KindOnly(Option<String>);

impl<'de> de::Deserialize<'de> for KindOnly {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(KindOnlyVisitor)
    }
}

struct KindOnlyVisitor;

impl<'de> Visitor<'de> for KindOnlyVisitor {
    type Value = KindOnly;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<KindOnly, A::Error> {
        let mut kind = None;
        while let Some(key) = map.next_key::<KeyIsKind>()? {
            if key.0 && kind.is_none() {
                kind = map.next_value::<Value>()?.as_str().map(str::to_string);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(KindOnly(kind))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<KindOnly, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(KindOnly(None))
    }
    fn visit_bool<E>(self, _: bool) -> Result<KindOnly, E> {
        Ok(KindOnly(None))
    }
    fn visit_i64<E>(self, _: i64) -> Result<KindOnly, E> {
        Ok(KindOnly(None))
    }
    fn visit_u64<E>(self, _: u64) -> Result<KindOnly, E> {
        Ok(KindOnly(None))
    }
    fn visit_f64<E>(self, _: f64) -> Result<KindOnly, E> {
        Ok(KindOnly(None))
    }
    fn visit_str<E>(self, _: &str) -> Result<KindOnly, E> {
        Ok(KindOnly(None))
    }
    fn visit_unit<E>(self) -> Result<KindOnly, E> {
        Ok(KindOnly(None))
    }
}

/// Whether a key is `kind`, without allocating it.
struct KeyIsKind(bool);

impl<'de> de::Deserialize<'de> for KeyIsKind {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = KeyIsKind;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E>(self, v: &str) -> Result<KeyIsKind, E> {
                Ok(KeyIsKind(v == "kind"))
            }
        }
        d.deserialize_str(V)
    }
}

/// What reading one object (a List item, or a document read whole) found: its nodes,
/// counted against [`MAX_NODES_PER_OBJECT`], where the reader is, and the first
/// problem. After a problem the rest of the object is read (the stream goes on) but
/// not kept.
#[derive(Default)]
struct Judge {
    nodes: usize,
    path: Vec<Segment>,
    problem: Option<(String, String)>,
}

enum Segment {
    Key(String),
    Index(usize),
}

impl Judge {
    fn field(&self) -> String {
        if self.path.is_empty() {
            return ".".into();
        }
        let mut out = String::new();
        for s in &self.path {
            match s {
                Segment::Key(k) => {
                    out.push('.');
                    out.push_str(k);
                }
                Segment::Index(i) => out.push_str(&format!("[{i}]")),
            }
        }
        out
    }

    fn fail(&mut self, reason: String) {
        if self.problem.is_none() {
            self.problem = Some((self.field(), reason));
        }
    }

    /// Counts one node; false once the object is over budget or has a problem (its
    /// values are no longer kept).
    fn count(&mut self) -> bool {
        self.nodes += 1;
        if self.nodes > MAX_NODES_PER_OBJECT {
            self.fail(format!(
                "more than {MAX_NODES_PER_OBJECT} values in one object; not read"
            ));
        }
        self.problem.is_none()
    }

    /// The object, or the error that costs it.
    fn verdict(self, v: Value, location: Location) -> Result<(Location, Value), ManifestError> {
        match self.problem {
            None => Ok((location, v)),
            Some((field, reason)) => Err(ManifestError {
                location,
                what: describe(&v, None),
                field,
                reason,
            }),
        }
    }
}

/// One top-level document: `Some(value)` for a document to read whole, `None` when
/// its items were streamed to `f`.
struct Document<'a, 'f> {
    location: Location,
    /// The document's kind when it is a `…List`.
    list_kind: Option<String>,
    judge: &'a mut Judge,
    f: &'a mut Sink<'f>,
}

impl<'de> DeserializeSeed<'de> for Document<'_, '_> {
    type Value = Option<Value>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Document<'_, '_> {
    type Value = Option<Value>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = Map::new();
        let mut streamed = false;
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) || (streamed && key == "items") {
                self.judge.path.push(Segment::Key(key));
                self.judge.fail("duplicate key".into());
                map.next_value::<IgnoredAny>()?;
                self.judge.path.pop();
            } else if key == "items"
                && let Some(list_kind) = &self.list_kind
            {
                let item_kind = item_kind(list_kind);
                map.next_value_seed(Items {
                    location: &self.location,
                    item_kind: item_kind.as_deref(),
                    f: &mut *self.f,
                })?;
                streamed = true;
            } else {
                self.judge.path.push(Segment::Key(key));
                let v = map.next_value_seed(Strict(&mut *self.judge))?;
                let Some(Segment::Key(key)) = self.judge.path.pop() else {
                    unreachable!("the key pushed above")
                };
                out.insert(key, v);
            }
        }
        if !streamed || self.judge.problem.is_some() {
            // A duplicate key or an overrun beside the items is reported with the
            // document; its items were judged one by one.
            return Ok(Some(Value::Object(out)));
        }
        Ok(None)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Some(Value::Array(Vec::new())))
    }
    fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
        Ok(Some(Value::Bool(v)))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(Some(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(Some(v.into()))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
        Ok(Some(v.into()))
    }
    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Some(v.into()))
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

/// The `items` of a List: each element read alone, with its own budget, and handed
/// to the caller.
struct Items<'a, 'f> {
    location: &'a Location,
    item_kind: Option<&'a str>,
    f: &'a mut Sink<'f>,
}

impl<'de> DeserializeSeed<'de> for Items<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Items<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of items")
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        for i in 0.. {
            let mut judge = Judge::default();
            let Some(item) = seq.next_element_seed(Strict(&mut judge))? else {
                break;
            };
            let location = Location {
                item: Some(i),
                ..self.location.clone()
            };
            (self.f)(judge.verdict(with_kind(item, self.item_kind), location));
        }
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        self.not_a_list()
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        self.not_a_list()
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        self.not_a_list()
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        self.not_a_list()
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        self.not_a_list()
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        self.not_a_list()
    }
}

impl Items<'_, '_> {
    fn not_a_list<E>(self) -> Result<(), E> {
        (self.f)(Err(doc_error(
            self.location.clone(),
            "List",
            ".items",
            "not a list".into(),
        )));
        Ok(())
    }
}

/// A JSON value read under a [`Judge`]: duplicate keys and a budget overrun are
/// recorded there, and what follows them is consumed but not kept.
struct Strict<'a>(&'a mut Judge);

impl<'de> DeserializeSeed<'de> for Strict<'_> {
    type Value = Value;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Strict<'_> {
    type Value = Value;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(self.scalar(Value::Bool(v)))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(self.scalar(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(self.scalar(v.into()))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(self.scalar(v.into()))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(if self.0.count() {
            v.into()
        } else {
            Value::Null
        })
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(self.scalar(v.into()))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(self.scalar(Value::Null))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let judge = self.0;
        let mut out = Vec::new();
        let mut keep = Keep::new(judge.count());
        for i in 0.. {
            judge.path.push(Segment::Index(i));
            let v = seq.next_element_seed(Strict(&mut *judge))?;
            judge.path.pop();
            match v {
                Some(v) if keep.this(judge) => out.push(v),
                Some(_) => {}
                None => break,
            }
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let judge = self.0;
        let mut out = Map::new();
        let mut keep = Keep::new(judge.count());
        while let Some(key) = map.next_key::<String>()? {
            let duplicate = out.contains_key(&key);
            judge.path.push(Segment::Key(key));
            if duplicate {
                judge.fail("duplicate key".into());
            }
            let v = map.next_value_seed(Strict(&mut *judge))?;
            let Some(Segment::Key(key)) = judge.path.pop() else {
                unreachable!("the key pushed above")
            };
            // A duplicate's value does not replace the first (that names the object).
            if !duplicate && keep.this(judge) {
                out.insert(key, v);
            }
        }
        Ok(Value::Object(out))
    }
}

/// Which values a mapping or sequence keeps: all until a problem, then the one
/// that held it (so that the report can name the object), then none.
struct Keep {
    open: bool,
    after_problem: bool,
}

impl Keep {
    fn new(open: bool) -> Keep {
        Keep {
            open,
            after_problem: false,
        }
    }

    fn this(&mut self, judge: &Judge) -> bool {
        if !self.open || self.after_problem {
            return false;
        }
        self.after_problem = judge.problem.is_some();
        true
    }
}

impl Strict<'_> {
    fn scalar(self, v: Value) -> Value {
        if self.0.count() { v } else { Value::Null }
    }
}
