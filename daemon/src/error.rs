//! Errors of the shards and actors as wire errors.

use hkv_proto::{ErrorCode, ProtoError};
use hkv_shard::Error as ShardError;

/// Maps a shard error to the wire error with the matching code.
pub fn shard_error(e: ShardError) -> ProtoError {
    let code = match &e {
        ShardError::ReservedKey { .. } => ErrorCode::ReservedKey,
        ShardError::Length { what: "values" | "deltas" | "grads" | "updated values", .. } => ErrorCode::WrongDim,
        ShardError::Length { .. } => ErrorCode::LengthMismatch,
        ShardError::ScoresNotAccepted { .. } | ShardError::ScoresRequired { .. } => ErrorCode::Scores,
        ShardError::Config(_) | ShardError::Capacity { .. } | ShardError::Optimizer(_) => ErrorCode::BadRequest,
        ShardError::OutOfMemory(_) => ErrorCode::ResourceExhausted,
        ShardError::Features(_) => ErrorCode::BadRequest,
        _ => ErrorCode::Internal,
    };
    ProtoError::new(code, e.to_string())
}

/// A wire error with `code`.
pub(crate) fn err(code: ErrorCode, msg: impl Into<String>) -> ProtoError {
    ProtoError::new(code, msg)
}
