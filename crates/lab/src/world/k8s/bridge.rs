//! The API server as each node's kproxy reaches it: a bridge from 127.0.0.1 inside the
//! node's namespace to the host's loopback, which the watch-cut chaos can reset.

use std::sync::Arc;

use crate::LabError;

/// The API server, reachable as 127.0.0.1:`port` inside one node namespace: the
/// listener is made in that namespace, each accepted connection is forwarded to the
/// host's 127.0.0.1:`port` from the host namespace (the lab's runtime threads).
pub struct ApiBridge {
    task: tokio::task::JoinHandle<()>,
    /// Bumped to reset every open connection (the watch-cut chaos).
    cut: tokio::sync::watch::Sender<u64>,
    open: Arc<std::sync::atomic::AtomicUsize>,
}

impl ApiBridge {
    pub fn start(ns: &str, port: u16) -> Result<ApiBridge, LabError> {
        let ns_name = ns.to_string();
        let listener = std::thread::scope(|s| {
            s.spawn(|| -> Result<std::net::TcpListener, LabError> {
                crate::world::netns::enter_netns_by_name(&ns_name)?;
                let l =
                    std::net::TcpListener::bind(("127.0.0.1", port)).map_err(|e| LabError::Io {
                        what: format!("listen on 127.0.0.1:{port} in {ns_name} (API bridge)"),
                        source: e,
                    })?;
                l.set_nonblocking(true).map_err(|e| LabError::Io {
                    what: "API bridge nonblocking".into(),
                    source: e,
                })?;
                Ok(l)
            })
            .join()
            .map_err(|_| LabError::Invalid("API bridge thread panicked".into()))?
        })?;
        let listener = tokio::net::TcpListener::from_std(listener).map_err(|e| LabError::Io {
            what: "API bridge listener".into(),
            source: e,
        })?;
        let (cut, cuts) = tokio::sync::watch::channel(0u64);
        let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = open.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let mut cuts = cuts.clone();
                cuts.mark_unchanged();
                let open = counter.clone();
                tokio::spawn(async move {
                    if let Ok(mut out) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
                        open.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut inbound, &mut out) => {}
                            _ = cuts.changed() => {
                                // A reset, not a close: what a broken path or a
                                // restarted load balancer in front of the API does.
                                let _ = inbound.set_zero_linger();
                                let _ = out.set_zero_linger();
                            }
                        }
                        open.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    }
                });
            }
        });
        Ok(ApiBridge { task, cut, open })
    }

    /// Resets every connection open through the bridge; how many there were.
    pub fn cut(&self) -> usize {
        let n = self.open.load(std::sync::atomic::Ordering::SeqCst);
        self.cut.send_modify(|g| *g += 1);
        n
    }
}

impl Drop for ApiBridge {
    fn drop(&mut self) {
        self.task.abort();
    }
}
