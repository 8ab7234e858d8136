//! The tier's errors. Each says what went wrong and what to do about it,
//! and keeps the foreign detail (the URL, the node, the server's words).

/// An error of the backing tier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A seed is not a Redis URL this tier accepts.
    #[error("backing seed {url:?} is not a usable Redis URL ({detail}); write redis://HOST:PORT or HOST:PORT, comma-separated")]
    BadUrl {
        /// The seed as given.
        url: String,
        /// Why it was refused.
        detail: String,
    },
    /// An option is out of its range.
    #[error("backing option {name}: {detail}")]
    BadOption {
        /// The option's name.
        name: &'static str,
        /// What is wrong and what is allowed.
        detail: String,
    },
    /// No seed answered.
    #[error("no backing seed answered ({seeds}): {detail}; check that the cluster runs and the addresses are right")]
    Unreachable {
        /// The seeds tried, comma-separated.
        seeds: String,
        /// The last connection error.
        detail: String,
    },
    /// A seed refused the credentials of the seed URL (none, or wrong).
    #[error("backing seed {node} refused the credentials ({detail}); give them in the URL: redis://:PASSWORD@HOST:PORT or redis://USER:PASSWORD@HOST:PORT")]
    Auth {
        /// The seed that refused.
        node: String,
        /// The server's or the client's words.
        detail: String,
    },
    /// A seed answered, but not in Redis's protocol (a web server, a
    /// proxy of something else).
    #[error("backing seed {node} answered, but not as a Redis server ({detail}); name the nodes of a Redis Cluster")]
    NotRedis {
        /// The seed that answered.
        node: String,
        /// What the client made of the answer (its first line).
        detail: String,
    },
    /// A seed answered but is not a cluster node.
    #[error("backing seed {node} is a Redis server without cluster mode ({detail}); name the nodes of a Redis Cluster (cluster-enabled yes)")]
    NotCluster {
        /// The seed that answered.
        node: String,
        /// The server's answer.
        detail: String,
    },
    /// The table's metadata in the cluster disagrees with this table.
    #[error("backing table {table:?} in the cluster has {detail}; or use another table name")]
    Mismatch {
        /// The table.
        table: String,
        /// What differs.
        detail: String,
    },
    /// The seeds that answered belong to more than one cluster.
    #[error("the backing seeds belong to more than one cluster ({groups}); name nodes of the one cluster that keeps the table")]
    SeedsSplit {
        /// Which seeds belong to which cluster.
        groups: String,
    },
    /// A table that existed before (restored, or opened again) found no
    /// meta hash in the cluster its seeds reached: it may be another
    /// cluster than the one it was created on, which is not adopted.
    #[error("the cluster of masters {nodes} has no meta hash {key} for table {table:?}: is it the cluster the table was created on? The table waits for that cluster (nothing is written to this one, no restored row is erased); if its data was deleted on purpose, drop the table and create it again")]
    NoMeta {
        /// The table.
        table: String,
        /// The meta hash's key.
        key: String,
        /// The cluster's masters, as its slot map named them.
        nodes: String,
    },
    /// A node could not serve a command (down, unreachable, failing over),
    /// or refused it (a key of another type, a permission).
    #[error("{}", unavailable_text(node, detail))]
    Unavailable {
        /// The node (`host:port`), or `cluster` when none can be named.
        node: String,
        /// The client's or the server's words.
        detail: String,
    },
    /// The write-back queue stayed full past the writer's wait.
    #[error("the write-back queue had no room for the {batch_bytes} bytes of this write beside the {queued_bytes} queued (its bound is {limit_bytes} bytes) within {waited_ms} ms, so nothing of it was applied; the cluster is not keeping up (see the table's backing stats): retry later")]
    QueueFull {
        /// Bytes the write's rows needed.
        batch_bytes: u64,
        /// Bytes queued when the writer gave up.
        queued_bytes: u64,
        /// The queue's bound.
        limit_bytes: u64,
        /// How long the writer waited.
        waited_ms: u64,
    },
    /// A write needs more room in the write-back queue than its whole
    /// bound: it could never be queued as one request, so it is refused
    /// at once, nothing of it applied.
    #[error("this write needs {batch_bytes} bytes of the write-back queue, more than its whole bound ({limit_bytes} bytes): nothing of it was applied, and as one request it never can be; send it in smaller requests, or create the table with a larger queue (--backing-queue-bytes)")]
    QueueTooSmall {
        /// Bytes the write's rows need.
        batch_bytes: u64,
        /// The queue's bound.
        limit_bytes: u64,
    },
    /// The table's meta hash in the cluster no longer says what this
    /// handle opened the table with: it was lost (deleted, or its node
    /// restarted empty) and another host created the table again with
    /// another layout. Requests that need the cluster are refused (and a
    /// write-back queue is held) rather than read or write the keys of
    /// another layout.
    #[error("the meta hash {key} of backing table {table:?} was replaced: it says {found}, where this host opened the table with {ours} (the hash was lost, deleted or its node restarted empty, and another host created the table again); this host refuses the table's requests that need the cluster, and holds its write-back queue, rather than read or write under another layout. Drop the table on the hosts of one of the two layouts (and create it again there), or, if no host uses the other, put this host's back: HSET {key} {restore}")]
    MetaReplaced {
        /// The table.
        table: String,
        /// The meta hash's key.
        key: String,
        /// What the meta hash says now.
        found: String,
        /// What this host opened the table with.
        ours: String,
        /// This host's fields as `HSET` arguments.
        restore: String,
    },
    /// The cluster has hash slots that no master serves: the table's
    /// keys in them could be neither read nor written.
    #[error("the cluster of backing table {table:?} has hash slots that no master serves ({ranges}); assign every slot first (redis-cli --cluster fix HOST:PORT, or CLUSTER ADDSLOTS)")]
    SlotsUnserved {
        /// The table.
        table: String,
        /// The unserved slots, as ranges (`5461-10922, 16000`).
        ranges: String,
    },
    /// A flush did not empty the queue in time.
    #[error("flush timed out with {} still queued; the cluster is not accepting them: {nodes}", crate::tier::plural_n(*rows, "row"))]
    FlushTimeout {
        /// Rows left in the queue.
        rows: u64,
        /// The nodes whose writes (rows, stream entries) failed meanwhile,
        /// each with its count and last failure, and those that answered
        /// nothing.
        nodes: String,
        /// Every node that failed failed only `WAIT`: the masters hold the
        /// rows, fewer of their replicas than asked do.
        replicas_only: bool,
    },
    /// The table is read-only in the tier.
    #[error("backing table {table:?} is read-only; create it with --backing-mode write-through or write-back to write to the cluster")]
    ReadOnly {
        /// The table.
        table: String,
    },
    /// A row in the cluster does not decode.
    #[error("backing row {key} of table {table:?} is {len} bytes, the layout wants {want}: another program wrote it wrongly, or the table's meta hash (hkv:{{TABLE}}:meta) was lost and another host created the table again with another dim (its log says so)")]
    BadRow {
        /// The table.
        table: String,
        /// The row's key.
        key: u64,
        /// Its length.
        len: usize,
        /// The length the layout wants.
        want: usize,
    },
}

/// An `Unavailable` error's words: a node that answered with a refusal
/// (`WRONGTYPE`, `NOPERM`, …) is up, so the retry advice of a node that is
/// down would mislead.
fn unavailable_text(node: &str, detail: &str) -> String {
    const REFUSALS: [&str; 7] = ["WRONGTYPE", "NOPERM", "OOM", "ERR", "NOSCRIPT", "BUSYKEY", "READONLY"];
    let first = detail.split_whitespace().next().unwrap_or("");
    if REFUSALS.contains(&first) {
        format!(
            "node {node} refused the command: {detail}; a key of the table may hold what another program wrote, or \
             the node's configuration refuses it (the cache keeps serving its hits)"
        )
    } else {
        format!(
            "node {node}: {detail}; the cache keeps serving its hits, retry when the node (or its replicas) can serve \
             again"
        )
    }
}

impl Error {
    /// Whether a write that failed with this error may have reached some
    /// of the cluster's nodes: a node's failure mid-write may, a refusal
    /// before anything was sent (a full queue, a replaced meta hash) not.
    pub fn may_have_landed(&self) -> bool {
        matches!(self, Error::Unavailable { .. } | Error::FlushTimeout { .. })
    }

    /// The protocol's error code name this error travels under.
    pub fn code(&self) -> &'static str {
        match self {
            Error::BadUrl { .. }
            | Error::BadOption { .. }
            | Error::Mismatch { .. }
            | Error::NotCluster { .. }
            | Error::NotRedis { .. }
            | Error::Auth { .. }
            | Error::SeedsSplit { .. }
            | Error::SlotsUnserved { .. } => "invalid_argument",
            Error::Unreachable { .. }
            | Error::NoMeta { .. }
            | Error::Unavailable { .. }
            | Error::FlushTimeout { .. }
            | Error::BadRow { .. }
            | Error::MetaReplaced { .. } => "backing_unavailable",
            Error::QueueFull { .. } | Error::QueueTooSmall { .. } => "resource_exhausted",
            Error::ReadOnly { .. } => "invalid_argument",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node that refused a command is not called down.
    #[test]
    fn a_refusal_is_not_advice_to_wait_for_the_node() {
        let e = |detail: &str| Error::Unavailable { node: "h:1".into(), detail: detail.into() }.to_string();
        let refused = e("WRONGTYPE Operation against a key holding the wrong kind of value");
        assert!(
            refused.starts_with("node h:1 refused the command: WRONGTYPE") && !refused.contains("retry"),
            "{refused}"
        );
        let down = e("Connection refused (os error 111)");
        assert!(down.contains("retry when the node"), "{down}");
        assert_eq!(Error::Unavailable { node: "h:1".into(), detail: "x".into() }.code(), "backing_unavailable");
    }
}
