//! Who is who on netfilter netlink, below both its writer (`netlink`) and its readers
//! (`dump`, `monitor`): the calling thread's network namespace, the registry of
//! kproxy's own netlink port ids, noted by the writer and read by the monitor to tell
//! kproxy's transactions from another process's (its module doc says how), and the
//! walk over a message's attributes ([`Attrs`]).

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

/// Attributes of a netlink attribute stream: (type without flag bits, payload).
#[derive(Clone)]
pub(crate) struct Attrs<'a>(pub(crate) &'a [u8]);

impl<'a> Iterator for Attrs<'a> {
    type Item = (u16, &'a [u8]);
    fn next(&mut self) -> Option<Self::Item> {
        if self.0.len() < 4 {
            return None;
        }
        let len = usize::from(u16::from_ne_bytes([self.0[0], self.0[1]]));
        let kind = u16::from_ne_bytes([self.0[2], self.0[3]]) & 0x3fff;
        if len < 4 || len > self.0.len() {
            self.0 = &[];
            return None;
        }
        let payload = &self.0[4..len];
        self.0 = &self.0[len.next_multiple_of(4).min(self.0.len())..];
        Some((kind, payload))
    }
}
