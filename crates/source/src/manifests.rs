//! The manifest-file source: a file or a directory (recursive; `.yaml`, `.yml`,
//! `.json`) of Kubernetes objects as `kubectl get -o yaml|json` prints them. Reading
//! never stops at a bad file or object: each problem is reported with the file, the
//! document, the object and the field, and everything valid is loaded.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use kproxy_core::ClusterState;
use kproxy_core::ingest::{IngestError, Ownership};
use kproxy_core::manifest::{self, Location, ManifestError};
use kproxy_core::state::Update;

/// A problem found while loading manifests.
#[derive(Debug, thiserror::Error)]
pub enum LoadProblem {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// An object that parsed but failed validation (or a dropped piece of one).
    #[error("{location}: {error}")]
    Invalid {
        location: Location,
        /// Boxed: the variant would make every `Result<_, LoadProblem>` large.
        error: Box<IngestError>,
        skipped: bool,
    },
}

impl LoadProblem {
    /// True when a whole object or file was skipped; false for a dropped field.
    pub fn skipped_object(&self) -> bool {
        match self {
            LoadProblem::Invalid { skipped, .. } => *skipped,
            _ => true,
        }
    }
}

/// Result of loading manifests.
#[derive(Debug, Default)]
pub struct Loaded {
    pub state: ClusterState,
    pub problems: Vec<LoadProblem>,
    pub files: Vec<PathBuf>,
}

/// The manifest files under `path`, sorted (a file is returned as itself).
pub fn files(path: &Path) -> Result<Vec<PathBuf>, LoadProblem> {
    let io = |source| LoadProblem::Io {
        path: path.to_path_buf(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(io)?;
    if meta.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut out = Vec::new();
    let mut stack = vec![path.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let rd = std::fs::read_dir(&dir).map_err(|source| LoadProblem::Io {
            path: dir.clone(),
            source,
        })?;
        for entry in rd {
            let entry = entry.map_err(|source| LoadProblem::Io {
                path: dir.clone(),
                source,
            })?;
            let p = entry.path();
            let ft = entry.file_type().map_err(|source| LoadProblem::Io {
                path: p.clone(),
                source,
            })?;
            let hidden = p
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with('.'));
            if hidden {
                continue;
            }
            if ft.is_dir() {
                stack.push(p);
            } else if matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("yaml" | "yml" | "json")
            ) {
                out.push(p);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// One file read, parsed and ingested: what its objects do to a `ClusterState` (the
/// parsed Kubernetes objects themselves are dropped), and its problems.
#[derive(Debug, Default)]
pub(crate) struct FileRead {
    /// Objects that parsed (including those that then failed validation).
    pub objects: usize,
    pub updates: Vec<Update>,
    /// Documents or objects that could not be parsed.
    pub errors: Vec<ManifestError>,
    /// Objects that failed validation (`true`: skipped) or lost a piece (`false`).
    pub invalid: Vec<(Location, IngestError, bool)>,
}

impl FileRead {
    /// Applies the file's objects to `state`, in file order.
    pub fn apply_to(&self, state: &mut ClusterState) {
        for u in &self.updates {
            state.apply_update(u);
        }
    }

    /// The validation problems, as reported.
    pub fn invalid_problems(&self) -> impl Iterator<Item = LoadProblem> + '_ {
        self.invalid
            .iter()
            .map(|(location, error, skipped)| LoadProblem::Invalid {
                location: location.clone(),
                error: Box::new(error.clone()),
                skipped: *skipped,
            })
    }
}

/// Reads, parses and ingests one file.
pub(crate) fn read_file(
    file: &Path,
    node_name: &str,
    ownership: &Ownership,
) -> std::io::Result<FileRead> {
    let text = std::fs::read_to_string(file)?;
    let parsed = manifest::parse(&file.display().to_string(), &text);
    drop(text);
    let mut out = FileRead {
        objects: parsed.objects.len(),
        errors: parsed.errors,
        ..FileRead::default()
    };
    out.updates.reserve_exact(parsed.objects.len());
    for located in parsed.objects {
        match Update::of(&located.object, ownership, node_name) {
            Ok((update, warnings)) => {
                out.updates.push(update);
                out.invalid.extend(
                    warnings
                        .into_iter()
                        .map(|w| (located.location.clone(), w, false)),
                );
            }
            Err(error) => out.invalid.push((located.location, error, true)),
        }
    }
    out.updates.shrink_to_fit();
    Ok(out)
}

/// Reads `files` with [`read_file`] on one thread per core (the files are independent;
/// parsing dominates); the results come back in the order of `files`.
pub(crate) fn read_files(
    files: &[&Path],
    node_name: &str,
    ownership: &Ownership,
) -> Vec<std::io::Result<FileRead>> {
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(files.len());
    if workers <= 1 {
        return files
            .iter()
            .map(|f| read_file(f, node_name, ownership))
            .collect();
    }
    let next = AtomicUsize::new(0);
    let mut out: Vec<Option<std::io::Result<FileRead>>> = files.iter().map(|_| None).collect();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(file) = files.get(i) else { break };
                        done.push((i, read_file(file, node_name, ownership)));
                    }
                    done
                })
            })
            .collect();
        for w in workers {
            let done = w.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
            for (i, r) in done {
                out[i] = Some(r);
            }
        }
    });
    out.into_iter()
        .map(|r| r.expect("every file is read by a worker"))
        .collect()
}

/// Loads every manifest under `path` into a fresh `ClusterState`. `node_name` picks
/// which Node object is this node's.
pub fn load(path: &Path, node_name: &str, ownership: &Ownership) -> Loaded {
    let mut loaded = Loaded::default();
    let files = match files(path) {
        Ok(f) => f,
        Err(e) => {
            loaded.problems.push(e);
            return loaded;
        }
    };
    let paths: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    for (file, read) in files.iter().zip(read_files(&paths, node_name, ownership)) {
        match read {
            Ok(read) => {
                read.apply_to(&mut loaded.state);
                loaded
                    .problems
                    .extend(read.errors.iter().cloned().map(LoadProblem::Manifest));
                loaded.problems.extend(read.invalid_problems());
            }
            Err(source) => loaded.problems.push(LoadProblem::Io {
                path: file.clone(),
                source,
            }),
        }
    }
    loaded.files = files;
    loaded
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_loads_recursively_and_reports_bad_objects_by_file() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(
            dir.path().join("svc.yaml"),
            "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("sub/eps.json"),
            r#"{"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice","metadata":{"name":"Bad_Name","namespace":"shop","labels":{"kubernetes.io/service-name":"web"}},"addressType":"IPv4","endpoints":[]}"#,
        )
        .unwrap();
        std::fs::write(dir.path().join("notes.txt"), "not a manifest").unwrap();
        let loaded = load(dir.path(), "node-a", &Ownership::default());
        assert_eq!(loaded.files.len(), 2);
        assert_eq!(loaded.state.service_count(), 1);
        assert_eq!(loaded.problems.len(), 1);
        let msg = loaded.problems[0].to_string();
        assert!(
            msg.contains("eps.json")
                && msg.contains("EndpointSlice shop/Bad_Name")
                && msg.contains(".metadata.name"),
            "{msg}"
        );
    }

    #[test]
    fn a_missing_path_is_an_io_problem_naming_it() {
        let loaded = load(Path::new("/nonexistent/kproxy"), "n", &Ownership::default());
        assert!(
            loaded.problems[0]
                .to_string()
                .starts_with("/nonexistent/kproxy")
        );
    }
}
