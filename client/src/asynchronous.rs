//! The async client (tokio).

use std::path::Path;

use hkv_proto::{Header, Request, Response, HEADER_LEN};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;

use crate::{decode, ok, ClientError, Found, Result};

fn io(context: &'static str) -> impl FnOnce(std::io::Error) -> ClientError {
    move |source| ClientError::Io { context: context.into(), source }
}

/// A tokio connection to hkvd. `send` / `recv` pipeline; `call` waits.
pub struct AsyncClient {
    w: OwnedWriteHalf,
    r: BufReader<OwnedReadHalf>,
    next_id: u64,
}

impl AsyncClient {
    /// Connects to the socket at `path`.
    pub async fn connect(path: impl AsRef<Path>) -> Result<AsyncClient> {
        let p = path.as_ref();
        let s = UnixStream::connect(p).await.map_err(|source| ClientError::Io {
            context: format!("cannot connect to hkvd at {} (is it running?)", p.display()),
            source,
        })?;
        let (r, w) = s.into_split();
        Ok(AsyncClient { w, r: BufReader::with_capacity(1 << 16, r), next_id: 1 })
    }

    /// Sends a request without waiting; returns its id.
    pub async fn send(&mut self, req: &Request) -> Result<u64> {
        let id = self.next_id;
        self.next_id += 1;
        self.w.write_all(&req.encode(id)).await.map_err(io("sending a request"))?;
        Ok(id)
    }

    /// Receives the next response.
    pub async fn recv(&mut self) -> Result<(u64, Response)> {
        let mut h = [0u8; HEADER_LEN];
        self.r.read_exact(&mut h).await.map_err(io("reading a response header"))?;
        let h = Header::decode(&h).map_err(|e| ClientError::Protocol(e.to_string()))?;
        let mut body = vec![0u8; h.body_len as usize];
        self.r.read_exact(&mut body).await.map_err(io("reading a response body"))?;
        Ok((h.id, decode(&h, &body)?))
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
            op: hkv_proto::op::INSERT_OR_ASSIGN,
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
