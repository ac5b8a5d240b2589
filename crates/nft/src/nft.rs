//! Running the `nft` tool: one script per transaction through `nft -f -`, and reading a
//! table back as JSON (`nft -j list table`) for verification. Every call acts on the
//! calling thread's network namespace (the child inherits it).

use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};

use serde_json::Value;

use crate::error::{NftError, Via};
use crate::model::{Table, Transaction};

const NFT: &str = "nft";

/// Sends `script` as one transaction (`nft -f -` applies a file as one netlink batch:
/// all or nothing).
pub fn run_script(script: &str) -> Result<(), NftError> {
    run(|w| w.write_all(script.as_bytes()).map(|()| script.len())).map(|_| ())
}

/// Sends `tx` as one `nft -f -` transaction, its text written into the pipe as it is
/// rendered (a full sync's script is ≈ 8 MB; it is never held whole). Returns the bytes
/// sent.
pub fn run_transaction(tx: &Transaction) -> Result<usize, NftError> {
    run(|w| tx.write_nft_to(w))
}

/// Runs `nft -f -` with `write` producing its input (as one transaction); the bytes
/// written.
pub(crate) fn run(
    write: impl FnOnce(&mut dyn Write) -> std::io::Result<usize> + Send,
) -> Result<usize, NftError> {
    let mut child = Command::new(NFT)
        .args(["-f", "-"])
        // Errors reach logs and reports in one language whatever the node's locale.
        .env("LC_ALL", "C")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| NftError::Io {
            context: format!("starting `{NFT} -f -`"),
            source: e,
        })?;
    // Its transaction is kproxy's own, not interference (its netlink port id is its pid).
    crate::monitor::note_own(child.id());
    let mut stdin = child.stdin.take().expect("stdin is piped");
    // Written from a thread so a chatty nft can never deadlock us on a full stderr pipe;
    // stdin closes when the thread ends.
    let (out, written) = std::thread::scope(|s| {
        let writer = s.spawn(move || write(&mut stdin));
        let out = child.wait_with_output();
        let written = writer
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("writer thread panicked")));
        (out, written)
    });
    let out = out.map_err(|e| NftError::Io {
        context: format!("waiting for `{NFT} -f -`"),
        source: e,
    })?;
    if !out.status.success() {
        let mut stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        // At a character's boundary: the text is nft's, and may be anything.
        let cut = (0..=stderr.len().min(4000))
            .rev()
            .find(|&i| stderr.is_char_boundary(i))
            .unwrap_or(0);
        stderr.truncate(cut);
        return Err(NftError::Refused {
            via: Via::Nft,
            message: format!("{} ({})", stderr.trim_end(), out.status),
        });
    }
    written.map_err(|e| NftError::Io {
        context: format!("writing the script to `{NFT} -f -`"),
        source: e,
    })
}

/// `nft -j list table FAMILY TABLE`; `Ok(None)` when the table does not exist.
pub fn list_table_json(family: &str, table: &str) -> Result<Option<Value>, NftError> {
    let out = Command::new(NFT)
        .args(["-j", "list", "table", family, table])
        // nft prints the kernel's error as strerror(3) text, which a locale translates;
        // "table absent" is recognised by the C locale's words below.
        .env("LC_ALL", "C")
        .output()
        .map_err(|e| NftError::Io {
            context: format!("running `{NFT} -j list table {family} {table}`"),
            source: e,
        })?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        if stderr.contains("No such file or directory") {
            return Ok(None);
        }
        return Err(NftError::Read(format!(
            "`{NFT} -j list table {family} {table}` ({}): {}",
            out.status,
            stderr.trim_end()
        )));
    }
    serde_json::from_slice(&out.stdout)
        .map(Some)
        .map_err(|e| NftError::Read(e.to_string()))
}

/// A table read back from the kernel, reduced to what kproxy decides: per object
/// (`chain NAME` / `set NAME` / `map NAME`) its content without handles, table names or
/// hook parameters, with set elements sorted and the contents of dynamic sets left out
/// (the kernel fills those from traffic).
pub fn normalize(json: &Value) -> BTreeMap<String, Value> {
    let mut out: BTreeMap<String, Value> = BTreeMap::new();
    let Some(items) = json.get("nftables").and_then(|v| v.as_array()) else {
        return out;
    };
    for item in items {
        let Some(obj) = item.as_object() else {
            continue;
        };
        for (kind, body) in obj {
            match kind.as_str() {
                "chain" => {
                    let name = body["name"].as_str().unwrap_or_default().to_string();
                    out.entry(format!("chain {name}"))
                        .or_insert_with(|| Value::Array(Vec::new()));
                }
                "rule" => {
                    let name = body["chain"].as_str().unwrap_or_default().to_string();
                    let entry = out
                        .entry(format!("chain {name}"))
                        .or_insert_with(|| Value::Array(Vec::new()));
                    if let Value::Array(rules) = entry {
                        rules.push(body["expr"].clone());
                    }
                }
                "set" | "map" => {
                    let name = body["name"].as_str().unwrap_or_default().to_string();
                    let mut b = body.clone();
                    if let Some(m) = b.as_object_mut() {
                        m.remove("handle");
                        m.remove("table");
                        m.remove("family");
                        // nft 1.0.6 lists `flags dynamic,timeout` as just `timeout`.
                        let dynamic = m.get("flags").and_then(|f| f.as_array()).is_some_and(|f| {
                            f.iter()
                                .any(|x| matches!(x.as_str(), Some("dynamic" | "timeout")))
                        });
                        if dynamic {
                            m.remove("elem");
                        } else if let Some(Value::Array(e)) = m.get_mut("elem") {
                            e.sort_by_key(|v| v.to_string());
                        }
                    }
                    out.insert(format!("{kind} {name}"), b);
                }
                _ => {}
            }
        }
    }
    out
}

/// Compares the kernel's copy of `rs`'s table with what `rs` says: loads `rs` into a
/// scratch table (same content, no hooks, so it never sees traffic), reads both back,
/// and lists the objects that differ. Base-chain hook parameters are not compared.
pub fn compare_with_kernel(rs: &Table) -> Result<Vec<String>, NftError> {
    let family = rs.family.nft();
    let Some(kernel) = list_table_json(family, &rs.name)? else {
        return Ok(vec![format!("table {family} {}", rs.name)]);
    };
    let mut scratch = rs.clone();
    scratch.name = format!("{}-verify", rs.name);
    for c in scratch.chains.values_mut() {
        c.hook = None;
    }
    let scratch_name = scratch.name.clone();
    run_transaction(&Transaction::replace(scratch))?;
    let expected = list_table_json(family, &scratch_name);
    let removed = run_script(&format!("delete table {family} {scratch_name}\n"));
    let expected = expected?.ok_or_else(|| NftError::Read("scratch table vanished".into()))?;
    removed?;
    let (k, e) = (normalize(&kernel), normalize(&expected));
    let mut diff = Vec::new();
    for key in k.keys().chain(e.keys()) {
        if k.get(key) != e.get(key) && !diff.contains(key) {
            diff.push(key.clone());
        }
    }
    Ok(diff)
}
