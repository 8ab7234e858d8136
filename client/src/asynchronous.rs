//! The async client (tokio).

use std::path::Path;

use hkv_proto::{Header, Request, Response, HEADER_LEN};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;

use crate::{connect_context, decode_into, fit, io, keep, ok, plain_find, ClientError, Found, Result, Spare};

/// A tokio connection to hkvd. `send` / `recv` pipeline; `call` waits.
/// Like [`crate::Client`] it keeps its send and body buffers, and reads
/// find answers into arrays handed back with [`AsyncClient::recycle`].
pub struct AsyncClient {
    w: OwnedWriteHalf,
    r: BufReader<OwnedReadHalf>,
    next_id: u64,
    spare: Spare,
}

impl AsyncClient {
    /// Connects to the socket at `path`.
    pub async fn connect(path: impl AsRef<Path>) -> Result<AsyncClient> {
        let p = path.as_ref();
        let s = UnixStream::connect(p).await.map_err(|e| io(connect_context(p, &e))(e))?;
        let (r, w) = s.into_split();
        Ok(AsyncClient { w, r: BufReader::with_capacity(1 << 16, r), next_id: 1, spare: Spare::default() })
    }

    /// Sends a request without waiting; returns its id.
    pub async fn send(&mut self, req: &Request) -> Result<u64> {
        let id = self.next_id;
        self.next_id += 1;
        let frame = match req.try_encode_into(id, std::mem::take(&mut self.spare.send)) {
            Ok(f) => f,
            Err((e, buf)) => {
                self.spare.send = keep(buf);
                return Err(ClientError::Request(e));
            }
        };
        let sent = self.w.write_all(&frame).await.map_err(io("sending a request"));
        self.spare.send = keep(frame);
        sent.map(|_| id)
    }

    /// Receives the next response.
    pub async fn recv(&mut self) -> Result<(u64, Response)> {
        let mut h = [0u8; HEADER_LEN];
        self.r.read_exact(&mut h).await.map_err(io("reading a response header"))?;
        let h = Header::decode(&h).map_err(|e| ClientError::Protocol(e.to_string()))?;
        let mut body = fit(std::mem::take(&mut self.spare.body), h.body_len as usize);
        let read = self.r.read_exact(&mut body).await.map_err(io("reading a response body"));
        let r = read.and_then(|_| {
            // A find answer is read into the arrays handed back (recycle).
            let (found, values) = if plain_find(&h) { self.spare.take_find() } else { Default::default() };
            decode_into(&h, &body, found, values)
        });
        self.spare.body = keep(body);
        Ok((h.id, r?))
    }

    /// Hands a find answer back: the next one is read into its arrays.
    pub fn recycle(&mut self, r: Response) {
        self.spare.recycle(r);
    }

    /// Sends a request and waits for its answer.
    pub async fn call(&mut self, req: &Request) -> Result<Response> {
        let id = self.send(req).await?;
        let (got, r) = self.recv().await?;
        if got != id && got != 0 {
            return Err(ClientError::Protocol(format!("answer to request {got} while waiting for {id}")));
        }
        ok(r)
    }

    /// Values of keys.
    pub async fn find(&mut self, table: &str, keys: &[u64]) -> Result<Found> {
        let r = self.call(&Request::Find { table: table.into(), keys: keys.to_vec(), scores: false }).await?;
        Found::from_response("find", r)
    }

    /// Hash features and find their keys, in one round trip.
    pub async fn find_features(
        &mut self,
        table: &str,
        hash: hkv_proto::HashSpec,
        features: hkv_proto::Features,
    ) -> Result<Found> {
        let r = self.call(&Request::FindFeatures { table: table.into(), hash, features, scores: false }).await?;
        Found::from_response("find_features", r)
    }

    /// Upsert.
    pub async fn insert_or_assign(&mut self, table: &str, keys: &[u64], values: &[f32]) -> Result<hkv_proto::Summary> {
        let req = Request::Write {
            op: hkv_proto::WriteOp::InsertOrAssign,
            table: table.into(),
            keys: keys.to_vec(),
            values: values.to_vec(),
            scores: None,
            outcomes: false,
        };
        match self.call(&req).await? {
            Response::Write { summary, .. } => Ok(summary),
            r => Err(ClientError::Protocol(format!("insert_or_assign: got {r:?}"))),
        }
    }
}
