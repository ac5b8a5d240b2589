//! The manifest source as a live source: keeps the store ([`crate::store`]) in step with a
//! manifest file or directory. Each change (inotify through `notify`, plus a periodic
//! rescan in case an event is missed) re-reads only the files whose size, mtime or
//! inode changed, and swaps the whole ClusterState in one `replace`, so the sync loop
//! never sees half a directory.
//!
//! Bad input never costs good state. Per file, objects are keyed by kind,
//! namespace and name, and a re-read can only remove an object in one way:
//! - an object whose document no longer parses, or that no longer passes validation,
//!   keeps its last good version until it does (the problem is reported at every
//!   rescan); a file that cannot be opened or read keeps all its objects;
//! - an object that is simply gone from a file that parses — including a file that
//!   became empty or vanished — is removed only once the file has stayed that way for
//!   [`WatchConfig::remove_after`], so the truncate-then-write of most editors and
//!   tools never reaches the kernel.
//!
//! Reading runs on the blocking pool and never opens anything but regular files (see
//! [`manifests::read_regular`]); a rescan that takes longer than
//! [`WatchConfig::stall_after`] marks the source stalled in its status, which `kproxy run`
//! turns into an unhealthy `/livez`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use kproxy_core::ClusterState;
use kproxy_core::ingest::{Kind, ObjectRef, Ownership};
use kproxy_core::state::Update;
use notify::Watcher;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::Writer;
use crate::manifests::{self, FileRead, LoadProblem, ReadLimits};

/// What to watch and for which node.
#[derive(Clone, Debug)]
pub struct WatchConfig {
    pub path: PathBuf,
    pub node_name: String,
    pub ownership: Ownership,
    /// Rescan interval even without a filesystem event.
    pub rescan: Duration,
    /// Quiet time after an event before reading, so a burst of writes is read once.
    pub settle: Duration,
    /// How long a file must stay without an object (emptied, vanished, or the object
    /// removed from it) before that object is removed.
    pub remove_after: Duration,
    pub limits: ReadLimits,
    /// A rescan running longer than this marks the source stalled.
    pub stall_after: Duration,
}

/// Default [`WatchConfig::remove_after`].
pub const DEFAULT_REMOVE_AFTER: Duration = Duration::from_secs(1);
/// Default [`WatchConfig::stall_after`].
pub const DEFAULT_STALL_AFTER: Duration = Duration::from_secs(60);

impl WatchConfig {
    /// The defaults for everything but what to watch and for whom.
    pub fn new(path: PathBuf, node_name: String, ownership: Ownership) -> WatchConfig {
        WatchConfig {
            path,
            node_name,
            ownership,
            rescan: Duration::from_secs(10),
            settle: Duration::from_millis(10),
            remove_after: DEFAULT_REMOVE_AFTER,
            limits: ReadLimits::default(),
            stall_after: DEFAULT_STALL_AFTER,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("cannot watch {path}: {source}")]
    Notify {
        path: PathBuf,
        source: notify::Error,
    },
    #[error("{0}")]
    Initial(LoadProblem),
}

/// Size, mtime and inode: a change in any means the file must be read again.
type Stamp = (SystemTime, u64, u64);

/// Which object an update is about, within one file.
type Key = (Kind, String, String);

fn key_of(u: &Update) -> Option<Key> {
    Some(match u {
        Update::Service(s) => (
            Kind::Service,
            s.name.namespace.to_string(),
            s.name.name.to_string(),
        ),
        Update::DeleteService(n) => (Kind::Service, n.namespace.to_string(), n.name.to_string()),
        Update::Slice(s) => (
            Kind::EndpointSlice,
            s.service.namespace.to_string(),
            s.name.clone(),
        ),
        Update::DeleteSlice { namespace, name } => {
            (Kind::EndpointSlice, namespace.clone(), name.clone())
        }
        Update::Node(n) => (Kind::Node, String::new(), n.name.clone()),
        Update::ServiceCidr(c) => (Kind::ServiceCidr, String::new(), c.name.clone()),
        Update::OtherNode { name, .. } => (Kind::Node, String::new(), name.clone()),
    })
}

fn key_of_ref(o: &ObjectRef) -> Option<Key> {
    Some((
        o.kind,
        o.namespace.clone().unwrap_or_default(),
        o.name.clone()?,
    ))
}

/// Until when an object of earlier content is kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hold {
    /// Until its document parses and it validates again.
    UntilFixed,
    /// Until this time, unless the file changes first.
    Until(Instant),
}

/// One file: its latest read, and the objects of earlier content still kept. Updates
/// share the ingested Services and slices with the state built from them, so the cache
/// costs no second copy of the cluster.
struct Cached {
    /// `None`: the file is gone.
    stamp: Option<Stamp>,
    read: FileRead,
    kept: Vec<(Update, Hold)>,
}

impl Cached {
    /// Objects the file holds now, read or kept.
    fn holds(&self) -> usize {
        self.read.updates.len() + self.kept.len()
    }

    /// Takes a new read of the file (`None` stamp: it vanished) at `now`. Returns how
    /// many objects the file held before when it now holds none and parsed cleanly (it
    /// was emptied or removed): they wait for `remove_after`.
    fn replace(
        &mut self,
        stamp: Option<Stamp>,
        read: FileRead,
        now: Instant,
        remove_after: Duration,
    ) -> Option<usize> {
        let held = self.holds();
        // No object parsed (valid or not) and nothing failed to parse: really empty.
        let emptied = (held > 0 && read.objects == 0 && read.errors.is_empty()).then_some(held);
        let present: BTreeSet<Key> = read.updates.iter().filter_map(key_of).collect();
        let failed: BTreeSet<Key> = read
            .invalid
            .iter()
            .filter(|(_, _, skipped)| *skipped)
            .filter_map(|(_, e, _)| key_of_ref(&e.object))
            .collect();
        let broken = !read.errors.is_empty();
        let old = std::mem::take(&mut self.read.updates)
            .into_iter()
            .chain(std::mem::take(&mut self.kept).into_iter().map(|(u, _)| u));
        let mut seen = BTreeSet::new();
        for u in old {
            let Some(k) = key_of(&u) else { continue };
            if present.contains(&k) || !seen.insert(k.clone()) {
                continue;
            }
            let hold = if broken || failed.contains(&k) {
                Hold::UntilFixed
            } else {
                Hold::Until(now + remove_after)
            };
            self.kept.push((u, hold));
        }
        self.stamp = stamp;
        self.read = read;
        emptied
    }

    /// Drops kept objects whose time is up; returns how many.
    fn expire(&mut self, now: Instant) -> usize {
        let before = self.kept.len();
        self.kept
            .retain(|(_, h)| !matches!(h, Hold::Until(t) if *t <= now));
        before - self.kept.len()
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.kept
            .iter()
            .filter_map(|(_, h)| match h {
                Hold::Until(t) => Some(*t),
                Hold::UntilFixed => None,
            })
            .min()
    }

    fn apply_to(&self, state: &mut ClusterState) {
        for (u, _) in &self.kept {
            state.apply_update(u);
        }
        self.read.apply_to(state);
    }
}

/// The per-file cache and the logic of one rescan; no async, so tests drive it directly.
#[derive(Default)]
pub struct ManifestCache {
    files: BTreeMap<PathBuf, Cached>,
    /// The node name and ownership the cached files were ingested for.
    ingested_for: Option<(String, Ownership)>,
}

/// What one rescan found.
pub struct Rescan {
    /// The state built from every file's last good content.
    pub state: ClusterState,
    pub problems: Vec<LoadProblem>,
    /// Files (re)read in this rescan.
    pub reread: Vec<PathBuf>,
    /// Files whose objects are all gone from the state in this rescan.
    pub removed: Vec<PathBuf>,
    /// Files that held objects and now parse to none (emptied, or gone), with how many
    /// they held: those objects are removed once the file stays so for `remove_after`.
    pub emptied: Vec<(PathBuf, usize)>,
    /// Files whose objects' time ran out in this rescan, with how many were removed.
    pub expired: Vec<(PathBuf, usize)>,
    /// Whether the state may differ from the previous rescan's.
    pub changed: bool,
    /// When a kept object's time is up: rescan then.
    pub next_deadline: Option<Instant>,
}

impl ManifestCache {
    /// Re-reads changed files under `path` and builds the state, as of `now`. Returns
    /// `Err` only when the path itself cannot be listed (the caller keeps the previous
    /// state).
    pub fn rescan(
        &mut self,
        path: &Path,
        node_name: &str,
        ownership: &Ownership,
        limits: &ReadLimits,
        remove_after: Duration,
        now: Instant,
    ) -> Result<Rescan, LoadProblem> {
        let (files, mut problems) = manifests::files(path)?;
        let key = (node_name.to_string(), ownership.clone());
        if self.ingested_for.as_ref() != Some(&key) {
            self.files.clear();
            self.ingested_for = Some(key);
        }
        let mut changed = false;
        let mut emptied = Vec::new();
        let listed: BTreeSet<&PathBuf> = files.iter().collect();
        // Files under a directory that could not be listed are not gone: unknown, they
        // keep what they held, as an unreadable file does.
        let unlisted: Vec<&Path> = problems
            .iter()
            .filter_map(|p| match p {
                LoadProblem::UnreadableDirectory { path, .. } => Some(path.as_path()),
                _ => None,
            })
            .collect();
        for (file, cached) in &mut self.files {
            if !listed.contains(file)
                && cached.stamp.is_some()
                && !unlisted.iter().any(|d| file.starts_with(d))
            {
                if let Some(n) = cached.replace(None, FileRead::default(), now, remove_after) {
                    emptied.push((file.clone(), n));
                }
                changed = true;
            }
        }
        let mut reread = Vec::new();
        let mut stamps = Vec::new();
        for file in &files {
            let stamp = match std::fs::metadata(file) {
                Ok(m) => {
                    use std::os::unix::fs::MetadataExt;
                    (
                        m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                        m.len(),
                        m.ino(),
                    )
                }
                Err(source) => {
                    problems.push(LoadProblem::Io {
                        path: file.clone(),
                        source,
                    });
                    continue;
                }
            };
            if self.files.get(file).is_some_and(|c| c.stamp == Some(stamp)) {
                continue;
            }
            reread.push(file.clone());
            stamps.push(stamp);
        }
        let paths: Vec<&Path> = reread.iter().map(PathBuf::as_path).collect();
        let reads = manifests::read_files(&paths, node_name, ownership, limits);
        for ((file, stamp), read) in reread.iter().zip(stamps).zip(reads) {
            let read = match read {
                Ok(r) => r,
                // Unreadable: keep everything; the stamp stays old so the next rescan
                // tries again.
                Err(p) => {
                    problems.push(p);
                    continue;
                }
            };
            changed = true;
            let held = self
                .files
                .entry(file.clone())
                .or_insert_with(|| Cached {
                    stamp: None,
                    read: FileRead::default(),
                    kept: Vec::new(),
                })
                .replace(Some(stamp), read, now, remove_after);
            if let Some(n) = held {
                emptied.push((file.clone(), n));
            }
        }
        let mut removed = Vec::new();
        let mut expired = Vec::new();
        self.files.retain(|file, cached| {
            let n = cached.expire(now);
            if n > 0 {
                expired.push((file.clone(), n));
                changed = true;
            }
            let gone = cached.stamp.is_none() && cached.kept.is_empty();
            if gone {
                removed.push(file.clone());
            }
            !gone
        });
        let mut state = ClusterState::new();
        let mut next_deadline: Option<Instant> = None;
        for cached in self.files.values() {
            cached.apply_to(&mut state);
            problems.extend(
                cached
                    .read
                    .errors
                    .iter()
                    .cloned()
                    .map(LoadProblem::Manifest),
            );
            problems.extend(cached.read.invalid_problems());
            if let Some(t) = cached.next_deadline() {
                next_deadline = Some(next_deadline.map_or(t, |n| n.min(t)));
            }
        }
        Ok(Rescan {
            state,
            problems,
            reread,
            removed,
            emptied,
            expired,
            changed,
            next_deadline,
        })
    }
}

/// The inode of the watched directory: a directory replaced under the same name (a
/// `ln -sfn` switch, `mv new old`) needs a new watch, or its changes are only seen by the
/// periodic rescan.
fn identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// Whether an event can mean changed content. notify's inotify watch includes `IN_OPEN`,
/// so each rescan's own `opendir` and reads reported an open and started the next
/// rescan: an idle directory was rescanned 67–80 times a second (42 % of a core at
/// 10k Services × 10 endpoints). Opens change nothing; a close after writing does.
fn changes_content(kind: &notify::EventKind) -> bool {
    use notify::event::{AccessKind, AccessMode, EventKind};
    match kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        EventKind::Access(_) => false,
        _ => true,
    }
}

/// Loads the manifests, marks the store ready, then follows changes until the task is
/// dropped. Fails only when the first load cannot list the path at all.
pub async fn run(cfg: WatchConfig, handle: Writer) -> Result<(), WatchError> {
    let (tx, mut rx) = mpsc::unbounded_channel::<()>();
    let make_watcher = || {
        let tx = tx.clone();
        notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            if res.is_ok_and(|e| changes_content(&e.kind)) {
                let _ = tx.send(());
            }
        })
        .map_err(|source| WatchError::Notify {
            path: cfg.path.clone(),
            source,
        })
    };
    // Watch the directory that holds a single file too: editors and atomic writers
    // replace the file by rename, which a watch on the file itself would lose.
    let watched = if cfg.path.is_dir() {
        cfg.path.clone()
    } else {
        cfg.path.parent().map(Path::to_path_buf).unwrap_or_default()
    };
    let start_watch = |w: &mut notify::RecommendedWatcher| {
        w.watch(&watched, notify::RecursiveMode::Recursive)
            .map_err(|source| WatchError::Notify {
                path: watched.clone(),
                source,
            })
    };
    let mut watcher = make_watcher()?;
    start_watch(&mut watcher)?;
    let mut watched_id = identity(&watched);

    let mut cache = ManifestCache::default();
    let first = rescan_blocking(&mut cache, &cfg, &handle)
        .await
        .map_err(WatchError::Initial)?;
    let mut reported = BTreeSet::new();
    report_problems(&mut reported, &first.problems);
    let mut unlistable = false;
    let mut deadline = first.next_deadline;
    install(&handle, first, true, cfg.remove_after);
    handle.mark_ready();

    let mut ticker = tokio::time::interval(cfg.rescan);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    loop {
        let wake = deadline;
        tokio::select! {
            ev = rx.recv() => {
                if ev.is_none() {
                    return Ok(());
                }
                tokio::time::sleep(cfg.settle).await;
                while rx.try_recv().is_ok() {}
            }
            _ = ticker.tick() => {}
            _ = async { tokio::time::sleep_until(wake.unwrap_or_else(Instant::now)).await }, if wake.is_some() => {}
        }
        let id = identity(&watched);
        if id != watched_id {
            // Replaced: a fresh watcher on the new directory (dropping the old one).
            match make_watcher().and_then(|mut w| start_watch(&mut w).map(|()| w)) {
                Ok(w) => {
                    drop(std::mem::replace(&mut watcher, w));
                    watched_id = id;
                    tracing::info!(path = %watched.display(), "manifest directory replaced; watching the new one");
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot watch the replaced manifest directory; rescanning every {:?}", cfg.rescan)
                }
            }
        }
        match rescan_blocking(&mut cache, &cfg, &handle).await {
            Ok(r) => {
                unlistable = false;
                deadline = r.next_deadline;
                report_problems(&mut reported, &r.problems);
                if r.changed {
                    install(&handle, r, false, cfg.remove_after);
                }
            }
            // Once until it can be listed again, not at every rescan.
            Err(e) if !std::mem::replace(&mut unlistable, true) => {
                tracing::warn!(error = %e, "manifests unreadable; keeping the last state")
            }
            Err(e) => tracing::debug!(error = %e, "manifests still unreadable"),
        }
    }
}

/// One rescan on the blocking pool, watched: running longer than `stall_after` marks the
/// source stalled until it returns (and the state is then re-synced in full, so health
/// recovers with a fresh plan).
async fn rescan_blocking(
    cache: &mut ManifestCache,
    cfg: &WatchConfig,
    handle: &Writer,
) -> Result<Rescan, LoadProblem> {
    handle.note_rescan();
    let mut owned = std::mem::take(cache);
    let cfg2 = cfg.clone();
    let mut task = tokio::task::spawn_blocking(move || {
        let r = owned.rescan(
            &cfg2.path,
            &cfg2.node_name,
            &cfg2.ownership,
            &cfg2.limits,
            cfg2.remove_after,
            Instant::now(),
        );
        (owned, r)
    });
    let joined = match tokio::time::timeout(cfg.stall_after, &mut task).await {
        Ok(j) => j,
        Err(_) => {
            tracing::error!(path = %cfg.path.display(), after = ?cfg.stall_after, "reading the manifests makes no progress; the source is stalled");
            handle.set_stalled(true);
            let j = task.await;
            handle.set_stalled(false);
            handle.update(ClusterState::mark_all_changed);
            j
        }
    };
    let (owned, result) = joined.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
    *cache = owned;
    result
}

/// Logs each problem of a rescan once, when it appears: a problem still there at the
/// next rescan is not logged again (an unreadable directory logged 88 warnings a second),
/// and one that was fixed and comes back is. `reported` holds the last rescan's.
fn report_problems(reported: &mut BTreeSet<String>, problems: &[LoadProblem]) {
    let now: BTreeSet<String> = problems.iter().map(ToString::to_string).collect();
    for p in problems {
        let text = p.to_string();
        if !reported.contains(&text) {
            tracing::warn!(problem = %text, skipped = p.skipped_object(), "manifest problem");
        }
    }
    *reported = now;
}

fn install(handle: &Writer, r: Rescan, first: bool, remove_after: Duration) {
    for (file, n) in &r.emptied {
        tracing::warn!(file = %file.display(), objects = n, remove_after = ?remove_after, "manifest file emptied or removed: its objects are removed if it stays so");
    }
    for (file, n) in &r.expired {
        tracing::warn!(file = %file.display(), objects = n, "objects removed: gone from their manifest file for --manifest-remove-after");
    }
    let not_read = r
        .problems
        .iter()
        .filter(|p| matches!(p, LoadProblem::Manifest(_)))
        .count();
    handle.set_unread_documents(not_read);
    handle.set_input_lost(r.problems.iter().any(LoadProblem::loses_unknown_objects));
    tracing::info!(
        documents_not_read = not_read,
        files_read = r.reread.len(),
        files_removed = r.removed.len(),
        services = r.state.service_count(),
        endpoint_slices = r.state.slice_count(),
        first,
        "manifests loaded"
    );
    handle.update(|s| {
        let last = s.node().cloned();
        s.replace(r.state);
        if s.node().is_none() && last.is_some() {
            tracing::warn!("this node's Node object is gone from the manifests; the node stays known as being deleted");
            s.node_gone(last);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    const SVC: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}\n";
    const SVC2: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: api, namespace: shop}\nspec: {clusterIP: 10.96.0.11, ports: [{port: 80}]}\n";
    const SLICE: &str = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nendpoints: [{addresses: [10.244.0.5]}]\nports: [{port: 8080}]\n";
    const SETTLE: Duration = Duration::from_secs(1);

    fn names(s: &ClusterState) -> Vec<String> {
        s.services().map(|s| s.name.to_string()).collect()
    }

    fn scan(cache: &mut ManifestCache, dir: &Path, now: Instant) -> Rescan {
        cache
            .rescan(
                dir,
                "n",
                &Ownership::default(),
                &ReadLimits::default(),
                SETTLE,
                now,
            )
            .unwrap()
    }

    #[test]
    fn rescan_rereads_only_changed_files_and_keeps_last_good_content() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.yaml"), dir.path().join("b.yaml"));
        std::fs::write(&a, SVC).unwrap();
        std::fs::write(&b, SVC2).unwrap();
        let mut cache = ManifestCache::default();
        let t0 = Instant::now();
        let r = scan(&mut cache, dir.path(), t0);
        assert_eq!(names(&r.state), ["shop/api", "shop/web"]);
        assert_eq!(r.reread.len(), 2);

        let r = scan(&mut cache, dir.path(), t0);
        assert!(r.reread.is_empty() && !r.changed, "nothing changed on disk");

        // A half-written file keeps the Service it held; the other file is unaffected.
        std::fs::write(
            &b,
            "apiVersion: v1\nkind: Service\nmetadata: {name: api, namespace: shop\n",
        )
        .unwrap();
        let r = scan(&mut cache, dir.path(), t0);
        assert_eq!(names(&r.state), ["shop/api", "shop/web"]);
        assert!(
            r.problems.iter().any(|p| p.to_string().contains("b.yaml")),
            "{:?}",
            r.problems
        );
        // ... for good, not only for the settle time.
        let r = scan(&mut cache, dir.path(), t0 + SETTLE * 10);
        assert_eq!(names(&r.state), ["shop/api", "shop/web"]);

        // Removing a file removes its objects once it has stayed removed.
        std::fs::remove_file(&a).unwrap();
        let r = scan(&mut cache, dir.path(), t0);
        assert_eq!(names(&r.state), ["shop/api", "shop/web"], "not yet");
        assert_eq!(r.next_deadline, Some(t0 + SETTLE));
        let r = scan(&mut cache, dir.path(), t0 + SETTLE);
        assert_eq!(names(&r.state), ["shop/api"]);
        assert_eq!(r.removed, [a]);
    }

    /// A file truncated to 0 bytes (the first step of most writes) deleted its
    /// Services at once; a partial write that kept the first document sent a Service to
    /// REJECT.
    #[test]
    fn truncation_and_partial_writes_never_remove_objects_before_the_file_settles() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.yaml");
        std::fs::write(&a, format!("{SVC}---\n{SLICE}")).unwrap();
        let mut cache = ManifestCache::default();
        let t0 = Instant::now();
        let r = scan(&mut cache, dir.path(), t0);
        assert_eq!((r.state.service_count(), r.state.slice_count()), (1, 1));

        // Truncated: everything stays until the settle time has passed.
        std::fs::write(&a, "").unwrap();
        let r = scan(&mut cache, dir.path(), t0);
        assert_eq!((r.state.service_count(), r.state.slice_count()), (1, 1));
        // Rewritten in two steps: the first document, then all of it.
        std::fs::write(&a, SVC).unwrap();
        let r = scan(&mut cache, dir.path(), t0 + SETTLE / 2);
        assert_eq!((r.state.service_count(), r.state.slice_count()), (1, 1));
        std::fs::write(&a, format!("{SVC}---\n{SLICE}")).unwrap();
        let r = scan(&mut cache, dir.path(), t0 + SETTLE / 2);
        assert_eq!((r.state.service_count(), r.state.slice_count()), (1, 1));
        assert_eq!(r.next_deadline, None, "nothing waits for removal");
        let r = scan(&mut cache, dir.path(), t0 + SETTLE * 5);
        assert_eq!((r.state.service_count(), r.state.slice_count()), (1, 1));

        // A slice removed for good goes once the file stays without it.
        std::fs::write(&a, SVC).unwrap();
        let t1 = t0 + SETTLE * 10;
        let r = scan(&mut cache, dir.path(), t1);
        assert_eq!(r.state.slice_count(), 1);
        let r = scan(&mut cache, dir.path(), t1 + SETTLE);
        assert_eq!(r.state.slice_count(), 0);
        assert!(r.changed);
    }

    /// A dump cut short before its `kind: List` line (or any document whose
    /// kind went missing or wrong) is a parse failure: the file keeps every object it
    /// held, for good. A file emptied is reported with what it held, and its objects go
    /// only after `remove_after`, reported again.
    #[test]
    fn a_list_cut_short_keeps_its_objects_and_an_emptied_file_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.yaml");
        let list = format!(
            "apiVersion: v1\nitems:\n{}{}kind: List\n",
            indent_item(SVC),
            indent_item(SVC2)
        );
        std::fs::write(&a, &list).unwrap();
        let mut cache = ManifestCache::default();
        let t0 = Instant::now();
        let r = scan(&mut cache, dir.path(), t0);
        assert_eq!(
            names(&r.state),
            ["shop/api", "shop/web"],
            "{:?}",
            r.problems
        );
        let cut = &list[..list.find("kind: List").unwrap()];
        for text in [cut, &list.replace("kind: List", "kind: Lisst")] {
            std::fs::write(&a, text).unwrap();
            for t in [t0, t0 + SETTLE * 10] {
                let r = scan(&mut cache, dir.path(), t);
                assert_eq!(names(&r.state), ["shop/api", "shop/web"]);
                assert!(r.emptied.is_empty() && r.expired.is_empty());
                assert!(
                    r.problems.iter().any(|p| p.loses_unknown_objects()
                        && p.to_string().contains("a.yaml: document 0")),
                    "{:?}",
                    r.problems
                );
            }
        }
        std::fs::write(&a, "").unwrap();
        let t1 = t0 + SETTLE * 20;
        let r = scan(&mut cache, dir.path(), t1);
        assert_eq!(names(&r.state), ["shop/api", "shop/web"]);
        assert_eq!(r.emptied, [(a.clone(), 2)]);
        let r = scan(&mut cache, dir.path(), t1 + SETTLE);
        assert_eq!(r.state.service_count(), 0);
        assert_eq!(r.expired, [(a, 2)]);
    }

    /// `doc` as the item of a block-style List.
    fn indent_item(doc: &str) -> String {
        doc.lines()
            .enumerate()
            .map(|(i, l)| format!("{}{l}\n", if i == 0 { "- " } else { "  " }))
            .collect()
    }

    /// An object that stops validating keeps its last good version (as the apiserver
    /// would have refused the update), and is reported.
    #[test]
    fn an_object_that_turns_invalid_keeps_its_last_good_version() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.yaml");
        std::fs::write(&a, SVC).unwrap();
        let mut cache = ManifestCache::default();
        let t0 = Instant::now();
        scan(&mut cache, dir.path(), t0);
        std::fs::write(
            &a,
            SVC.replace(
                "clusterIP: 10.96.0.10, ports: [{port: 80}]",
                "clusterIP: nope, ports: [{port: 81}]",
            ),
        )
        .unwrap();
        let r = scan(&mut cache, dir.path(), t0);
        let r2 = scan(&mut cache, dir.path(), t0 + SETTLE * 10);
        for r in [r, r2] {
            assert_eq!(names(&r.state), ["shop/web"]);
            let port = r.state.services().next().unwrap().ports[0].port;
            assert_eq!(port, 80);
            assert!(
                r.problems.iter().any(|p| p.skipped_object()),
                "{:?}",
                r.problems
            );
        }
    }

    #[tokio::test]
    async fn run_follows_atomic_renames() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.yaml"), SVC).unwrap();
        let (writer, handle) = crate::store();
        let mut cfg = WatchConfig::new(dir.path().to_path_buf(), "n".into(), Ownership::default());
        cfg.rescan = Duration::from_secs(3600);
        cfg.remove_after = Duration::from_millis(50);
        let task = tokio::spawn(run(cfg, writer));
        wait_for(&handle, |s| s.service_count() == 1).await;
        assert!(handle.status().ready);
        let tmp = dir.path().join(".b.tmp");
        std::fs::write(&tmp, SVC2).unwrap();
        std::fs::rename(&tmp, dir.path().join("b.yaml")).unwrap();
        wait_for(&handle, |s| s.service_count() == 2).await;
        std::fs::remove_file(dir.path().join("a.yaml")).unwrap();
        wait_for(&handle, |s| names(s) == ["shop/api"]).await;
        task.abort();
    }

    /// After the watched directory was replaced, changes took until the next
    /// periodic rescan. With an hour-long rescan period, only a new watch sees them.
    #[tokio::test]
    async fn a_replaced_directory_is_watched_again() {
        let top = tempfile::tempdir().unwrap();
        let dir = top.path().join("m");
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("a.yaml"), SVC).unwrap();
        let (writer, handle) = crate::store();
        let mut cfg = WatchConfig::new(dir.clone(), "n".into(), Ownership::default());
        cfg.rescan = Duration::from_secs(3600);
        let task = tokio::spawn(run(cfg, writer));
        wait_for(&handle, |s| s.service_count() == 1).await;
        let new = top.path().join("m.new");
        std::fs::create_dir(&new).unwrap();
        std::fs::write(new.join("a.yaml"), SVC).unwrap();
        std::fs::rename(&dir, top.path().join("m.old")).unwrap();
        std::fs::rename(&new, &dir).unwrap();
        // The swap itself is only seen by the periodic rescan, or by the next event in
        // the new directory: poke the new directory until the new watch is in place.
        for i in 0..200 {
            std::fs::write(dir.join("b.yaml"), SVC2).unwrap();
            if handle.read(|s| s.service_count() == 2) {
                break;
            }
            if i == 199 {
                panic!("changes in the replaced directory are never seen");
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        task.abort();
    }

    /// This node's Node leaving the manifests makes it "being deleted" (not eligible),
    /// as the API source does on a DELETED event; it is not forgotten.
    #[tokio::test]
    async fn a_node_removed_from_the_manifests_stays_known_as_deleted() {
        let dir = tempfile::tempdir().unwrap();
        let node = dir.path().join("node.yaml");
        std::fs::write(&node, "apiVersion: v1\nkind: Node\nmetadata: {name: node-1}\nstatus: {addresses: [{type: InternalIP, address: 10.0.0.1}]}\n").unwrap();
        std::fs::write(dir.path().join("a.yaml"), SVC).unwrap();
        let (writer, handle) = crate::store();
        let mut cfg = WatchConfig::new(
            dir.path().to_path_buf(),
            "node-1".into(),
            Ownership::default(),
        );
        cfg.rescan = Duration::from_secs(3600);
        cfg.remove_after = Duration::from_millis(50);
        let task = tokio::spawn(run(cfg, writer));
        wait_for(&handle, |s| s.node().is_some_and(|n| !n.deleted)).await;
        std::fs::remove_file(&node).unwrap();
        wait_for(&handle, |s| s.node().is_some_and(|n| n.deleted)).await;
        let addrs = handle.read(|s| s.node().map(|n| n.addresses.len()));
        assert_eq!(addrs, Some(1), "the last known addresses stay");
        task.abort();
    }

    /// Documents not read are counted in the status (the daemon's
    /// `kproxy_manifest_unread_documents`), and the count follows the files.
    #[tokio::test]
    async fn unread_documents_are_counted_in_the_status() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.yaml"), SVC).unwrap();
        let cut = format!("apiVersion: v1\nitems:\n{}", indent_item(SVC2));
        std::fs::write(
            dir.path().join("b.yaml"),
            format!("{cut}---\nkind: Servic\n"),
        )
        .unwrap();
        let (writer, handle) = crate::store();
        let mut cfg = WatchConfig::new(dir.path().to_path_buf(), "n".into(), Ownership::default());
        cfg.rescan = Duration::from_secs(3600);
        let task = tokio::spawn(run(cfg, writer));
        wait_for(&handle, |s| s.service_count() == 1).await;
        assert_eq!(handle.status().unread_documents, 2);
        std::fs::write(dir.path().join("b.yaml"), SVC2).unwrap();
        wait_for(&handle, |s| s.service_count() == 2).await;
        assert_eq!(handle.status().unread_documents, 0);
        task.abort();
    }

    /// Each rescan's own `opendir` (an `IN_OPEN` in notify's inotify mask) started the
    /// next: an idle directory was rescanned 67–80 times a second. Idle, it is not
    /// rescanned at all before the periodic rescan (an hour here); a write still is seen.
    #[tokio::test]
    async fn an_idle_directory_is_not_rescanned_by_its_own_reads() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("a.yaml"), SVC).unwrap();
        std::fs::write(dir.path().join("sub/b.yaml"), SVC2).unwrap();
        let (writer, handle) = crate::store();
        let mut cfg = WatchConfig::new(dir.path().to_path_buf(), "n".into(), Ownership::default());
        cfg.rescan = Duration::from_secs(3600);
        let task = tokio::spawn(run(cfg, writer));
        wait_for(&handle, |s| s.service_count() == 2).await;
        // Events of the set-up itself may still arrive: let them settle.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let before = handle.status().rescans;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let idle = handle.status().rescans - before;
        assert_eq!(idle, 0, "{idle} rescans of an idle directory in a second");
        std::fs::write(
            dir.path().join("a.yaml"),
            SVC.replace("10.96.0.10", "10.96.0.12"),
        )
        .unwrap();
        wait_for(&handle, |s| {
            s.services().any(|s| {
                s.cluster_ips
                    .iter()
                    .any(|(_, ip)| ip.to_string() == "10.96.0.12")
            })
        })
        .await;
        task.abort();
    }

    async fn wait_for(handle: &crate::Reader, f: impl Fn(&ClusterState) -> bool) {
        for _ in 0..500 {
            if handle.read(&f) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("state never reached the expected content");
    }
}
