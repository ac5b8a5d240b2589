//! The layer order of the crate's modules, as crates/nft/README.md ("Layers") writes it,
//! held to the code: no module names (`crate::…`) one of its own layer or of a layer
//! above, and every module of `src/` is in the list. A module's files are one module here (`dump/rule.rs`
//! is `dump`, `model/diff.rs` is `model`): a child reaches its parent by design.

use std::collections::BTreeMap;
use std::path::Path;

/// The layers in the README's order, bottom first (between `<!-- layers -->` and
/// `<!-- /layers -->`, one numbered item each: its modules are the backticked names
/// before ` — `).
fn layers(readme: &str) -> Vec<Vec<String>> {
    let start = readme
        .find("<!-- layers -->")
        .expect("README has a `<!-- layers -->` block");
    let end = readme[start..]
        .find("<!-- /layers -->")
        .expect("the layers block ends")
        + start;
    let mut out = Vec::new();
    for line in readme[start..end].lines() {
        let Some(item) = line.trim_start().strip_prefix(|c: char| c.is_ascii_digit()) else {
            continue;
        };
        // `1. name: `a`, `b` — why`: the modules are the backticked words before ` — `.
        let modules = item.split(" — ").next().unwrap_or_default();
        let layer: Vec<String> = modules
            .split('`')
            .skip(1)
            .step_by(2)
            .map(String::from)
            .collect();
        if !layer.is_empty() {
            out.push(layer);
        }
    }
    out
}

/// The code of a file without its comments (line comments; kproxy writes no block
/// comments in `src/`).
fn code(text: &str) -> String {
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The modules a file's code names: `crate::name` and every first name of a grouped
/// `crate::{a, b::c}`.
fn named(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().next_back();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue; // `kproxy_crate::` and the like
        }
        if let Some(group) = rest.strip_prefix('{') {
            let inner = &group[..group.find('}').unwrap_or(group.len())];
            out.extend(inner.split(',').map(|p| ident(p.trim())));
        } else {
            out.push(ident(rest));
        }
    }
    out.retain(|m| !m.is_empty());
    out
}

fn ident(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect()
}

/// Every `.rs` file below `dir`, with the top module it belongs to.
fn files(src: &Path, dir: &Path, out: &mut Vec<(String, String)>) {
    for entry in std::fs::read_dir(dir).expect("src is readable") {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            files(src, &path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path.strip_prefix(src).expect("below src");
            let first = rel.components().next().expect("a component");
            let module = Path::new(first.as_os_str())
                .file_stem()
                .expect("a name")
                .to_string_lossy()
                .into_owned();
            out.push((rel.display().to_string(), module));
        }
    }
}

#[test]
fn no_module_names_one_of_its_layer_or_above() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let order = layers(&readme);
    let rank: BTreeMap<&str, usize> = order
        .iter()
        .enumerate()
        .flat_map(|(i, layer)| layer.iter().map(move |m| (m.as_str(), i)))
        .collect();
    let listed: usize = order.iter().map(Vec::len).sum();
    assert_eq!(rank.len(), listed, "a module listed twice: {order:?}");
    let src = root.join("src");
    let mut all = Vec::new();
    files(&src, &src, &mut all);
    let mut wrong = Vec::new();
    for (file, module) in &all {
        if module == "lib" {
            continue; // the facade: it declares and re-exports every module
        }
        let Some(&here) = rank.get(module.as_str()) else {
            wrong.push(format!(
                "src/{file}: module `{module}` is not in README's layers"
            ));
            continue;
        };
        let text = std::fs::read_to_string(src.join(file)).expect("readable");
        for m in named(&code(&text)) {
            match rank.get(m.as_str()) {
                Some(_) if m == *module => {}
                Some(&there) if there == here => wrong.push(format!(
                    "src/{file}: `{module}` names `crate::{m}`, a module of its own layer"
                )),
                Some(&there) if there > here => wrong.push(format!(
                    "src/{file}: `{module}` names `crate::{m}`, which stands above it"
                )),
                _ => {}
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The check sees what it must: grouped imports, paths in code, not comments.
#[test]
fn the_check_reads_imports_and_paths() {
    let c =
        code("use crate::{dump::rule, nfnl};\n// crate::record\nlet x = crate::atom::Family::Ip;");
    assert_eq!(named(&c), ["dump", "nfnl", "atom"]);
    let readme = "<!-- layers -->\n1. `error`, `nfnl` — why `x`\n2. `atom`\n<!-- /layers -->";
    assert_eq!(layers(readme), [vec!["error", "nfnl"], vec!["atom"]]);
}
