//! Error codes carried by error frames.

use serde::{Deserialize, Serialize};

/// Why a request failed. The wire form is the snake_case name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ErrorCode {
    /// The frame does not start with `HKVD`.
    BadMagic,
    /// Unsupported protocol version.
    BadVersion,
    /// The body is larger than the daemon's limit.
    Oversized,
    /// The body ends before its arrays do.
    Truncated,
    /// Unknown op code.
    UnknownOp,
    /// No table of that name.
    UnknownTable,
    /// The value array is not n × dim long.
    WrongDim,
    /// A per-key array is not n long.
    LengthMismatch,
    /// A reserved key was sent.
    ReservedKey,
    /// A malformed body.
    BadRequest,
    /// Scores passed to a clock policy, or missing for `custom`.
    Scores,
    /// create_table of an existing name.
    TableExists,
    /// An admin op from a peer without rights.
    Forbidden,
    /// Too many connections.
    Busy,
    /// The daemon is draining.
    ShuttingDown,
    /// A shard failed.
    Internal,
    /// The request needs more memory than the daemon's budget or the
    /// device or host has free (a table too large, too many request bytes
    /// in flight); the message names the sizes.
    ResourceExhausted,
    /// A named thing that is not a table does not exist (a checkpoint id).
    NotFound,
    /// A wait the request made ran past its limit (a client's CUDA event
    /// not reached within `limits.event_wait_seconds`); the message names
    /// what it waited for. Nothing of the request was applied.
    Timeout,
    /// A checkpoint a restore needs has a file (chunk, key list, manifest)
    /// that is missing or fails verification: the checkpoint's data, not
    /// the daemon, is at fault; the message names the checkpoint and file.
    CorruptCheckpoint,
    /// A backed table's cluster could not serve the request (a node down,
    /// unreachable seeds, a queue that could not drain in time); the
    /// message names the node (`host:port`). Cache hits are still served.
    BackingUnavailable,
}

impl std::fmt::Display for ErrorCode {
    /// The wire name (`not_found`), as the documents write it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match serde_json::to_value(self) {
            Ok(serde_json::Value::String(s)) => f.write_str(&s),
            _ => write!(f, "{self:?}"),
        }
    }
}

/// An error as carried by an error frame: a code and a message for people.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ProtoError {
    /// Machine-readable cause.
    pub code: ErrorCode,
    /// What happened and what to do about it.
    pub message: String,
}

impl ProtoError {
    /// An error with a code and message.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> ProtoError {
        ProtoError { code, message: message.into() }
    }

    /// A malformed body.
    pub fn bad_request(message: impl Into<String>) -> ProtoError {
        ProtoError::new(ErrorCode::BadRequest, message)
    }
}

/// Characters of a client's string that an error message quotes at most.
pub const QUOTED_CHARS: usize = 64;

/// A client's string as an error message quotes it: in Rust's debug
/// quotes, its first [`QUOTED_CHARS`] characters and, past them, an
/// ellipsis and its length (`"aaaa…" (1048576 bytes)`). A 1 MB table
/// name made a 1 MB error body.
pub fn quoted(s: &str) -> String {
    match s.char_indices().nth(QUOTED_CHARS) {
        None => format!("{s:?}"),
        Some((end, _)) => {
            let head = format!("{:?}", &s[..end]);
            format!("{}…\" ({} bytes)", &head[..head.len() - 1], s.len())
        }
    }
}

/// Validates a table name: 1..=255 bytes of `[A-Za-z0-9_.-]` starting with
/// a letter, digit or '_' (so never `.`, `..`, a hidden chunk file name or
/// something a command line takes for a flag).
pub fn check_name(name: &str) -> Result<(), ProtoError> {
    let ok = name.len() <= 255
        && name.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(ProtoError::bad_request(format!(
            "table name {}: use 1 to 255 letters, digits, '_', '-' or '.', starting with a letter, digit or '_'",
            quoted(name)
        )))
    }
}
