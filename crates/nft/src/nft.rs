//! Running the `nft` tool: one script per transaction through `nft -f -`. kproxy never
//! asks `nft` to list the kernel (it reads its tables over nfnetlink, `crate::dump`).
//! Every call acts on the calling thread's network namespace (the child inherits it).

use std::io::Write;
use std::process::{Command, Stdio};

use crate::error::{NftError, Via};
use crate::model::Transaction;

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
