//! Splitting a list response into its items as the bytes arrive. Owns: finding, in a
//! stream of chunks of `{"kind":…,"metadata":{…},"items":[{…},{…}]}`, where each item
//! and the list's `metadata` begin and end, so a list of any size is read holding one
//! item's text at a time (never the whole response), and decoding overlaps the
//! transfer.
//!
//! This is a scanner, not a parser: it tracks only strings (with their escapes) and
//! nesting, which is all that is needed to find a value's end. Each item's text is
//! then decoded on its own (an item that is not valid JSON fails alone, as any bad
//! object does); the metadata is decoded by serde once complete. A body that ends
//! before the root object closes is an error, so a cut-off list is never taken for a
//! complete one.

/// Whose a value being scanned is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Collect {
    /// A root value nobody reads (`kind`, `apiVersion`): scanned past.
    Nothing,
    /// One element of the root `items` array.
    Item,
    /// The root `metadata` value.
    Metadata,
}

/// Where the scanner is, between values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum At {
    /// Before the root object.
    #[default]
    Start,
    /// In the root object, before a key (or its closing brace).
    RootKey,
    /// In the root object, after a key, before its `:`.
    RootColon,
    /// In the root object, after `:`, before the value.
    RootValue,
    /// In the root object, after a value: `,` or `}` next.
    RootNext,
    /// In the root `items` array: an element, `,` or `]` next.
    Items,
    /// After the root object: only whitespace may follow.
    End,
}

/// The value being scanned.
#[derive(Clone, Copy, Debug)]
struct Value {
    collect: Collect,
    /// Nesting depth inside it (0 for a scalar).
    depth: u32,
    /// An element of `items` (so the scanner returns to [`At::Items`] after it).
    in_items: bool,
}

/// The scanner: feed it the body's chunks in order, then call [`Splitter::finish`].
#[derive(Default)]
pub struct Splitter {
    at: At,
    value: Option<Value>,
    in_string: bool,
    escaped: bool,
    /// Inside a root key's string.
    reading_key: bool,
    /// The root key just read, raw (`items` and `metadata` need no unescaping; a key
    /// with escapes is read past and matches neither).
    key: Vec<u8>,
    /// The text of the item or metadata being collected.
    buf: Vec<u8>,
    metadata: Option<Vec<u8>>,
}

/// The largest item or metadata text held: far above any object the API server stores
/// (etcd refuses requests over 1.5 MiB by default), so only a hostile or broken body
/// reaches it, and it costs a bounded buffer, not the node's memory.
pub const MAX_VALUE_BYTES: usize = 32 << 20;

/// Longest root key kept: enough to tell `items` and `metadata`; a longer key matches
/// neither, so its bytes past this are not kept.
const MAX_KEY_BYTES: usize = 16;

/// Why a body is not a list.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SplitError(pub String);

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

impl Splitter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Scans one chunk; calls `item` with the text of every item completed in it.
    pub fn feed(&mut self, chunk: &[u8], mut item: impl FnMut(&[u8])) -> Result<(), SplitError> {
        for &b in chunk {
            self.byte(b, &mut item)?;
        }
        Ok(())
    }

    /// The body ended: the list's metadata text (if it had one), or why the body was
    /// not a complete list.
    pub fn finish(self) -> Result<Option<Vec<u8>>, SplitError> {
        if self.at != At::End {
            return Err(SplitError(
                "the list response ended before its root object closed (cut off)".into(),
            ));
        }
        Ok(self.metadata)
    }

    fn bad(&self, b: u8) -> SplitError {
        SplitError(format!(
            "not a list response: unexpected {:?} in state {:?}",
            b as char, self.at
        ))
    }

    fn byte(&mut self, b: u8, item: &mut impl FnMut(&[u8])) -> Result<(), SplitError> {
        if let Some(v) = self.value {
            return self.in_value(v, b, item);
        }
        if self.reading_key {
            if self.string_ends(b) {
                self.reading_key = false;
                self.at = At::RootColon;
                return Ok(());
            }
            if self.key.len() < MAX_KEY_BYTES {
                self.key.push(b);
            }
            return Ok(());
        }
        if is_ws(b) {
            return Ok(());
        }
        match (self.at, b) {
            (At::Start, b'{') => self.at = At::RootKey,
            (At::RootKey, b'"') => {
                self.key.clear();
                self.reading_key = true;
            }
            (At::RootKey | At::RootNext, b'}') => self.at = At::End,
            (At::RootColon, b':') => self.at = At::RootValue,
            (At::RootNext, b',') => self.at = At::RootKey,
            (At::RootValue, b'[') if self.key == b"items" => self.at = At::Items,
            (At::RootValue, _) => {
                let collect = if self.key == b"metadata" {
                    Collect::Metadata
                } else {
                    Collect::Nothing
                };
                self.start_value(b, collect, false)?;
            }
            (At::Items, b']') => self.at = At::RootNext,
            (At::Items, b',') => {}
            (At::Items, _) => self.start_value(b, Collect::Item, true)?,
            _ => return Err(self.bad(b)),
        }
        Ok(())
    }

    /// Inside a string: whether `b` is its closing quote (tracking escapes).
    fn string_ends(&mut self, b: u8) -> bool {
        if self.escaped {
            self.escaped = false;
        } else if b == b'\\' {
            self.escaped = true;
        } else {
            return b == b'"';
        }
        false
    }

    /// The first byte of a value.
    fn start_value(&mut self, b: u8, collect: Collect, in_items: bool) -> Result<(), SplitError> {
        let depth = match b {
            b'{' | b'[' => 1,
            b'}' | b']' | b',' | b':' => return Err(self.bad(b)),
            b'"' => {
                self.in_string = true;
                0
            }
            _ => 0,
        };
        self.value = Some(Value {
            collect,
            depth,
            in_items,
        });
        if collect != Collect::Nothing {
            self.buf.push(b);
        }
        Ok(())
    }

    fn in_value(
        &mut self,
        mut v: Value,
        b: u8,
        item: &mut impl FnMut(&[u8]),
    ) -> Result<(), SplitError> {
        if self.in_string {
            if self.string_ends(b) {
                self.in_string = false;
            }
        } else if v.depth == 0 {
            // A scalar (number, literal, or a string just closed) ends at the next
            // separator, which belongs to the enclosing array or object.
            if matches!(b, b',' | b']' | b'}') || is_ws(b) {
                self.complete(v, item);
                return self.byte(b, item);
            }
        } else {
            match b {
                b'"' => self.in_string = true,
                b'{' | b'[' => {
                    v.depth = v
                        .depth
                        .checked_add(1)
                        .ok_or_else(|| SplitError("not a list response: nesting too deep".into()))?
                }
                // depth ≥ 1 here: a scalar (depth 0) is handled above.
                b'}' | b']' => v.depth -= 1,
                _ => {}
            }
        }
        if v.collect != Collect::Nothing {
            if self.buf.len() >= MAX_VALUE_BYTES {
                return Err(SplitError(format!(
                    "a list item or the list's metadata is larger than {MAX_VALUE_BYTES} bytes; not read"
                )));
            }
            self.buf.push(b);
        }
        if v.depth == 0 && !self.in_string && matches!(b, b'}' | b']') {
            self.complete(v, item);
        } else {
            self.value = Some(v);
        }
        Ok(())
    }

    /// Hands a complete value to its owner.
    fn complete(&mut self, v: Value, item: &mut impl FnMut(&[u8])) {
        match v.collect {
            Collect::Item => item(&self.buf),
            Collect::Metadata => self.metadata = Some(std::mem::take(&mut self.buf)),
            Collect::Nothing => {}
        }
        self.buf.clear();
        self.value = None;
        self.at = if v.in_items { At::Items } else { At::RootNext };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Items and metadata of `body`, fed in chunks of `size` bytes.
    fn split(body: &str, size: usize) -> Result<(Vec<String>, Option<String>), SplitError> {
        let mut s = Splitter::new();
        let mut items = Vec::new();
        for chunk in body.as_bytes().chunks(size.max(1)) {
            s.feed(chunk, |i| {
                items.push(String::from_utf8(i.to_vec()).unwrap())
            })?;
        }
        let meta = s.finish()?.map(|m| String::from_utf8(m).unwrap());
        Ok((items, meta))
    }

    #[test]
    fn items_and_metadata_at_every_chunk_boundary() {
        let items = [
            r#"{"metadata":{"name":"a \"}]{[ b","namespace":"x"},"spec":{"ports":[{"port":80}]}}"#,
            r#"{"s":"\\","t":"\\\"]","u":[[],{}],"v":null}"#,
            r#"{}"#,
        ];
        let meta = r#"{"resourceVersion":"12","continue":"abc"}"#;
        let bodies = [
            format!(
                r#"{{"kind":"ServiceList","apiVersion":"v1","metadata":{meta},"items":[{}]}}"#,
                items.join(",")
            ),
            // Metadata after the items (serde_json's sorted keys), whitespace everywhere,
            // and kind/apiVersion of every JSON type.
            format!(
                " {{ \"apiVersion\" : 1.5e3 , \"items\" :\n [ {} ] , \"kind\":[\"x]\"], \"metadata\" : {meta} , \"z\": true }}\n",
                items.join(" ,\n ")
            ),
        ];
        for body in &bodies {
            for size in 1..=body.len() {
                let (got, m) = split(body, size).unwrap_or_else(|e| panic!("{size}: {e}"));
                assert_eq!(got, items, "chunks of {size}: {body}");
                assert_eq!(m.as_deref(), Some(meta), "chunks of {size}");
            }
        }
    }

    #[test]
    fn scalar_items_are_handed_over_for_the_decoder_to_refuse() {
        let (items, meta) =
            split(r#"{"items":[1, "a]", null ,{"b":2}],"metadata":{}}"#, 3).unwrap();
        assert_eq!(items, ["1", "\"a]\"", "null", r#"{"b":2}"#]);
        assert_eq!(meta.as_deref(), Some("{}"));
        let (items, meta) = split(r#"{"items":[],"kind":"List"}"#, 5).unwrap();
        assert!(items.is_empty());
        assert_eq!(meta, None);
        assert_eq!(split(r#"{"items":null}"#, 2).unwrap(), (vec![], None));
    }

    #[test]
    fn an_oversized_item_is_an_error_not_an_allocation() {
        let mut s = Splitter::new();
        s.feed(br#"{"items":[{"a":""#, |_| {}).unwrap();
        let chunk = vec![b'x'; 1 << 20];
        let mut fed = 0;
        let err = loop {
            match s.feed(&chunk, |_| {}) {
                Ok(()) => fed += chunk.len(),
                Err(e) => break e,
            }
            assert!(fed <= MAX_VALUE_BYTES, "no limit");
        };
        assert!(err.0.contains("larger than"), "{err}");
        // A long root key is read past, not kept.
        let (items, _) = split(
            &format!(r#"{{"{}":1,"items":[{{}}]}}"#, "k".repeat(1 << 16)),
            4096,
        )
        .unwrap();
        assert_eq!(items, ["{}"]);
    }

    #[test]
    fn a_cut_off_or_foreign_body_is_an_error() {
        let full = r#"{"metadata":{"resourceVersion":"1"},"items":[{"a":1},{"b":2}]}"#;
        for cut in 0..full.len() {
            assert!(split(&full[..cut], 7).is_err(), "cut at {cut}");
        }
        assert!(split(full, 7).is_ok());
        for body in [
            "[1,2]",
            "\"text\"",
            "{\"items\":[1]}x",
            "{\"a\" 1}",
            "{,}",
            "{\"items\":[}",
        ] {
            assert!(split(body, 4).is_err(), "{body}");
        }
    }
}
