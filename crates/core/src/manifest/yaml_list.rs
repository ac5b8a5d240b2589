//! A block-style `kind: List` document cut into its items by indentation, the shape
//! `kubectl get -o yaml` prints:
//!
//! ```yaml
//! apiVersion: v1
//! items:
//! - apiVersion: v1
//!   kind: Service
//!   …
//! kind: List
//! ```
//!
//! Each item is then parsed alone, so the parser's per-document node budget applies per
//! object and memory holds one item at a time. Anything else (flow style, an indented
//! root) is not cut and goes to the parser whole.

use std::ops::Range;

pub struct Split {
    /// The document with its items replaced by `items: []`.
    pub skeleton: String,
    /// Byte ranges of the items, first line starting at the `-`.
    pub items: Vec<Range<usize>>,
    /// Column of the `-` of every item.
    pub indent: usize,
}

fn indent_of(line: &str) -> usize {
    line.len() - line.trim_start_matches(' ').len()
}

fn is_item_start(line: &str, indent: usize) -> bool {
    indent_of(line) == indent && {
        let rest = &line[indent..];
        rest.starts_with('-') && rest[1..].chars().next().is_none_or(char::is_whitespace)
    }
}

fn blank_or_comment(line: &str) -> bool {
    let t = line.trim();
    t.is_empty() || t.starts_with('#')
}

pub fn split(text: &str) -> Option<Split> {
    let mut skeleton = String::new();
    let mut items: Vec<Range<usize>> = Vec::new();
    let mut indent = None;
    let mut offset = 0;
    // 0: before `items:`, 1: inside items, 2: after
    let mut phase = 0;
    for line in text.split_inclusive('\n') {
        let here = offset;
        offset += line.len();
        match phase {
            0 => {
                let body = line.split('#').next().unwrap_or("").trim_end();
                if body == "items:" {
                    skeleton.push_str("items: []\n");
                    phase = 1;
                } else {
                    skeleton.push_str(line);
                }
            }
            1 => {
                if blank_or_comment(line) {
                    if let Some(last) = items.last_mut() {
                        last.end = offset;
                    }
                    continue;
                }
                let ind = *indent.get_or_insert(indent_of(line));
                if is_item_start(line, ind) {
                    items.push(here..offset);
                } else if indent_of(line) > ind && !items.is_empty() {
                    if let Some(last) = items.last_mut() {
                        last.end = offset;
                    }
                } else if indent_of(line) == 0 {
                    phase = 2;
                    skeleton.push_str(line);
                } else {
                    return None;
                }
            }
            _ => {
                if indent_of(line) == 0 && !blank_or_comment(line) && line.starts_with('-') {
                    return None;
                }
                skeleton.push_str(line);
            }
        }
    }
    (phase > 0 && !items.is_empty()).then(|| Split {
        skeleton,
        items,
        indent: indent.unwrap_or(0),
    })
}

/// One item's text as a document of its own: the `- ` becomes nothing and every line
/// loses the item's indentation.
pub fn dedent(item: &str, indent: usize) -> String {
    let cut = indent + 2;
    let mut out = String::with_capacity(item.len());
    for (i, line) in item.split_inclusive('\n').enumerate() {
        if i == 0 {
            let rest = &line[indent + 1..];
            out.push_str(rest.strip_prefix(' ').unwrap_or(rest));
        } else {
            let n = line.len() - line.trim_start_matches(' ').len();
            out.push_str(&line[n.min(cut)..]);
        }
    }
    out
}
