//! # hkv-client: talk to hkvd
//!
//! [`Client`] is blocking (std Unix socket), [`AsyncClient`] runs on tokio.
//! Both speak `proto/PROTOCOL.md` through `hkv-proto`, can pipeline
//! (`send` many, then `recv` by id), and turn error frames into
//! [`ClientError::Daemon`] carrying the daemon's code and message.
//!
//! # Layout
//! - this file: the blocking [`Client`], its typed helpers and [`ClientError`].
//! - [`asynchronous`] holds [`AsyncClient`].
//! - `bin/hkvctl/` is the command-line client: `main.rs` (dispatch, exit
//!   codes), `cmd.rs` (the clap definitions), `tables.rs`, `entries.rs`,
//!   `features.rs`, `checkpoint.rs` (one module per command family),
//!   `render.rs` (printing), `bench.rs` (`hkvctl bench`).
//! - [`region`] holds registered memory ([`region::Region`]) and the ops naming arrays in it.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod asynchronous;
pub mod region;

use std::io::{BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

pub use asynchronous::AsyncClient;
pub use hkv_proto::{
    self as proto, BackingMode, BackingSpec, Control, Cursor, ErrorCode, Evicted, FeatureHash, Features, Filter,
    HashKind, HashSpec, Mode, Op, Policy, ProtoError, Request, Response, Summary, TableInfo, TableSpec, WriteOp,
};
use hkv_proto::{Header, HEADER_LEN};

/// What a client call can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The socket failed (daemon not running, connection lost). The
    /// message names the I/O error, which is therefore not also given as
    /// the error's source (a printed chain would say it twice).
    #[error("{context}: {cause}")]
    Io {
        /// What was being done.
        context: String,
        /// The I/O error.
        cause: std::io::Error,
    },
    /// The daemon answered with an error frame.
    #[error("hkvd refused the request ({}): {}", .0.code, .0.message)]
    Daemon(ProtoError),
    /// The daemon answered something this client did not expect.
    #[error("unexpected answer from hkvd: {0}")]
    Protocol(String),
    /// The request cannot be sent: a field does not fit the protocol (a
    /// table name over 65535 bytes, an array over 2^32 − 1 elements, a
    /// body over 4 GiB − 1). Nothing was sent.
    #[error("request not sent: {}", .0.message)]
    Request(ProtoError),
    /// A CUDA call of this process failed (exporting device memory for
    /// `register_cuda`, or CUDA is not available here). Nothing was sent.
    #[error("request not sent: {0}")]
    Cuda(#[from] hkv_region::cuda::CudaError),
}

impl ClientError {
    /// The daemon's error code, when the daemon refused the request.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Daemon(e) => Some(e.code),
            _ => None,
        }
    }
}

/// apply_gradients' per-key answer: a flag per key (true: updated) and
/// the values after the step (the value dim a key; zeros where absent).
pub type Updated = (Vec<bool>, Vec<f32>);

/// Result alias.
pub type Result<T, E = ClientError> = std::result::Result<T, E>;

pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> ClientError {
    let mut context = context.into();
    move |cause| {
        use std::io::ErrorKind::{BrokenPipe, ConnectionReset, UnexpectedEof};
        // The raw causes ("Broken pipe", "failed to fill whole buffer") do
        // not say that the daemon went away mid-request.
        if matches!(cause.kind(), BrokenPipe | ConnectionReset | UnexpectedEof)
            && !context.starts_with("cannot connect")
        {
            context = format!(
                "hkvd closed the connection while {context} (did it stop or restart? It also closes a \
                 connection left idle past its --idle-seconds while many are open)"
            );
        } else if matches!(cause.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
            // A socket timeout (Client::set_timeout) ran out.
            context = format!("hkvd did not answer in time while {context} (is it stopped, or busy?)");
        }
        ClientError::Io { context, cause }
    }
}

/// What a failed connect to `path` says, for its error `e`.
pub(crate) fn connect_context(path: &Path, e: &std::io::Error) -> String {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::metadata(path) {
        Ok(m) if !m.file_type().is_socket() => {
            format!("cannot connect to hkvd at {}: it is not a socket (check --socket / $HKVD_SOCKET)", path.display())
        }
        _ if e.kind() == std::io::ErrorKind::PermissionDenied => format!(
            "cannot connect to hkvd at {}: this user may not use its socket (a member of the daemon's \
             --client-group or --admin-group may)",
            path.display()
        ),
        _ => format!("cannot connect to hkvd at {} (is it running?)", path.display()),
    }
}

/// The values and found flags of a find.
#[derive(Debug, Clone, PartialEq)]
pub struct Found {
    /// Per key.
    pub found: Vec<bool>,
    /// dim floats per key (0.0 where not found).
    pub values: Vec<f32>,
    /// Scores, when asked for.
    pub scores: Option<Vec<u64>>,
    /// Per key, where its answer came from ([`proto::origin`] codes: cache
    /// hit, filled from the cluster, absent in both, not fetched by the
    /// deadline), when asked for ([`Client::find_with_origins`]) of a
    /// table backed by a cluster; `None` for other tables.
    pub origins: Option<Vec<u8>>,
}

/// What a write op returned.
#[derive(Debug, Clone, PartialEq)]
pub struct Written {
    /// Counts.
    pub summary: Summary,
    /// Per-key outcome bytes (see PROTOCOL.md).
    pub outcomes: Vec<u8>,
    /// find_or_insert: the values.
    pub values: Option<Vec<f32>>,
    /// insert_and_evict: what lost its slot.
    pub evicted: Option<Evicted>,
}

/// One chunk of an export.
#[derive(Debug, Clone, PartialEq)]
pub struct Chunk {
    /// Where to continue; none at the end.
    pub next: Option<Cursor>,
    /// Keys.
    pub keys: Vec<u64>,
    /// Values.
    pub values: Vec<f32>,
    /// Scores.
    pub scores: Vec<u64>,
}

/// Decodes one whole frame already split into header and body.
pub fn decode(h: &Header, body: &[u8]) -> Result<Response> {
    decode_into(h, body, Vec::new(), Vec::new())
}

/// [`decode`], reading a find answer's arrays into `found` and `values`
/// ([`Response::decode_into`]).
pub(crate) fn decode_into(h: &Header, body: &[u8], found: Vec<u8>, values: Vec<f32>) -> Result<Response> {
    Response::decode_into(h, body, found, values).map_err(|e| ClientError::Protocol(e.to_string()))
}

/// Turns an error frame into `Err`.
pub fn ok(r: Response) -> Result<Response> {
    match r {
        Response::Error(e) => Err(ClientError::Daemon(e)),
        r => Ok(r),
    }
}

fn unexpected<T>(what: &str, r: Response) -> Result<T> {
    Err(ClientError::Protocol(format!("{what}: got {r:?}")))
}

impl Found {
    /// The answer of a find (or find_features) request `what`.
    pub(crate) fn from_response(what: &str, r: Response) -> Result<Found> {
        match r {
            Response::Find { found, values, scores } => {
                Ok(Found { found: found.iter().map(|&f| f != 0).collect(), values, scores, origins: None })
            }
            Response::Origins { answer, origins } => {
                let mut f = Found::from_response(what, *answer)?;
                if origins.len() != f.found.len() {
                    return Err(ClientError::Protocol(format!(
                        "{what}: {} origins for {} keys",
                        origins.len(),
                        f.found.len()
                    )));
                }
                f.origins = Some(origins);
                Ok(f)
            }
            r => unexpected(what, r),
        }
    }
}

impl Written {
    /// The answer of a write request `what`.
    fn from_response(what: &str, r: Response) -> Result<Written> {
        match r {
            Response::Write { summary, outcomes, values, evicted } => {
                Ok(Written { summary, outcomes: outcomes.unwrap_or_default(), values, evicted })
            }
            r => unexpected(what, r),
        }
    }
}

/// Buffers a [`Client`] keeps between requests, so that large batches do
/// not allocate (and fault in) fresh memory each time; one of more than
/// [`KEEP_MAX`] bytes is let go.
#[derive(Default)]
pub(crate) struct Spare {
    /// The last request frame sent.
    send: Vec<u8>,
    /// The last response body read (all but plain finds).
    body: Vec<u8>,
    /// Arrays handed back by [`Client::recycle`] for the next find answer.
    found: Vec<u8>,
    values: Vec<f32>,
}

impl Spare {
    /// Keeps the arrays of a find answer for the next one.
    pub(crate) fn recycle(&mut self, r: Response) {
        if let Response::Find { found, values, .. } = r {
            self.found = found;
            self.values = values;
        }
    }

    /// The arrays handed back for the next find answer.
    pub(crate) fn take_find(&mut self) -> (Vec<u8>, Vec<f32>) {
        (std::mem::take(&mut self.found), std::mem::take(&mut self.values))
    }
}

/// Whether the answer under header `h` is a find without scores, whose
/// arrays the clients read into kept ones (little-endian hosts only: the
/// wire's order is then the floats' own).
pub(crate) fn plain_find(h: &Header) -> bool {
    matches!(proto::Op::try_from(h.op), Ok(proto::Op::Find | proto::Op::FindFeatures))
        && h.flags & (proto::flags::ERROR | proto::flags::SCORES | proto::flags::OUTCOMES) == 0
        && cfg!(target_endian = "little")
}

/// The largest buffer a [`Client`] keeps for reuse (256 MiB).
pub const KEEP_MAX: usize = 256 << 20;

/// `v` holding `n` elements, its memory reused: elements already there are
/// kept as they are (the caller overwrites all `n`), only new ones zeroed.
pub(crate) fn fit<T: Clone + Default>(mut v: Vec<T>, n: usize) -> Vec<T> {
    v.resize(n, T::default());
    v
}

/// `v` when its memory is worth keeping, else an empty vector.
pub(crate) fn keep<T>(v: Vec<T>) -> Vec<T> {
    if v.capacity() * std::mem::size_of::<T>() <= KEEP_MAX {
        v
    } else {
        Vec::new()
    }
}

/// A blocking connection to hkvd.
pub struct Client {
    w: UnixStream,
    r: BufReader<UnixStream>,
    next_id: u64,
    spare: Spare,
}

impl Client {
    /// Connects to the socket at `path`.
    pub fn connect(path: impl AsRef<Path>) -> Result<Client> {
        let p = path.as_ref();
        let s = UnixStream::connect(p).map_err(|e| io(connect_context(p, &e))(e))?;
        let r = BufReader::with_capacity(1 << 16, s.try_clone().map_err(io("socket"))?);
        Ok(Client { w: s, r, next_id: 1, spare: Spare::default() })
    }

    /// Bounds how long one read or write of the socket may wait (`None`:
    /// forever, the default). A request whose answer does not come in
    /// time fails with an error that says so; the connection is then
    /// unusable (its answer may still arrive): connect again.
    pub fn set_timeout(&mut self, timeout: Option<std::time::Duration>) -> Result<()> {
        let t = timeout.filter(|d| !d.is_zero());
        self.w.set_read_timeout(t).map_err(io("setting the socket's timeout"))?;
        self.w.set_write_timeout(t).map_err(io("setting the socket's timeout"))
    }

    /// Sends a request without waiting; returns its id.
    pub fn send(&mut self, req: &Request) -> Result<u64> {
        self.send_flagged(req, 0)
    }

    /// [`Client::send`] with `extra` header flags set besides the ones the
    /// request's fields set (OUTCOMES on find / contains: per-key origins).
    pub fn send_flagged(&mut self, req: &Request, extra: u16) -> Result<u64> {
        let id = self.next_id;
        self.next_id += 1;
        let frame = match req.try_encode_into(id, std::mem::take(&mut self.spare.send)) {
            Ok(mut f) => {
                let fl = u16::from_le_bytes([f[6], f[7]]) | extra;
                f[6..8].copy_from_slice(&fl.to_le_bytes());
                f
            }
            Err((e, buf)) => {
                self.spare.send = keep(buf);
                return Err(ClientError::Request(e));
            }
        };
        let sent = self.w.write_all(&frame).map_err(io("sending a request"));
        self.spare.send = keep(frame);
        sent.map(|_| id)
    }

    /// Sends raw frame bytes (tests, tools).
    pub fn send_raw(&mut self, bytes: &[u8]) -> Result<()> {
        self.w.write_all(bytes).map_err(io("sending bytes"))
    }

    /// Receives the next response, whichever request it answers.
    pub fn recv(&mut self) -> Result<(u64, Response)> {
        let mut h = [0u8; HEADER_LEN];
        self.r.read_exact(&mut h).map_err(io("reading a response header"))?;
        let h = Header::decode(&h).map_err(|e| ClientError::Protocol(e.to_string()))?;
        if plain_find(&h) {
            return Ok((h.id, self.recv_find(h.body_len as usize)?));
        }
        let mut body = fit(std::mem::take(&mut self.spare.body), h.body_len as usize);
        let read = self.r.read_exact(&mut body).map_err(io("reading a response body"));
        let r = read.and_then(|_| decode(&h, &body));
        self.spare.body = keep(body);
        Ok((h.id, r?))
    }

    /// Hands the arrays of a find answer back, for the next find answer on
    /// this connection to be read into (no fresh memory to fault in for a
    /// loop of same-sized finds). Other responses are dropped.
    pub fn recycle(&mut self, r: Response) {
        self.spare.recycle(r);
    }

    /// [`Client::recycle`] for the answer of [`Client::find`].
    pub fn recycle_found(&mut self, f: Found) {
        self.spare.values = f.values;
    }

    /// The body of a find response without scores (`body_len` bytes: a
    /// count and the found bytes, a count and the values), read from the
    /// socket straight into the arrays it returns: the values are never
    /// copied out of a body buffer. A body whose counts do not add up to
    /// its length is read to its end and refused, so the next response
    /// still starts where it should. Little-endian hosts only (the wire's
    /// order is then the floats' own).
    fn recv_find(&mut self, body_len: usize) -> Result<Response> {
        const WHAT: &str = "reading a find response";
        let mut left = body_len;
        if let Some(n) = self.read_count(&mut left)?.filter(|&n| n <= left) {
            let mut found = fit(std::mem::take(&mut self.spare.found), n);
            self.r.read_exact(&mut found).map_err(io(WHAT))?;
            left -= n;
            if let Some(m) = self.read_count(&mut left)?.filter(|&m| m.checked_mul(4) == Some(left)) {
                let mut values = fit(std::mem::take(&mut self.spare.values), m);
                self.r.read_exact(zerocopy::IntoBytes::as_mut_bytes(&mut values[..])).map_err(io(WHAT))?;
                return Ok(Response::Find { found, values, scores: None });
            }
        }
        std::io::copy(&mut (&mut self.r).take(left as u64), &mut std::io::sink()).map_err(io(WHAT))?;
        Err(ClientError::Protocol(format!("find response of {body_len} bytes whose array counts do not match it")))
    }

    /// The next `u32` count of a body with `left` bytes unread, or None
    /// (nothing read) when fewer than 4 are left.
    fn read_count(&mut self, left: &mut usize) -> Result<Option<usize>> {
        if *left < 4 {
            return Ok(None);
        }
        let mut c = [0u8; 4];
        self.r.read_exact(&mut c).map_err(io("reading a find response"))?;
        *left -= 4;
        Ok(Some(u32::from_le_bytes(c) as usize))
    }

    /// Sends a request and waits for its answer (no other request in flight).
    pub fn call(&mut self, req: &Request) -> Result<Response> {
        self.call_flagged(req, 0)
    }

    /// [`Client::call`] with `extra` header flags ([`Client::send_flagged`]).
    pub fn call_flagged(&mut self, req: &Request, extra: u16) -> Result<Response> {
        let id = match self.send_flagged(req, extra) {
            Ok(id) => id,
            // The daemon closed before the request went out: it may have
            // said why first (`busy` past its connection limit, id 0).
            Err(e @ ClientError::Io { .. }) => {
                return match self.recv() {
                    Ok((0, r @ Response::Error(_))) => ok(r),
                    _ => Err(e),
                }
            }
            Err(e) => return Err(e),
        };
        let (got, r) = self.recv()?;
        if got != id && got != 0 {
            return Err(ClientError::Protocol(format!("answer to request {got} while waiting for {id}")));
        }
        ok(r)
    }

    /// A control request answered with JSON, decoded into `T`.
    fn json<T: serde::de::DeserializeOwned>(&mut self, c: Control, what: &str) -> Result<T> {
        match self.call(&Request::Control(c))? {
            Response::Json(j) => serde_json::from_slice(&j).map_err(|e| ClientError::Protocol(format!("{what}: {e}"))),
            r => unexpected(what, r),
        }
    }

    /// Liveness check.
    pub fn ping(&mut self) -> Result<()> {
        self.call(&Request::Ping).map(|_| ())
    }

    /// Creates a table.
    pub fn create_table(&mut self, spec: TableSpec) -> Result<TableInfo> {
        self.json(Control::CreateTable(spec), "create_table")
    }

    /// Drops a table.
    pub fn drop_table(&mut self, name: &str) -> Result<()> {
        self.call(&Request::Control(Control::DropTable { name: name.into() })).map(|_| ())
    }

    /// Drains a backed table's write-back queue into its cluster: returns
    /// once every queued row is there (at once for other tables).
    pub fn flush(&mut self, table: &str) -> Result<()> {
        self.call(&Request::Control(Control::Flush { table: table.into() })).map(|_| ())
    }

    /// Lists tables.
    pub fn tables(&mut self) -> Result<Vec<TableInfo>> {
        self.json(Control::ListTables, "tables")
    }

    /// Statistics as JSON.
    pub fn stats(&mut self) -> Result<serde_json::Value> {
        self.json(Control::Stats, "stats")
    }

    /// Statistics as their typed document ([`proto::stats::Stats`]), what
    /// the console and `hkvctl stats` read.
    pub fn stats_doc(&mut self) -> Result<proto::stats::Stats> {
        self.json(Control::Stats, "stats")
    }

    /// Prometheus text.
    pub fn metrics(&mut self) -> Result<String> {
        match self.call(&Request::Control(Control::Metrics))? {
            Response::Text(t) => Ok(t),
            r => unexpected("metrics", r),
        }
    }

    /// Starts a checkpoint; with `wait`, returns its listing once complete.
    pub fn checkpoint(&mut self, wait: bool, full: bool) -> Result<serde_json::Value> {
        self.json(Control::Checkpoint { wait, full }, "checkpoint")
    }

    /// Lists checkpoints, newest first.
    pub fn checkpoints(&mut self) -> Result<serde_json::Value> {
        self.json(Control::ListCheckpoints, "checkpoints")
    }

    /// The keys `table`'s miss-ratio curves sample, collected by the daemon
    /// for `seconds`: (keys, sampling rate, whether keys were left out to
    /// fit `limits.max_frame_bytes`).
    pub fn trace(&mut self, table: &str, seconds: u32) -> Result<(Vec<u64>, f64, bool)> {
        match self.call(&Request::Control(Control::Trace { table: table.into(), seconds }))? {
            Response::Trace { rate, truncated, keys } => Ok((keys, rate, truncated)),
            r => unexpected("trace", r),
        }
    }

    /// Restores a checkpoint (the newest complete one or one by id) into
    /// the running daemon; text (`latest` or a hex id) becomes a
    /// [`proto::CheckpointId`] with `parse`.
    pub fn restore(&mut self, id: proto::CheckpointId) -> Result<serde_json::Value> {
        self.json(Control::Restore { id }, "restore")
    }

    /// Asks the daemon to drain and exit.
    pub fn shutdown(&mut self) -> Result<()> {
        self.call(&Request::Control(Control::Shutdown)).map(|_| ())
    }

    /// Values of keys.
    pub fn find(&mut self, table: &str, keys: &[u64]) -> Result<Found> {
        self.find_inner(table, keys, false)
    }

    /// Values and scores of keys.
    pub fn find_with_scores(&mut self, table: &str, keys: &[u64]) -> Result<Found> {
        self.find_inner(table, keys, true)
    }

    /// Values of keys and, on a table backed by a cluster, where each
    /// key's answer came from (`origins`, [`proto::origin`] codes). A key
    /// the cluster did not answer by the table's deadline is then not
    /// found with origin `LATE` instead of failing the request. On a table
    /// without a cluster `origins` is `None` (the daemon ignores the ask).
    pub fn find_with_origins(&mut self, table: &str, keys: &[u64]) -> Result<Found> {
        let req = Request::Find { table: table.into(), keys: keys.to_vec(), scores: false };
        Found::from_response("find", self.call_flagged(&req, proto::flags::OUTCOMES)?)
    }

    /// [`Client::contains`] with each key's origin on a backed table (as
    /// [`Client::find_with_origins`]); `None` on other tables.
    pub fn contains_with_origins(&mut self, table: &str, keys: &[u64]) -> Result<(Vec<bool>, Option<Vec<u8>>)> {
        let req = Request::Contains { table: table.into(), keys: keys.to_vec() };
        match self.call_flagged(&req, proto::flags::OUTCOMES)? {
            Response::Contains { found } => Ok((found.iter().map(|&f| f != 0).collect(), None)),
            Response::Origins { answer, origins } => match *answer {
                Response::Contains { found } if found.len() == origins.len() => {
                    Ok((found.iter().map(|&f| f != 0).collect(), Some(origins)))
                }
                r => unexpected("contains", r),
            },
            r => unexpected("contains", r),
        }
    }

    /// Sends a find of `keys` without waiting for its answer (to keep
    /// several requests in flight on one connection); returns its id.
    /// [`Client::recv_found`] reads the answers, in the order they come.
    pub fn send_find(&mut self, table: &str, keys: &[u64]) -> Result<u64> {
        self.send(&Request::Find { table: table.into(), keys: keys.to_vec(), scores: false })
    }

    /// The next answer on the connection as a find's: `(request id, Found)`
    /// (a daemon error is `Err`). Goes with [`Client::send_find`].
    pub fn recv_found(&mut self) -> Result<(u64, Found)> {
        let (id, r) = self.recv()?;
        Ok((id, Found::from_response("find", ok(r)?)?))
    }

    fn find_inner(&mut self, table: &str, keys: &[u64], scores: bool) -> Result<Found> {
        Found::from_response("find", self.call(&Request::Find { table: table.into(), keys: keys.to_vec(), scores })?)
    }

    /// Keys of raw features (`HashSpec::Table` needs `table`; else it may be "").
    pub fn hash(&mut self, table: &str, hash: HashSpec, features: Features) -> Result<Vec<u64>> {
        match self.call(&Request::Hash { table: table.into(), hash, features })? {
            Response::Keys(k) => Ok(k),
            r => unexpected("hash", r),
        }
    }

    /// Hash features and find their keys, in one round trip.
    pub fn find_features(&mut self, table: &str, hash: HashSpec, features: Features, scores: bool) -> Result<Found> {
        let r = self.call(&Request::FindFeatures { table: table.into(), hash, features, scores })?;
        Found::from_response("find_features", r)
    }

    /// Hash features, then find_or_insert their keys, in one round trip.
    pub fn find_or_insert_features(
        &mut self,
        table: &str,
        hash: HashSpec,
        features: Features,
        values: &[f32],
        scores: Option<&[u64]>,
    ) -> Result<Written> {
        let req = Request::FindOrInsertFeatures {
            table: table.into(),
            hash,
            features,
            values: values.to_vec(),
            scores: scores.map(<[u64]>::to_vec),
            outcomes: true,
        };
        Written::from_response("find_or_insert_features", self.call(&req)?)
    }

    /// Presence of keys.
    pub fn contains(&mut self, table: &str, keys: &[u64]) -> Result<Vec<bool>> {
        match self.call(&Request::Contains { table: table.into(), keys: keys.to_vec() })? {
            Response::Contains { found } => Ok(found.iter().map(|&f| f != 0).collect()),
            r => unexpected("contains", r),
        }
    }

    /// A write op with per-key outcomes; returns the summary, outcomes,
    /// values (find_or_insert) and evictions (insert_and_evict).
    pub fn write(
        &mut self,
        op: WriteOp,
        table: &str,
        keys: &[u64],
        values: &[f32],
        scores: Option<&[u64]>,
    ) -> Result<Written> {
        let req = Request::Write {
            op,
            table: table.into(),
            keys: keys.to_vec(),
            values: values.to_vec(),
            scores: scores.map(<[u64]>::to_vec),
            outcomes: true,
        };
        Written::from_response("write", self.call(&req)?)
    }

    /// Upsert.
    pub fn insert_or_assign(
        &mut self,
        table: &str,
        keys: &[u64],
        values: &[f32],
        scores: Option<&[u64]>,
    ) -> Result<Summary> {
        self.write(WriteOp::InsertOrAssign, table, keys, values, scores).map(|r| r.summary)
    }

    /// Upsert returning what lost its slot.
    pub fn insert_and_evict(
        &mut self,
        table: &str,
        keys: &[u64],
        values: &[f32],
        scores: Option<&[u64]>,
    ) -> Result<(Summary, Evicted)> {
        let w = self.write(WriteOp::InsertAndEvict, table, keys, values, scores)?;
        Ok((w.summary, w.evicted.unwrap_or_default()))
    }

    /// Values of present keys; the given values inserted for absent ones.
    pub fn find_or_insert(
        &mut self,
        table: &str,
        keys: &[u64],
        values: &[f32],
        scores: Option<&[u64]>,
    ) -> Result<(Summary, Vec<f32>)> {
        let w = self.write(WriteOp::FindOrInsert, table, keys, values, scores)?;
        Ok((w.summary, w.values.unwrap_or_default()))
    }

    /// Overwrite present keys.
    pub fn assign(&mut self, table: &str, keys: &[u64], values: &[f32], scores: Option<&[u64]>) -> Result<Summary> {
        self.write(WriteOp::Assign, table, keys, values, scores).map(|r| r.summary)
    }

    /// Add deltas to present keys, insert absent ones.
    pub fn accum_or_assign(
        &mut self,
        table: &str,
        keys: &[u64],
        deltas: &[f32],
        scores: Option<&[u64]>,
    ) -> Result<Summary> {
        self.write(WriteOp::AccumOrAssign, table, keys, deltas, scores).map(|r| r.summary)
    }

    /// Insert with verbatim scores (restores).
    pub fn load(&mut self, table: &str, keys: &[u64], values: &[f32], scores: &[u64]) -> Result<Summary> {
        self.write(WriteOp::Load, table, keys, values, Some(scores)).map(|r| r.summary)
    }

    /// Write scores of present keys.
    pub fn assign_scores(&mut self, table: &str, keys: &[u64], scores: Option<&[u64]>) -> Result<Summary> {
        let req = Request::AssignScores {
            table: table.into(),
            keys: keys.to_vec(),
            scores: scores.map(<[u64]>::to_vec),
            outcomes: false,
        };
        match self.call(&req)? {
            Response::Write { summary, .. } => Ok(summary),
            r => unexpected("assign_scores", r),
        }
    }

    /// One step of the table's optimizer (a table created with
    /// `optimizer`) on the present keys' rows, given a gradient row of the
    /// table's value dim (`spec.dim`) per key. Returns the count of keys
    /// absent and, with `values`, a flag per key (true: updated) and the
    /// values after the step (value dim a key; zeros where absent).
    pub fn apply_gradients(
        &mut self,
        table: &str,
        hyper: proto::Hyper,
        keys: &[u64],
        grads: &[f32],
        values: bool,
    ) -> Result<(u64, Option<Updated>)> {
        let req = Request::ApplyGradients {
            table: table.into(),
            hyper,
            keys: keys.to_vec(),
            grads: grads.to_vec(),
            outcomes: values,
        };
        match self.call(&req)? {
            Response::Applied { missing, found, values } => {
                Ok((missing, found.zip(values).map(|(f, v)| (f.into_iter().map(|x| x == 1).collect(), v))))
            }
            r => unexpected("apply_gradients", r),
        }
    }

    /// Remove keys; returns how many were present.
    pub fn erase(&mut self, table: &str, keys: &[u64]) -> Result<u64> {
        match self.call(&Request::Erase { table: table.into(), keys: keys.to_vec(), outcomes: false })? {
            Response::Erased { count, .. } => Ok(count),
            r => unexpected("erase", r),
        }
    }

    /// Remove matching entries; returns the count.
    pub fn erase_if(&mut self, table: &str, filter: Filter) -> Result<u64> {
        match self.call(&Request::EraseIf { table: table.into(), filter })? {
            Response::Erased { count, .. } => Ok(count),
            r => unexpected("erase_if", r),
        }
    }

    /// Remove everything.
    pub fn clear(&mut self, table: &str) -> Result<()> {
        self.call(&Request::Clear { table: table.into() }).map(|_| ())
    }

    /// Set the epoch of epoch policies.
    pub fn set_epoch(&mut self, table: &str, epoch: u32) -> Result<()> {
        self.call(&Request::SetEpoch { table: table.into(), epoch }).map(|_| ())
    }

    /// Grow to at least `capacity` slots.
    pub fn reserve(&mut self, table: &str, capacity: u64) -> Result<()> {
        self.call(&Request::Reserve { table: table.into(), capacity }).map(|_| ())
    }

    /// One export chunk: `(next cursor, keys, values, scores)`.
    pub fn export_chunk(&mut self, table: &str, cursor: Cursor, max_slots: u64, filter: Filter) -> Result<Chunk> {
        match self.call(&Request::Export { table: table.into(), cursor, max_slots, filter })? {
            Response::Export { next, keys, values, scores } => Ok(Chunk { next, keys, values, scores }),
            r => unexpected("export", r),
        }
    }

    /// Every matching entry of a table: `(keys, values, scores)`.
    pub fn export_all(&mut self, table: &str, filter: Filter) -> Result<(Vec<u64>, Vec<f32>, Vec<u64>)> {
        let (mut k, mut v, mut s) = (vec![], vec![], vec![]);
        let mut cursor = Some(Cursor::default());
        while let Some(c) = cursor {
            let chunk = self.export_chunk(table, c, 1 << 16, filter)?;
            k.extend(chunk.keys);
            v.extend(chunk.values);
            s.extend(chunk.scores);
            cursor = chunk.next;
        }
        Ok((k, v, s))
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixListener;

    use super::*;

    /// A frame of `op` with `flags` and `body`, as the daemon sends it.
    fn frame(op: Op, flags: u16, id: u64, body: &[u8]) -> Vec<u8> {
        proto::frame(op, proto::flags::RESPONSE | flags, id, body)
    }

    #[test]
    fn find_responses_are_read_into_their_arrays_and_bad_ones_keep_the_stream_in_step() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let good = Response::Find { found: vec![1, 0, 1], values: vec![1.5, -2.0, 0.0, 0.0, 3.25, 4.0], scores: None };
        let mut frames = good.encode(Op::Find, 1);
        // Counts that do not add up: 3 found bytes, then 5 floats announced
        // but 4 sent; then a truncated count.
        let mut bad = vec![];
        bad.extend_from_slice(&3u32.to_le_bytes());
        bad.extend_from_slice(&[1, 1, 0]);
        bad.extend_from_slice(&5u32.to_le_bytes());
        bad.extend_from_slice(&[0u8; 16]);
        frames.extend(frame(Op::Find, 0, 2, &bad));
        frames.extend(frame(Op::Find, 0, 3, &[7, 0]));
        frames.extend(Response::Find { found: vec![], values: vec![], scores: None }.encode(Op::Find, 4));
        frames.extend(Response::Empty.encode(Op::Ping, 5));
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.write_all(&frames).unwrap();
        });
        let mut c = Client::connect(&path).unwrap();
        assert_eq!(c.recv().unwrap(), (1, good));
        let e = c.recv().unwrap_err();
        assert!(matches!(e, ClientError::Protocol(_)), "{e}");
        let e = c.recv().unwrap_err();
        assert!(matches!(e, ClientError::Protocol(_)), "{e}");
        assert_eq!(c.recv().unwrap(), (4, Response::Find { found: vec![], values: vec![], scores: None }));
        assert_eq!(c.recv().unwrap(), (5, Response::Empty));
        server.join().unwrap();
    }
}
