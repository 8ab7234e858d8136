//! [`Op`]: the operation codes (the header's op byte), their names, which
//! are admin operations, and [`WriteOp`], the writes [`Request::Write`]
//! carries.
//!
//! [`Request::Write`]: crate::Request::Write

use crate::error::{ErrorCode, ProtoError};

macro_rules! ops {
    ($($(#[$doc:meta])* $v:ident = $code:literal, $name:literal;)*) => {
        /// An operation code: the header's op byte (see PROTOCOL.md).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum Op {
            $($(#[$doc])* $v = $code,)*
        }

        impl Op {
            /// Every op, in code order.
            pub const ALL: &'static [Op] = &[$(Op::$v),*];

            /// The op's name, for messages and logs (`insert_or_assign`).
            pub fn name(self) -> &'static str {
                match self {
                    $(Op::$v => $name,)*
                }
            }
        }

        impl TryFrom<u8> for Op {
            type Error = ProtoError;

            /// The op of a code; an unknown code is an `unknown_op` error.
            fn try_from(code: u8) -> Result<Op, ProtoError> {
                match code {
                    $($code => Ok(Op::$v),)*
                    c => Err(ProtoError::new(
                        ErrorCode::UnknownOp,
                        format!("op code {c:#04x} is not part of protocol version 1"),
                    )),
                }
            }
        }
    };
}

ops! {
    /// Liveness.
    Ping = 0x01, "ping";
    /// Raw bandwidth.
    Echo = 0x02, "echo";
    /// Values of keys.
    Find = 0x10, "find";
    /// Presence of keys.
    Contains = 0x11, "contains";
    /// Insert or overwrite.
    InsertOrAssign = 0x12, "insert_or_assign";
    /// Insert, returning what lost its slot.
    InsertAndEvict = 0x13, "insert_and_evict";
    /// Find, inserting the absent.
    FindOrInsert = 0x14, "find_or_insert";
    /// Overwrite present keys.
    Assign = 0x15, "assign";
    /// Write scores of present keys.
    AssignScores = 0x16, "assign_scores";
    /// Add deltas to present keys, insert the absent.
    AccumOrAssign = 0x17, "accum_or_assign";
    /// Remove keys.
    Erase = 0x18, "erase";
    /// Remove matching entries.
    EraseIf = 0x19, "erase_if";
    /// Remove everything.
    Clear = 0x1A, "clear";
    /// One chunk of a table walk.
    Export = 0x1B, "export";
    /// Insert with verbatim scores.
    Load = 0x1C, "load";
    /// Set the epoch of epoch policies.
    SetEpoch = 0x1D, "set_epoch";
    /// Grow a table.
    Reserve = 0x1E, "reserve";
    /// One optimizer step in the table for the keys' gradient rows.
    ApplyGradients = 0x1F, "apply_gradients";
    /// Create a table (admin).
    CreateTable = 0x20, "create_table";
    /// Drop a table (admin).
    DropTable = 0x21, "drop_table";
    /// List tables.
    ListTables = 0x22, "list_tables";
    /// Statistics as JSON.
    Stats = 0x23, "stats";
    /// Prometheus text.
    Metrics = 0x24, "metrics";
    /// Drain and exit (admin).
    Shutdown = 0x25, "shutdown";
    /// Take a checkpoint (admin).
    Checkpoint = 0x26, "checkpoint";
    /// List checkpoints.
    ListCheckpoints = 0x27, "list_checkpoints";
    /// Restore a checkpoint (admin).
    Restore = 0x28, "restore";
    /// A table's sampled keys for some seconds (the miss-ratio curves' sample).
    Trace = 0x29, "trace";
    /// Drain a backed table's write-back queue into its cluster.
    Flush = 0x2A, "flush";
    /// Features to keys.
    Hash = 0x30, "hash";
    /// Features to keys, then find.
    FindFeatures = 0x31, "find_features";
    /// Features to keys, then find_or_insert.
    FindOrInsertFeatures = 0x32, "find_or_insert_features";
    /// Register a memfd as a region of the connection (see [`crate::region`]).
    RegisterMemfd = 0x40, "register_memfd";
    /// Release a registered region.
    Unregister = 0x41, "unregister";
    /// Register a CUDA IPC memory handle (device memory) as a region.
    RegisterCuda = 0x42, "register_cuda";
    /// Register a CUDA IPC event handle as an event of the connection.
    RegisterCudaEvent = 0x43, "register_cuda_event";
    /// The op of every error frame.
    Error = 0xFF, "error";
}

impl Op {
    /// Whether only admins may send it (decided from the header alone, so
    /// that a peer without rights learns nothing from the decoder).
    pub fn is_admin(self) -> bool {
        matches!(self, Op::CreateTable | Op::DropTable | Op::Shutdown | Op::Checkpoint | Op::Restore)
    }

    /// The write this op is, if it is one of [`WriteOp`].
    pub fn write(self) -> Option<WriteOp> {
        WriteOp::ALL.into_iter().find(|w| Op::from(*w) == self)
    }
}

impl From<Op> for u8 {
    fn from(op: Op) -> u8 {
        op as u8
    }
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The name of a raw op byte, for messages about frames that may carry an
/// unknown one: `"unknown"` then.
pub fn name_of(code: u8) -> &'static str {
    Op::try_from(code).map(Op::name).unwrap_or("unknown")
}

/// The writes carried by [`Request::Write`](crate::Request::Write): keys,
/// values and optional scores, answered with a summary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WriteOp {
    /// insert_or_assign.
    InsertOrAssign,
    /// insert_and_evict.
    InsertAndEvict,
    /// find_or_insert.
    FindOrInsert,
    /// assign.
    Assign,
    /// accum_or_assign.
    AccumOrAssign,
    /// load (verbatim scores).
    Load,
}

impl WriteOp {
    /// Every write.
    pub const ALL: [WriteOp; 6] = [
        WriteOp::InsertOrAssign,
        WriteOp::InsertAndEvict,
        WriteOp::FindOrInsert,
        WriteOp::Assign,
        WriteOp::AccumOrAssign,
        WriteOp::Load,
    ];

    /// The op's name.
    pub fn name(self) -> &'static str {
        Op::from(self).name()
    }
}

impl From<WriteOp> for Op {
    fn from(w: WriteOp) -> Op {
        match w {
            WriteOp::InsertOrAssign => Op::InsertOrAssign,
            WriteOp::InsertAndEvict => Op::InsertAndEvict,
            WriteOp::FindOrInsert => Op::FindOrInsert,
            WriteOp::Assign => Op::Assign,
            WriteOp::AccumOrAssign => Op::AccumOrAssign,
            WriteOp::Load => Op::Load,
        }
    }
}

impl From<WriteOp> for u8 {
    fn from(w: WriteOp) -> u8 {
        Op::from(w) as u8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_round_trips_and_unknown_codes_are_refused() {
        for &op in Op::ALL {
            assert_eq!(Op::try_from(op as u8).unwrap(), op);
        }
        assert_eq!(Op::ALL.len(), 37);
        let e = Op::try_from(0x77).unwrap_err();
        assert_eq!(e.code, ErrorCode::UnknownOp);
        assert!(e.message.contains("0x77"), "{e}");
        assert_eq!(name_of(0x77), "unknown");
        assert_eq!(Op::InsertOrAssign.name(), "insert_or_assign");
        for w in WriteOp::ALL {
            assert_eq!(Op::from(w).write(), Some(w));
        }
        assert_eq!(Op::AssignScores.write(), None);
    }
}
