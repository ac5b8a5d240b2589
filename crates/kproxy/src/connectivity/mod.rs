//! `kproxy connectivity-test`'s pure parts: what is checked and expected
//! ([`checks`]), the objects created ([`objects`]), the clients' script and the reading
//! of its output ([`script`]), the verdicts, table and JSON ([`report`]). The I/O
//! against the API server is `cmd_connectivity.rs`'s.

pub mod checks;
pub mod objects;
pub mod report;
pub mod script;
