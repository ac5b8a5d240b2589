//! The dataplane's error, one variant per meaning a caller can act on: the input was
//! invalid, the kernel refused a transaction (nothing of it applied), a transaction
//! could not be encoded for nfnetlink (nothing of it is sent; there is no nft text path:
//! the phased first sync falls back to the one-transaction replacement, anything else
//! fails), the kernel's answer could not be read, or a system call failed.
//!
//! A table that is absent is not an error here: reading it back answers `None`
//! (recognised by the kernel's `ENOENT` over netlink, [`crate::dump::read_table`]),
//! and every caller treats absence as a state (a cold start, drift to repair).

/// Why an operation of the dataplane failed.
#[derive(Debug, thiserror::Error)]
pub enum NftError {
    /// The config or the plan holds a value that cannot be rendered safely.
    #[error("invalid input: {0}")]
    Invalid(String),
    /// The kernel refused a transaction (an nfnetlink batch): the failing message, read
    /// back from the batch, and the kernel's errno; a transaction is all or nothing, so
    /// nothing of it was applied.
    #[error("the kernel refused the transaction: {message}")]
    Refused { message: String },
    /// A transaction could not be encoded as an nfnetlink batch.
    #[error(transparent)]
    Encode(#[from] EncodeError),
    /// The kernel's answer could not be read: a malformed or interrupted dump, a
    /// ruleset that kept changing while it was read, an error answer to a read.
    #[error("reading the kernel: {0}")]
    Read(String),
    /// A system call or a file under /proc failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    /// The UDP conntrack cleanup failed (ctnetlink).
    #[error("conntrack: {0}")]
    Conntrack(String),
}

/// Why a transaction does not encode as an nfnetlink batch, and what it was encoding.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
#[error("encoding {what} for nfnetlink: {why}")]
pub struct EncodeError {
    /// The operation (`add element ip kproxy service-ips`, or the operation's kind).
    pub what: String,
    pub why: EncodeFailure,
}

/// The reason an [`EncodeError`] gives.
#[derive(Clone, Copy, Debug, thiserror::Error, PartialEq, Eq)]
pub enum EncodeFailure {
    /// A set declaration kproxy never writes (an interval concatenation, whose field
    /// description nft adds): refused, not guessed.
    #[error("a set declaration outside kproxy's vocabulary")]
    Declaration,
    /// An interval set's element that is not one address or prefix of the table's
    /// family.
    #[error("an interval element that is not a prefix of the family")]
    Prefix,
    /// A rule holding what kproxy never writes (one read back from the kernel).
    #[error("a rule outside kproxy's vocabulary")]
    Rule,
    /// An attribute longer than the 16-bit length netlink can say.
    #[error("an attribute longer than 65535 bytes")]
    TooLong,
}
