//! One checkpoint or restore at a time: a checkpoint started (answering
//! its id at once), taken (waiting for it), or scheduled; its outcome
//! recorded for stats.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hkv_checkpoint::{ChunkWriter, Manifest};
use hkv_proto::{ErrorCode, ProtoError};
use tracing::{info, warn};

use super::{internal, kind_name, now_ms, Checkpoints, Finished, Progress};
use crate::router::Router;

impl Checkpoints {
    /// Starts a checkpoint without waiting for it: claims the gate now (so
    /// a second request answers busy, however soon it follows), allocates
    /// the checkpoint's id and answers it; the checkpoint runs on.
    pub async fn start(self: &Arc<Self>, router: Arc<Router>, full: bool) -> Result<String, ProtoError> {
        let ck = self.clone();
        let Ok(gate) = ck.gate.clone().try_lock_owned() else {
            return Err(ProtoError::new(
                ErrorCode::Busy,
                "a checkpoint or restore is already running; watch it with hkvctl checkpoints",
            ));
        };
        let c = ck.clone();
        let begun = match ck.room().await {
            Ok(()) => tokio::task::spawn_blocking(move || c.catalog.begin())
                .await
                .map_err(internal)?
                .map_err(|e| ck.store_error(e)),
            Err(e) => Err(e),
        };
        let w = match begun {
            Ok(w) => w,
            Err(e) => {
                // Refused before it had an id (checkpoints paused, say): an
                // attempt that failed all the same, in stats and metrics.
                ck.finish(Finished {
                    finished_unix_ms: now_ms(),
                    error: Some(e.message.clone()),
                    ..Finished::default()
                });
                return Err(e);
            }
        };
        let id = format!("{:016x}", w.id());
        *ck.running.lock() = Some(Progress {
            id: id.clone(),
            kind: "starting".into(),
            entries_done: 0,
            entries_total: 0,
            bytes: 0,
            seconds: 0.0,
            rate: 0.0,
            eta_s: 0.0,
            mb_per_s: 0.0,
        });
        tokio::spawn(ck.run(router, full, gate, Some(w)));
        Ok(id)
    }

    /// Takes a checkpoint (one at a time: waits for a running checkpoint or
    /// restore to finish first); `full` forces a full one.
    pub async fn take(self: &Arc<Self>, router: Arc<Router>, full: bool) -> Result<Manifest, ProtoError> {
        let gate = self.gate.clone().lock_owned().await;
        if let Err(e) = self.room().await {
            self.finish(Finished { finished_unix_ms: now_ms(), error: Some(e.message.clone()), ..Finished::default() });
            return Err(e);
        }
        self.clone().run(router, full, gate, None).await
    }

    /// Takes a checkpoint every `interval_s` seconds (when configured)
    /// until `stop` turns true.
    pub fn schedule(self: &Arc<Self>, router: Arc<Router>, mut stop: tokio::sync::watch::Receiver<bool>) {
        let Some(secs) = self.config.interval_s else { return };
        let ck = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(secs.max(1))) => {}
                    _ = stop.changed() => return,
                }
                let _ = ck.take(router.clone(), false).await;
            }
        });
    }

    /// Runs a checkpoint while holding the gate, into `w` when its id was
    /// already allocated.
    async fn run(
        self: Arc<Self>,
        router: Arc<Router>,
        full: bool,
        _gate: tokio::sync::OwnedMutexGuard<()>,
        w: Option<ChunkWriter>,
    ) -> Result<Manifest, ProtoError> {
        let ck = self;
        if let Some(s) = ck.config.interval_s {
            *ck.next_due.lock() = super::due_in(s);
        }
        let started = Instant::now();
        let c = ck.clone();
        let rt = tokio::runtime::Handle::current();
        let result =
            tokio::task::spawn_blocking(move || c.write(&router, &rt, full, w)).await.map_err(internal).and_then(|r| r);
        let seconds = started.elapsed().as_secs_f64();
        let result = match result {
            Err(e) => Err(ck.failed(e).await),
            ok => ok,
        };
        if result.is_err() {
            // The failed checkpoint's files (a full disk, say) go now: left
            // until the next start, they made every later checkpoint fail too.
            let c = ck.clone();
            match tokio::task::spawn_blocking(move || c.catalog.collect(c.config.keep, None)).await {
                Ok(Ok(removed)) if !removed.is_empty() => {
                    info!(removed = removed.len(), "removed the files of the failed checkpoint")
                }
                Ok(Err(e)) => warn!(error = %e, "removing the failed checkpoint's files failed"),
                _ => {}
            }
        }
        let finished = match &result {
            Ok(m) => {
                info!(id = %format!("{:016x}", m.id), entries = m.entries(), bytes = m.bytes(), seconds, "checkpoint complete");
                Finished {
                    id: format!("{:016x}", m.id),
                    kind: kind_name(&m.kind),
                    finished_unix_ms: m.finished_unix_ms,
                    entries: m.entries(),
                    bytes: m.bytes(),
                    seconds,
                    error: None,
                }
            }
            Err(e) => {
                warn!(error = %e.message, "checkpoint failed");
                let p = ck.running.lock().clone();
                Finished {
                    id: p.as_ref().map(|p| p.id.clone()).unwrap_or_default(),
                    kind: p.map(|p| p.kind).unwrap_or_default(),
                    finished_unix_ms: now_ms(),
                    entries: 0,
                    bytes: 0,
                    seconds,
                    error: Some(e.message.clone()),
                }
            }
        };
        *ck.running.lock() = None;
        ck.finish(finished);
        result
    }

    /// Records an attempt's end: stats' `last`, and the outcomes beside it.
    fn finish(&self, f: Finished) {
        {
            let mut o = self.outcomes.lock();
            if f.error.is_none() {
                (o.last_ok, o.consecutive_failures) = (Some(f.clone()), 0);
            } else {
                o.last_failed_unix_ms = f.finished_unix_ms;
                o.consecutive_failures += 1;
            }
        }
        *self.last.lock() = Some(f);
    }
}
