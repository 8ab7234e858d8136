//! The crate's error type.

use crate::score::ScorePolicy;

/// Everything a table operation can refuse. Every variant names the input
/// that caused it, so the caller can fix the request; no operation applies
/// any change when it returns an error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The batch holds a key from the reserved range (the top four `u64`
    /// values mark empty and locked slots). The whole batch was refused.
    #[error(
        "key {key:#x} at index {index} is reserved (keys >= {min:#x} mark empty slots); \
         the batch was refused, nothing was changed",
        min = crate::RESERVED_KEY_MIN
    )]
    ReservedKey {
        /// The reserved key.
        key: u64,
        /// Its position in the batch.
        index: usize,
    },
    /// An array's length does not match the number of keys (times the table's
    /// dim for value arrays).
    #[error("{what} has {got} elements but {expected} are needed ({detail})")]
    Length {
        /// Which argument: "values", "scores", "found", ...
        what: &'static str,
        /// Elements required.
        expected: usize,
        /// Elements given.
        got: usize,
        /// How `expected` follows from the batch, e.g. "4 keys x dim 8".
        detail: String,
    },
    /// The policy computes scores itself (Lru, EpochLru) but scores were passed.
    #[error("policy {} computes its own scores; pass no scores (the load op, which restores entries, takes scores verbatim)", policy.name())]
    ScoresNotAccepted {
        /// The table's policy.
        policy: ScorePolicy,
    },
    /// The policy needs caller scores (Custom) but none were passed.
    #[error("policy {} needs a score per key; pass scores", policy.name())]
    ScoresRequired {
        /// The table's policy.
        policy: ScorePolicy,
    },
    /// The table configuration is unusable.
    #[error("invalid table config: {0}")]
    Config(String),
    /// `reserve` asked for more than the table's maximum capacity.
    #[error("cannot reserve {requested} slots: the table's max capacity is {max}; raise max_capacity")]
    Capacity {
        /// Slots requested.
        requested: u64,
        /// The configured maximum.
        max: u64,
    },
    /// The requested backend cannot run on this host (no driver, no device,
    /// not compiled in). The message says which.
    #[error("backend unavailable: {0}")]
    Unavailable(String),
    /// A device call failed; the message keeps the failing call and its code.
    #[error("device error: {0}")]
    Device(String),
    /// A feature batch or hash setting is unusable (offsets that decrease
    /// or run past the buffer, `num_buckets` 0); nothing was hashed.
    #[error("bad features: {0}")]
    Features(String),
    /// An apply_gradients batch the table's optimizer cannot run: hyperparameters
    /// out of range, or rows of another width; nothing was changed.
    #[error("apply_gradients: {0}")]
    Optimizer(String),
    /// Memory for the table (host memory, or on the CUDA backend device
    /// memory and the pinned host tier) could not be allocated; nothing was
    /// changed.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
