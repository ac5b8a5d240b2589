//! The manifest source as a live source: keeps a [`StateHandle`] in step with a
//! manifest file or directory. Each change (inotify through `notify`, plus a periodic
//! rescan in case an event is missed) re-reads only the files whose size or mtime
//! changed, and swaps the whole ClusterState in one `replace`, so the sync loop never
//! sees half a directory. A file that can no longer be read or parsed keeps its last
//! good content (a half-written file must not delete a Service); an object that fails
//! validation is skipped alone.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use kproxy_core::ClusterState;
use kproxy_core::ingest::Ownership;
use notify::Watcher;
use tokio::sync::mpsc;

use crate::StateHandle;
use crate::manifests::{self, FileRead, LoadProblem};

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

/// One file's last good content, ingested: its objects' updates share the ingested
/// Services and slices with the state built from them, so the cache costs no second
/// copy of the cluster.
struct Cached {
    stamp: (SystemTime, u64),
    read: FileRead,
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
    /// Files (re)read in this rescan; empty means nothing changed on disk.
    pub reread: Vec<PathBuf>,
    pub removed: Vec<PathBuf>,
}

impl ManifestCache {
    /// Re-reads changed files under `path` and builds the state. Returns `Err` only when
    /// the path itself cannot be listed (the caller keeps the previous state).
    pub fn rescan(
        &mut self,
        path: &Path,
        node_name: &str,
        ownership: &Ownership,
    ) -> Result<Rescan, LoadProblem> {
        let files = manifests::files(path)?;
        let key = (node_name.to_string(), ownership.clone());
        if self.ingested_for.as_ref() != Some(&key) {
            self.files.clear();
            self.ingested_for = Some(key);
        }
        let mut problems = Vec::new();
        let mut reread = Vec::new();
        let removed: Vec<PathBuf> = self
            .files
            .keys()
            .filter(|f| !files.contains(f))
            .cloned()
            .collect();
        for f in &removed {
            self.files.remove(f);
        }
        let mut stamps = Vec::new();
        for file in &files {
            let stamp = match std::fs::metadata(file) {
                Ok(m) => (m.modified().unwrap_or(SystemTime::UNIX_EPOCH), m.len()),
                Err(source) => {
                    problems.push(LoadProblem::Io {
                        path: file.clone(),
                        source,
                    });
                    continue;
                }
            };
            if self.files.get(file).is_some_and(|c| c.stamp == stamp) {
                continue;
            }
            reread.push(file.clone());
            stamps.push(stamp);
        }
        let paths: Vec<&Path> = reread.iter().map(PathBuf::as_path).collect();
        let reads = manifests::read_files(&paths, node_name, ownership);
        for ((file, stamp), read) in reread.iter().zip(stamps).zip(reads) {
            let read = match read {
                Ok(r) => r,
                Err(source) => {
                    problems.push(LoadProblem::Io {
                        path: file.clone(),
                        source,
                    });
                    continue;
                }
            };
            let broken = !read.errors.is_empty();
            problems.extend(read.errors.iter().cloned().map(LoadProblem::Manifest));
            match self.files.get_mut(file) {
                // A file that no longer parses keeps its last good objects; its stamp is
                // not updated so the next rescan tries again.
                Some(_) if broken && read.objects == 0 => {}
                _ => {
                    self.files.insert(file.clone(), Cached { stamp, read });
                }
            }
        }
        let mut state = ClusterState::new();
        for cached in self.files.values() {
            cached.read.apply_to(&mut state);
            problems.extend(cached.read.invalid_problems());
        }
        Ok(Rescan {
            state,
            problems,
            reread,
            removed,
        })
    }
}

/// Loads the manifests, marks the handle ready, then follows changes until the task is
/// dropped. Fails only when the first load cannot list the path at all.
pub async fn run(cfg: WatchConfig, handle: StateHandle) -> Result<(), WatchError> {
    let (tx, mut rx) = mpsc::unbounded_channel::<()>();
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        if res.is_ok() {
            let _ = tx.send(());
        }
    })
    .map_err(|source| WatchError::Notify {
        path: cfg.path.clone(),
        source,
    })?;
    // Watch the directory that holds a single file too: editors and atomic writers
    // replace the file by rename, which a watch on the file itself would lose.
    let watched = if cfg.path.is_dir() {
        cfg.path.clone()
    } else {
        cfg.path.parent().map(Path::to_path_buf).unwrap_or_default()
    };
    watcher
        .watch(&watched, notify::RecursiveMode::Recursive)
        .map_err(|source| WatchError::Notify {
            path: watched.clone(),
            source,
        })?;

    let mut cache = ManifestCache::default();
    let first = rescan_blocking(&mut cache, &cfg)
        .await
        .map_err(WatchError::Initial)?;
    install(&handle, first, true);
    handle.mark_ready();

    let mut ticker = tokio::time::interval(cfg.rescan);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    loop {
        tokio::select! {
            ev = rx.recv() => {
                if ev.is_none() {
                    return Ok(());
                }
                tokio::time::sleep(cfg.settle).await;
                while rx.try_recv().is_ok() {}
            }
            _ = ticker.tick() => {}
        }
        match rescan_blocking(&mut cache, &cfg).await {
            Ok(r) if r.reread.is_empty() && r.removed.is_empty() => {}
            Ok(r) => install(&handle, r, false),
            Err(e) => tracing::warn!(error = %e, "manifests unreadable; keeping the last state"),
        }
    }
}

async fn rescan_blocking(
    cache: &mut ManifestCache,
    cfg: &WatchConfig,
) -> Result<Rescan, LoadProblem> {
    let mut owned = std::mem::take(cache);
    let cfg2 = cfg.clone();
    let (owned, result) = tokio::task::spawn_blocking(move || {
        let r = owned.rescan(&cfg2.path, &cfg2.node_name, &cfg2.ownership);
        (owned, r)
    })
    .await
    .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
    *cache = owned;
    result
}

fn install(handle: &StateHandle, r: Rescan, first: bool) {
    for p in &r.problems {
        tracing::warn!(problem = %p, skipped = p.skipped_object(), "manifest problem");
    }
    tracing::info!(
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

    fn names(s: &ClusterState) -> Vec<String> {
        s.services().map(|s| s.name.to_string()).collect()
    }

    #[test]
    fn rescan_rereads_only_changed_files_and_keeps_last_good_content() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a.yaml"), dir.path().join("b.yaml"));
        std::fs::write(&a, SVC).unwrap();
        std::fs::write(&b, SVC2).unwrap();
        let mut cache = ManifestCache::default();
        let own = Ownership::default();
        let r = cache.rescan(dir.path(), "n", &own).unwrap();
        assert_eq!(names(&r.state), ["shop/api", "shop/web"]);
        assert_eq!(r.reread.len(), 2);

        let r = cache.rescan(dir.path(), "n", &own).unwrap();
        assert!(r.reread.is_empty(), "nothing changed on disk");

        // A half-written file keeps the Service it held; the other file is unaffected.
        std::fs::write(
            &b,
            "apiVersion: v1\nkind: Service\nmetadata: {name: api, namespace: shop\n",
        )
        .unwrap();
        let r = cache.rescan(dir.path(), "n", &own).unwrap();
        assert_eq!(names(&r.state), ["shop/api", "shop/web"]);
        assert!(
            r.problems.iter().any(|p| p.to_string().contains("b.yaml")),
            "{:?}",
            r.problems
        );

        // Removing a file removes its objects.
        std::fs::remove_file(&a).unwrap();
        let r = cache.rescan(dir.path(), "n", &own).unwrap();
        assert_eq!(names(&r.state), ["shop/api"]);
        assert_eq!(r.removed, [a]);
    }

    #[tokio::test]
    async fn run_follows_atomic_renames() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.yaml"), SVC).unwrap();
        let handle = StateHandle::new();
        let cfg = WatchConfig {
            path: dir.path().to_path_buf(),
            node_name: "n".into(),
            ownership: Ownership::default(),
            rescan: Duration::from_secs(3600),
            settle: Duration::from_millis(10),
        };
        let task = tokio::spawn(run(cfg, handle.clone()));
        wait_for(&handle, |s| s.service_count() == 1).await;
        assert!(handle.is_ready());
        let tmp = dir.path().join(".b.tmp");
        std::fs::write(&tmp, SVC2).unwrap();
        std::fs::rename(&tmp, dir.path().join("b.yaml")).unwrap();
        wait_for(&handle, |s| s.service_count() == 2).await;
        std::fs::remove_file(dir.path().join("a.yaml")).unwrap();
        wait_for(&handle, |s| names(s) == ["shop/api"]).await;
        task.abort();
    }

    /// This node's Node leaving the manifests makes it "being deleted" (not eligible),
    /// as the API source does on a DELETED event; it is not forgotten.
    #[tokio::test]
    async fn a_node_removed_from_the_manifests_stays_known_as_deleting() {
        let dir = tempfile::tempdir().unwrap();
        let node = dir.path().join("node.yaml");
        std::fs::write(&node, "apiVersion: v1\nkind: Node\nmetadata: {name: node-1}\nstatus: {addresses: [{type: InternalIP, address: 10.0.0.1}]}\n").unwrap();
        std::fs::write(dir.path().join("a.yaml"), SVC).unwrap();
        let handle = StateHandle::new();
        let cfg = WatchConfig {
            path: dir.path().to_path_buf(),
            node_name: "node-1".into(),
            ownership: Ownership::default(),
            rescan: Duration::from_secs(3600),
            settle: Duration::from_millis(10),
        };
        let task = tokio::spawn(run(cfg, handle.clone()));
        wait_for(&handle, |s| s.node().is_some_and(|n| !n.deleting)).await;
        std::fs::remove_file(&node).unwrap();
        wait_for(&handle, |s| s.node().is_some_and(|n| n.deleting)).await;
        let addrs = handle.with(|s| s.node().map(|n| n.addresses.len()));
        assert_eq!(addrs, Some(1), "the last known addresses stay");
        task.abort();
    }

    async fn wait_for(handle: &StateHandle, f: impl Fn(&ClusterState) -> bool) {
        for _ in 0..500 {
            if handle.with(|s| f(s)) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("state never reached the expected content");
    }
}
