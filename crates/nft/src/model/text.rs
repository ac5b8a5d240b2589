//! A transaction as `nft -f` input: the one renderer of nft text.

use std::fmt::Write as _;

use crate::atom::{RULE_ID_PREFIX, rule_id};

use super::transaction::*;

/// Elements per `add element`/`delete element` command of the nft text, so no line
/// grows without bound.
pub(crate) const TEXT_ELEMENTS_PER_COMMAND: usize = 1000;

impl Transaction {
    /// The `nft -f` input of this transaction.
    pub fn nft_text(&self) -> String {
        let mut out = String::new();
        self.write_nft_text(&mut out);
        out
    }

    /// Appends the `nft -f` input of this transaction to `out`.
    pub fn write_nft_text(&self, out: &mut String) {
        let mut text = Text {
            buf: std::mem::take(out),
            sink: None,
            sent: 0,
        };
        let written = self.write_text(&mut text);
        debug_assert!(written.is_ok(), "a String sink cannot fail");
        *out = text.buf;
    }

    /// Writes the `nft -f` input of this transaction to `w` as it is rendered, in
    /// pieces of about 64 KiB (a full sync's script is ≈ 6 MB: it is never
    /// held whole). Returns the bytes written.
    pub fn write_nft_to(&self, w: &mut dyn std::io::Write) -> std::io::Result<usize> {
        let mut text = TextStream::new(w);
        text.transaction(self)?;
        text.finish()
    }

    /// The one renderer of nft text, command by command into `out`.
    fn write_text(&self, text: &mut Text<'_>) -> std::io::Result<()> {
        for op in &self.ops {
            let out = &mut text.buf;
            match op {
                Op::AddTable {
                    family,
                    table,
                    comment,
                    dormant,
                } => {
                    let _ = write!(out, "add table {} {table}", family.nft());
                    if comment.is_some() || *dormant {
                        out.push_str(" { ");
                        if let Some(c) = comment {
                            let _ = write!(out, "comment \"{c}\"; ");
                        }
                        if *dormant {
                            out.push_str("flags dormant; ");
                        }
                        out.push('}');
                    }
                    out.push('\n');
                }
                Op::DeleteTable { family, table } => {
                    let _ = writeln!(out, "delete table {} {table}", family.nft());
                }
                Op::AddSet {
                    family,
                    table,
                    name,
                    decl,
                } => {
                    let _ = write!(
                        out,
                        "add {} {} {table} {name} {{ ",
                        decl.kind(),
                        family.nft()
                    );
                    decl.write(out);
                    out.push_str(" }\n");
                }
                Op::DeleteSet {
                    family,
                    table,
                    name,
                    map,
                } => {
                    let kind = if *map { "map" } else { "set" };
                    let _ = writeln!(out, "delete {kind} {} {table} {name}", family.nft());
                }
                Op::AddChain {
                    family,
                    table,
                    name,
                    hook,
                } => {
                    let _ = write!(out, "add chain {} {table} {name}", family.nft());
                    if let Some(h) = hook {
                        out.push_str(" { ");
                        h.write(out);
                        out.push_str(" }");
                    }
                    out.push('\n');
                }
                Op::FlushChain {
                    family,
                    table,
                    name,
                } => {
                    let _ = writeln!(out, "flush chain {} {table} {name}", family.nft());
                }
                Op::DeleteChain {
                    family,
                    table,
                    name,
                } => {
                    let _ = writeln!(out, "delete chain {} {table} {name}", family.nft());
                }
                Op::AddRule {
                    family,
                    table,
                    chain,
                    rule,
                } => {
                    let _ = write!(out, "add rule {} {table} {chain} ", family.nft());
                    let body = out.len();
                    rule.write(out);
                    let id = rule_id(&out[body..]);
                    let _ = writeln!(out, " comment \"{RULE_ID_PREFIX}{id}\"");
                }
                Op::AddElements {
                    family,
                    table,
                    set,
                    elems,
                } => {
                    for chunk in elems.chunks(TEXT_ELEMENTS_PER_COMMAND) {
                        let out = &mut text.buf;
                        let _ = write!(out, "add element {} {table} {set} {{ ", family.nft());
                        for (i, e) in chunk.iter().enumerate() {
                            if i > 0 {
                                out.push_str(", ");
                            }
                            e.write(out);
                        }
                        out.push_str(" }\n");
                        text.line_done()?;
                    }
                    continue;
                }
                Op::DeleteElements {
                    family,
                    table,
                    set,
                    keys,
                } => {
                    for chunk in keys.chunks(TEXT_ELEMENTS_PER_COMMAND) {
                        let out = &mut text.buf;
                        let _ = write!(out, "delete element {} {table} {set} {{ ", family.nft());
                        for (i, k) in chunk.iter().enumerate() {
                            if i > 0 {
                                out.push_str(", ");
                            }
                            k.write(out);
                        }
                        out.push_str(" }\n");
                        text.line_done()?;
                    }
                    continue;
                }
                Op::AddCounter {
                    family,
                    table,
                    name,
                    packets,
                    bytes,
                    ..
                } => {
                    let _ = writeln!(
                        out,
                        "add counter {} {table} {name} {{ packets {packets} bytes {bytes} }}",
                        family.nft()
                    );
                }
                Op::DeleteObject {
                    family,
                    table,
                    kind,
                    name,
                } => {
                    let kind = object_kind(*kind);
                    let _ = writeln!(out, "delete {kind} {} {table} {name}", family.nft());
                }
            }
            text.line_done()?;
        }
        Ok(())
    }
}

/// About how many bytes of nft text [`Transaction::write_nft_to`] writes at a time.
const TEXT_PIECE: usize = 64 * 1024;

/// nft text being rendered: into `buf` alone, or through `buf` into a sink.
struct Text<'a> {
    buf: String,
    sink: Option<&'a mut dyn std::io::Write>,
    sent: usize,
}

impl Text<'_> {
    /// After each command: hands a full piece to the sink.
    fn line_done(&mut self) -> std::io::Result<()> {
        if self.sink.is_some() && self.buf.len() >= TEXT_PIECE {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if let Some(w) = &mut self.sink {
            w.write_all(self.buf.as_bytes())?;
            self.sent += self.buf.len();
            self.buf.clear();
        }
        Ok(())
    }
}

/// nft text written into a sink as it is rendered, in pieces of about 64 KiB
/// ([`Transaction::write_nft_to`]).
pub struct TextStream<'a>(Text<'a>);

impl<'a> TextStream<'a> {
    pub fn new(w: &'a mut dyn std::io::Write) -> TextStream<'a> {
        TextStream(Text {
            buf: String::with_capacity(TEXT_PIECE + 4096),
            sink: Some(w),
            sent: 0,
        })
    }

    /// Appends the transaction's commands.
    pub fn transaction(&mut self, tx: &Transaction) -> std::io::Result<()> {
        tx.write_text(&mut self.0)
    }

    /// Writes what is left; the bytes written in all.
    pub fn finish(mut self) -> std::io::Result<usize> {
        self.0.flush()?;
        Ok(self.0.sent)
    }
}
