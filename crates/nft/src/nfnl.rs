//! Who is who on netfilter netlink, below both its writer (`netlink`) and its reader
//! (`monitor`): the calling thread's network namespace, and the registry of kproxy's
//! own netlink port ids and `nft` children's pids, noted by those that commit
//! (`netlink`, `nft`) and read by the monitor to tell kproxy's transactions from
//! another process's (its module doc says how).

use std::collections::VecDeque;
use std::os::unix::fs::MetadataExt;
use std::sync::Mutex;

use crate::error::NftError;

/// Own port ids and pids remembered (the newest; a transaction is announced within
/// milliseconds of the commit).
const OWN_REMEMBERED: usize = 256;

static OWN: Mutex<VecDeque<u32>> = Mutex::new(VecDeque::new());

/// Notes a netlink port id or a child's pid as kproxy's own.
pub fn note_own(id: u32) {
    let mut own = OWN.lock().unwrap_or_else(|e| e.into_inner());
    if own.len() >= OWN_REMEMBERED {
        own.pop_front();
    }
    own.push_back(id);
}

/// Whether `id` was noted by [`note_own`] (among the newest it remembers).
pub(crate) fn noted_own(id: u32) -> bool {
    OWN.lock().unwrap_or_else(|e| e.into_inner()).contains(&id)
}

/// The identity (inode) of the calling thread's network namespace.
pub(crate) fn current_netns() -> Result<u64, NftError> {
    std::fs::metadata("/proc/thread-self/ns/net")
        .map(|m| m.ino())
        .map_err(|e| NftError::Io {
            context: "reading /proc/thread-self/ns/net".into(),
            source: e,
        })
}
