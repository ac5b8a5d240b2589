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
    /// A FIFO, device or socket (or a symlink to one) named like a manifest: reading it
    /// could block forever or never end, so it is not read.
    #[error("{path}: not a regular file ({what}); not read")]
    NotRegular { path: PathBuf, what: &'static str },
    #[error("{path}: {size} bytes is more than the limit of {limit} bytes; not read")]
    TooLarge {
        path: PathBuf,
        size: u64,
        limit: u64,
    },
    /// A directory reached a second time (a symlink loop, or a second link to it): its
    /// files were read once, where it was first met.
    #[error(
        "{path}: directory already read as {first} (a symlink loop or a second link); not followed"
    )]
    DirectoryRepeat { path: PathBuf, first: PathBuf },
    /// A directory below the manifest path that could not be listed: its files are not
    /// known (the rest of the tree is read; `kproxy run` keeps what they held).
    #[error("{path}: cannot list this directory: {source}; its files are not read")]
    UnreadableDirectory {
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
            LoadProblem::DirectoryRepeat { .. } => false,
            _ => true,
        }
    }

    /// True when objects may be missing because a file or document could not be read
    /// or parsed (as opposed to an object that parsed and was judged invalid, which is
    /// named in the report): a state built despite this may lack objects nobody named.
    pub fn loses_unknown_objects(&self) -> bool {
        !matches!(
            self,
            LoadProblem::Invalid { .. } | LoadProblem::DirectoryRepeat { .. }
        )
    }
}

/// Limits on what is read, and the checks that manifest files need beyond what ingestion
/// does for every source (the apiserver did them for the API source).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadLimits {
    /// Files larger than this are not read (reported as [`LoadProblem::TooLarge`]).
    pub max_file_bytes: u64,
    /// The apiserver's `--service-node-port-range`: node ports outside it are dropped
    /// ([`kproxy_core::ingest::restrict_node_ports`]). `None`: not checked.
    pub node_port_range: Option<std::ops::RangeInclusive<u16>>,
}

/// The apiserver's default `--service-node-port-range`.
pub const DEFAULT_NODE_PORT_RANGE: std::ops::RangeInclusive<u16> = 30000..=32767;

/// 1 GiB: a `kubectl get -o yaml` dump of 50,000 Services and their EndpointSlices is
/// about 160 MiB.
pub const DEFAULT_MAX_FILE_BYTES: u64 = 1 << 30;

impl Default for ReadLimits {
    fn default() -> Self {
        ReadLimits {
            max_file_bytes: DEFAULT_MAX_FILE_BYTES,
            node_port_range: Some(DEFAULT_NODE_PORT_RANGE),
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

fn kind_of(ft: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

/// The manifest files under `path`, sorted (a file is returned as itself), and the
/// entries named like manifests that are not regular files (not read). Symlinks are
/// followed to regular files and directories only, and every directory (by device and
/// inode) is read once: a symlink back to an ancestor is reported and not followed
/// (two links to `.` made the walk endless). A directory below `path` that cannot be
/// listed is reported ([`LoadProblem::UnreadableDirectory`]) and costs only itself: the
/// walk goes on. Only `path` itself failing is an error.
pub fn files(path: &Path) -> Result<(Vec<PathBuf>, Vec<LoadProblem>), LoadProblem> {
    use std::os::unix::fs::MetadataExt;
    let io = |source| LoadProblem::Io {
        path: path.to_path_buf(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_dir() {
        if !meta.is_file() {
            return Err(LoadProblem::NotRegular {
                path: path.to_path_buf(),
                what: kind_of(meta.file_type()),
            });
        }
        return Ok((vec![path.to_path_buf()], Vec::new()));
    }
    let mut out = Vec::new();
    let mut skipped = Vec::new();
    let mut visited =
        std::collections::HashMap::from([((meta.dev(), meta.ino()), path.to_path_buf())]);
    let mut stack = vec![path.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let unreadable = |source| LoadProblem::UnreadableDirectory {
            path: dir.clone(),
            source,
        };
        let rd = match std::fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(source) if dir == path => return Err(io(source)),
            Err(source) => {
                skipped.push(unreadable(source));
                continue;
            }
        };
        for entry in rd {
            let entry = match entry {
                Ok(e) => e,
                Err(source) if dir == path => return Err(io(source)),
                Err(source) => {
                    skipped.push(unreadable(source));
                    break;
                }
            };
            let p = entry.path();
            let hidden = p
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with('.'));
            if hidden {
                continue;
            }
            let ft = match entry.file_type() {
                Ok(ft) => ft,
                Err(source) => {
                    skipped.push(LoadProblem::Io { path: p, source });
                    continue;
                }
            };
            let manifest = matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("yaml" | "yml" | "json")
            );
            // Only directories, and what could be a manifest, are looked at further.
            if !(ft.is_dir() || ft.is_symlink() || manifest) {
                continue;
            }
            let meta = match std::fs::metadata(&p) {
                Ok(m) => m,
                Err(source) => {
                    skipped.push(LoadProblem::Io { path: p, source });
                    continue;
                }
            };
            let ft = meta.file_type();
            if ft.is_dir() {
                match visited.entry((meta.dev(), meta.ino())) {
                    std::collections::hash_map::Entry::Occupied(first) => {
                        skipped.push(LoadProblem::DirectoryRepeat {
                            path: p,
                            first: first.get().clone(),
                        });
                    }
                    std::collections::hash_map::Entry::Vacant(v) => {
                        v.insert(p.clone());
                        stack.push(p);
                    }
                }
            } else if !manifest {
            } else if ft.is_file() {
                out.push(p);
            } else {
                skipped.push(LoadProblem::NotRegular {
                    path: p,
                    what: kind_of(ft),
                });
            }
        }
    }
    out.sort();
    skipped.sort_by_key(ToString::to_string);
    Ok((out, skipped))
}

/// Reads a whole regular file, refusing anything else: opened non-blocking so a FIFO
/// swapped in after listing cannot block, checked with `fstat` on the opened file, and
/// read no further than `limit` bytes so a file that grows (or a device) cannot exhaust
/// memory.
pub fn read_regular(path: &Path, limit: u64) -> Result<Vec<u8>, LoadProblem> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let io = |source| LoadProblem::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(io)?;
    let meta = f.metadata().map_err(io)?;
    if !meta.is_file() {
        return Err(LoadProblem::NotRegular {
            path: path.to_path_buf(),
            what: kind_of(meta.file_type()),
        });
    }
    let too_large = |size| LoadProblem::TooLarge {
        path: path.to_path_buf(),
        size,
        limit,
    };
    if meta.len() > limit {
        return Err(too_large(meta.len()));
    }
    let mut buf = Vec::with_capacity(meta.len() as usize);
    (&mut f)
        .take(limit.saturating_add(1))
        .read_to_end(&mut buf)
        .map_err(io)?;
    if buf.len() as u64 > limit {
        return Err(too_large(buf.len() as u64));
    }
    Ok(buf)
}

/// One file read, parsed and ingested: what its objects do to a `ClusterState` (the
/// parsed Kubernetes objects themselves are dropped as soon as they are ingested), and
/// its problems.
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

/// Reads, parses and ingests one file, one object at a time.
pub(crate) fn read_file(
    file: &Path,
    node_name: &str,
    ownership: &Ownership,
    limits: &ReadLimits,
) -> Result<FileRead, LoadProblem> {
    let bytes = read_regular(file, limits.max_file_bytes)?;
    let mut out = FileRead::default();
    manifest::for_each_object(&file.display().to_string(), &bytes, &mut |r| match r {
        Ok(located) => {
            out.objects += 1;
            match Update::of(&located.object, ownership, node_name) {
                Ok((mut update, mut warnings)) => {
                    if let (Update::Service(svc), Some(range)) =
                        (&mut update, &limits.node_port_range)
                        && let Some(svc) = std::sync::Arc::get_mut(svc)
                    {
                        warnings.extend(kproxy_core::ingest::restrict_node_ports(svc, range));
                    }
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
        Err(e) => out.errors.push(e),
    });
    out.updates.shrink_to_fit();
    Ok(out)
}

/// Reads `files` with [`read_file`] on one thread per core (the files are independent;
/// parsing dominates); the results come back in the order of `files`.
pub(crate) fn read_files(
    files: &[&Path],
    node_name: &str,
    ownership: &Ownership,
    limits: &ReadLimits,
) -> Vec<Result<FileRead, LoadProblem>> {
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(files.len());
    if workers <= 1 {
        return files
            .iter()
            .map(|f| read_file(f, node_name, ownership, limits))
            .collect();
    }
    let next = AtomicUsize::new(0);
    let mut out: Vec<Option<Result<FileRead, LoadProblem>>> = files.iter().map(|_| None).collect();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(file) = files.get(i) else { break };
                        done.push((i, read_file(file, node_name, ownership, limits)));
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

/// Loads every manifest under `path` into a fresh `ClusterState`, with the default
/// [`ReadLimits`]. `node_name` picks which Node object is this node's.
pub fn load(path: &Path, node_name: &str, ownership: &Ownership) -> Loaded {
    load_with(path, node_name, ownership, &ReadLimits::default())
}

/// [`load`] with explicit limits.
pub fn load_with(
    path: &Path,
    node_name: &str,
    ownership: &Ownership,
    limits: &ReadLimits,
) -> Loaded {
    let mut loaded = Loaded::default();
    let files = match files(path) {
        Ok((f, skipped)) => {
            loaded.problems.extend(skipped);
            f
        }
        Err(e) => {
            loaded.problems.push(e);
            return loaded;
        }
    };
    let paths: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    for read in read_files(&paths, node_name, ownership, limits) {
        match read {
            Ok(read) => {
                read.apply_to(&mut loaded.state);
                loaded
                    .problems
                    .extend(read.errors.iter().cloned().map(LoadProblem::Manifest));
                loaded.problems.extend(read.invalid_problems());
            }
            Err(p) => loaded.problems.push(p),
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

    /// A FIFO named `*.yaml` hung `plan`; a symlink to /dev/zero was read until
    /// memory ran out. Both are reported and not read; the regular file beside them loads.
    #[test]
    fn fifos_and_devices_are_not_read_and_do_not_cost_their_neighbours() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("svc.yaml"),
            "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}\n",
        )
        .unwrap();
        let fifo = dir.path().join("fifo.yaml");
        nix_mkfifo(&fifo);
        std::os::unix::fs::symlink("/dev/zero", dir.path().join("zero.yaml")).unwrap();
        let loaded = load(dir.path(), "n", &Ownership::default());
        assert_eq!(loaded.state.service_count(), 1);
        let msgs: Vec<String> = loaded.problems.iter().map(|p| p.to_string()).collect();
        assert_eq!(msgs.len(), 2, "{msgs:?}");
        assert!(
            msgs[0].contains("fifo.yaml") && msgs[0].contains("FIFO"),
            "{msgs:?}"
        );
        assert!(
            msgs[1].contains("zero.yaml") && msgs[1].contains("character device"),
            "{msgs:?}"
        );
        // Named directly, too.
        assert!(matches!(
            read_regular(&fifo, 1 << 20),
            Err(LoadProblem::NotRegular { .. })
        ));
        let loaded = load(&dir.path().join("zero.yaml"), "n", &Ownership::default());
        assert!(matches!(loaded.problems[0], LoadProblem::NotRegular { .. }));
    }

    #[test]
    fn a_file_over_the_size_limit_is_reported_and_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("big.yaml");
        std::fs::write(&f, "x".repeat(100)).unwrap();
        let limits = ReadLimits {
            max_file_bytes: 99,
            ..ReadLimits::default()
        };
        let loaded = load_with(dir.path(), "n", &Ownership::default(), &limits);
        assert!(matches!(
            loaded.problems[..],
            [LoadProblem::TooLarge {
                size: 100,
                limit: 99,
                ..
            }]
        ));
    }

    /// Two symlinks to `.` made the walk endless (above a core, up to 1 GB)
    /// and the directory unreadable. Each repeat is reported once; every file is read
    /// once.
    #[test]
    fn symlink_loops_are_reported_once_and_the_rest_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let svc = |name: &str, ip: &str| {
            format!(
                "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: shop}}\nspec: {{clusterIP: {ip}, ports: [{{port: 80}}]}}\n"
            )
        };
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("a.yaml"), svc("a", "10.96.0.10")).unwrap();
        std::fs::write(dir.path().join("sub/b.yaml"), svc("b", "10.96.0.11")).unwrap();
        std::os::unix::fs::symlink(".", dir.path().join("loop1")).unwrap();
        std::os::unix::fs::symlink("..", dir.path().join("sub/loop2")).unwrap();
        let (files, problems) = files(dir.path()).unwrap();
        let names: Vec<_> = files
            .iter()
            .map(|f| {
                f.strip_prefix(dir.path())
                    .unwrap()
                    .to_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        assert_eq!(names, ["a.yaml", "sub/b.yaml"]);
        let msgs: Vec<String> = problems.iter().map(|p| p.to_string()).collect();
        assert_eq!(msgs.len(), 2, "{msgs:?}");
        assert!(
            msgs.iter()
                .any(|m| m.contains("loop1: directory already read")),
            "{msgs:?}"
        );
        assert!(
            msgs.iter()
                .any(|m| m.contains("sub/loop2: directory already read")),
            "{msgs:?}"
        );
        assert!(
            problems
                .iter()
                .all(|p| !p.skipped_object() && !p.loses_unknown_objects())
        );
        let loaded = load(dir.path(), "n", &Ownership::default());
        assert_eq!(loaded.state.service_count(), 2);
    }

    fn nix_mkfifo(p: &Path) {
        let ok = std::process::Command::new("mkfifo")
            .arg(p)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "mkfifo {}", p.display());
    }
}
