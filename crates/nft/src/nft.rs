//! Running the `nft` tool: one script per transaction through `nft -f -`. kproxy never
//! asks `nft` to list the kernel (it reads its tables over nfnetlink, `crate::dump`).
//! Every call acts on the calling thread's network namespace (the child inherits it).
//! One-off callers wait for `nft`'s exit ([`run_script`], [`run_transaction`]); the
//! dataplane keeps a [`Runner`], which goes on as soon as the kernel committed.

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::mpsc;

use crate::error::{NftError, Via};
use crate::model::Transaction;
use crate::monitor::CommitWatch;

const NFT: &str = "nft";

/// Sends `script` as one transaction (`nft -f -` applies a file as one netlink batch:
/// all or nothing), waiting for `nft`'s exit.
pub fn run_script(script: &str) -> Result<(), NftError> {
    run(
        |w| w.write_all(script.as_bytes()).map(|()| script.len()),
        None,
    )
    .map(|_| ())
}

/// Sends `tx` as one `nft -f -` transaction, its text written into the pipe as it is
/// rendered (a full sync's script is ≈ 8 MB; it is never held whole), waiting for
/// `nft`'s exit. Returns the bytes sent.
pub fn run_transaction(tx: &Transaction) -> Result<usize, NftError> {
    run(|w| tx.write_nft_to(w), None)
}

/// `nft -f -` for a caller that runs it again and again (the dataplane): it goes on as
/// soon as the kernel committed the transaction, not when `nft` exited
/// ([`CommitWatch`]: 10–15 ms sooner after a transaction that deleted a chain or a
/// set), and keeps the socket that hears the commits between calls, in the network
/// namespace of the calling thread (reopened when a call comes from another).
#[derive(Default)]
pub struct Runner {
    commits: Option<CommitWatch>,
}

impl Runner {
    /// [`run_script`], going on at the commit.
    pub fn run_script(&mut self, script: &str) -> Result<(), NftError> {
        self.run(|w| w.write_all(script.as_bytes()).map(|()| script.len()))
            .map(|_| ())
    }

    /// [`run_transaction`], going on at the commit.
    pub fn run_transaction(&mut self, tx: &Transaction) -> Result<usize, NftError> {
        self.run(|w| tx.write_nft_to(w))
    }

    /// [`run`] with this runner's watch: at the commit, or at the exit when the watch
    /// cannot be had.
    pub(crate) fn run(
        &mut self,
        write: impl FnOnce(&mut dyn Write) -> std::io::Result<usize> + Send,
    ) -> Result<usize, NftError> {
        let reuse = match &self.commits {
            Some(c) => c.in_current_netns().unwrap_or(false),
            None => false,
        };
        if !reuse {
            self.commits = CommitWatch::open()
                .inspect_err(|e| {
                    tracing::debug!(error = %e, "no commit watch; waiting for nft's exit");
                })
                .ok();
        }
        let mut commits = self.commits.as_mut();
        if let Some(c) = commits.as_deref_mut()
            && c.listen().is_err()
        {
            commits = None;
        }
        let r = run(write, commits);
        if let Some(c) = self.commits.as_mut() {
            c.stop_listening();
        }
        r
    }
}

/// Runs `nft -f -` with `write` producing its input (as one transaction); the bytes
/// written. With `commits` (listening), returns once the kernel committed the
/// transaction (its `NEWGEN`) or `nft` exited, whichever comes first, and a thread
/// reaps `nft`; without, at the exit.
pub(crate) fn run(
    write: impl FnOnce(&mut dyn Write) -> std::io::Result<usize> + Send,
    mut commits: Option<&mut CommitWatch>,
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
    let id = child.id();
    // Its transaction is kproxy's own, not interference (its netlink port id is its pid).
    crate::nfnl::note_own(id);
    let mut stdin = child.stdin.take().expect("stdin is piped");
    // Waited for (its output read) on a thread of its own, so a chatty nft can never
    // deadlock us on a full pipe, and so that the commit can be taken before the exit.
    let (exited_tx, exited) = mpsc::channel();
    std::thread::Builder::new()
        .name("kproxy-nft-wait".into())
        .spawn(move || {
            let _ = exited_tx.send(child.wait_with_output());
        })
        .map_err(|e| NftError::Io {
            context: format!("waiting for `{NFT} -f -`"),
            source: e,
        })?;
    // stdin closes when the writer ends; nft commits only after the end of its input.
    let written = std::thread::scope(|s| {
        s.spawn(move || write(&mut stdin))
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("writer thread panicked")))
    });
    let sent = |w: std::io::Result<usize>| {
        w.map_err(|e| NftError::Io {
            context: format!("writing the script to `{NFT} -f -`"),
            source: e,
        })
    };
    let out = loop {
        match exited.try_recv() {
            Ok(out) => break Some(out),
            Err(mpsc::TryRecvError::Disconnected) => break None,
            Err(mpsc::TryRecvError::Empty) => {}
        }
        let Some(watch) = commits.as_deref_mut() else {
            break exited.recv().ok();
        };
        match watch.committed(id) {
            Ok(true) => return sent(written),
            Ok(false) => {}
            // Notifications lost: the exit says.
            Err(_) => commits = None,
        }
    };
    let out = out
        .unwrap_or_else(|| Err(std::io::Error::other("the waiting thread ended")))
        .map_err(|e| NftError::Io {
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
    sent(written)
}
