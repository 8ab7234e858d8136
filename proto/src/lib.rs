//! # hkv-proto: the wire format shared by the daemon, clients and console
//!
//! Frames are a 20-byte little-endian header plus a body; bulk arrays are raw
//! little-endian elements, control messages are JSON. The byte-level spec is
//! `proto/PROTOCOL.md`. This crate knows nothing of devices or sockets: it
//! turns bytes into [`Request`]s and [`Response`]s and back.
//!
//! # Layout
//! - [`header`]: the 20-byte [`Header`], its codec, [`check_frame`] (is a
//!   whole frame buffered?), [`flags`], the checked body length.
//! - [`op`]: [`Op`], the op byte as an enum, and [`WriteOp`], the writes.
//! - [`types`]: the plain data requests and answers carry ([`TableSpec`],
//!   [`Policy`], [`Mode`], [`FeatureHash`], [`Summary`], [`Filter`] ...).
//! - [`request`]: [`Request`] and [`Control`] with encode / decode.
//! - [`response`]: [`Response`] with encode / decode.
//! - [`frame`](mod@frame): [`FrameBuf`] and [`FrameMemory`] (a frame's memory) and
//!   [`FindFrame`] (a find answer laid out before the table runs, in a
//!   [`FrameBuf`] or in memory whose type the daemon keeps).
//! - [`stats`]: the typed JSON documents (`stats`, `list_checkpoints`,
//!   `checkpoint`, `restore`).
//! - [`body`]: the field reader and writer (strings, little-endian arrays).
//! - [`error`]: the [`ProtoError`] codes shared by both sides,
//!   [`check_name`] (the table names a daemon accepts), and [`quoted`],
//!   how their messages quote a client's strings.
//! - [`region`]: registered regions: their ops, the `REGION` flag,
//!   requests naming arrays in them and their small answers.
//! - this file: the default socket paths.

#![forbid(unsafe_code)]
#![warn(missing_docs)]
#![deny(clippy::host_endian_bytes, clippy::big_endian_bytes)]

pub mod body;
pub mod error;
pub mod frame;
pub mod header;
pub mod op;
pub mod region;
pub mod request;
pub mod response;
pub mod stats;
#[cfg(test)]
mod tests;
pub mod types;

pub use error::{check_name, quoted, ErrorCode, ProtoError};
pub use frame::{FindFrame, FrameBuf, FrameMemory};
pub use header::{check_frame, flags, frame, FrameCheck, Header, HEADER_LEN, MAGIC, VERSION};
pub use op::{Op, WriteOp};
pub use request::{Control, Request};
pub use response::{origin, Response};
pub use types::{
    BackingMode, BackingSpec, CheckpointId, Cursor, Evicted, FeatureHash, Features, Filter, HashKind, HashSpec, Hyper,
    LfuTies, Mode, Optimizer, Policy, Summary, TableInfo, TableSpec,
};

/// Where clients and the daemon look for the socket when none is given:
/// `runtime_dir/hkvd/hkvd.sock` when `runtime_dir` (a binary passes
/// `$XDG_RUNTIME_DIR`) is a directory, else `./hkvd-run/hkvd.sock`. The
/// library reads no environment: binaries read the variables and pass them.
pub fn default_socket_path(runtime_dir: Option<&std::path::Path>) -> std::path::PathBuf {
    match runtime_dir {
        Some(d) if d.is_dir() => d.join("hkvd").join("hkvd.sock"),
        _ => std::path::PathBuf::from("hkvd-run").join("hkvd.sock"),
    }
}

/// The socket a client uses without `--socket`: `named` (a binary passes
/// `$HKVD_SOCKET`), else [`default_socket_path`] of `runtime_dir`.
pub fn client_socket_path(
    named: Option<std::path::PathBuf>,
    runtime_dir: Option<&std::path::Path>,
) -> std::path::PathBuf {
    named.unwrap_or_else(|| default_socket_path(runtime_dir))
}
