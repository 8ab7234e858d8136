//! CUDA IPC handles are opened first by a separate process.
//!
//! `cuIpcOpenMemHandle` itself kills the process that opens some
//! byte-altered handles (on the H200: SIGSEGV about once in 16 runs of
//! 4 800 flipped opens, serialised or not, and heap corruption with opens
//! on several threads), and nothing the daemon could check first tells
//! such a handle from a valid one. So before the daemon opens a handle it
//! is asked to, a checking process (this executable, run as
//! `hkvd check-ipc-handles`) opens it, reads every byte to be registered
//! (on the device) and closes it; a handle that kills the checker, that it
//! cannot open, or whose memory faults when read (on the H200 some altered
//! handles open to such a mapping, and a fault loses the context of every
//! table on that GPU in the process that takes it) is refused without the
//! daemon ever touching it. A checker whose context a fault lost exits
//! after answering.
//!
//! The checker is started on the first registration and kept while
//! registrations come (its CUDA context costs some GPU memory and about
//! a tenth of a second to create); it exits by itself after
//! [`CHECKER_IDLE`] without work, and the daemon starts a new one for the
//! next registration after [`REUSE_WITHIN`], so an idle exit never meets a
//! request. One check runs at a time. The thread that reads a checker's
//! answers reaps it when it exits, so an idle exit leaves no zombie.
//!
//! The protocol on the checker's stdin and stdout is one line each way:
//! `mem ORDINAL LEN HEX` or `event ORDINAL HEX` (HEX: the 64 handle bytes),
//! answered by `ok`, `err MESSAGE`, or `lost MESSAGE` (refused, and the
//! checker's context is lost: it exits).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hkv_shard::cuda::ipc::{self, HANDLE_LEN};

/// The subcommand that runs [`serve_checks`].
pub const SUBCOMMAND: &str = "check-ipc-handles";

/// How long a check may take, the checker's start (a CUDA context) included.
const CHECK_DEADLINE: Duration = Duration::from_secs(20);

/// A checker idle this long exits (its CUDA context freed).
const CHECKER_IDLE: Duration = Duration::from_secs(60);

/// The daemon gives a checker work only within this of its last; after
/// that it starts a new one (well inside [`CHECKER_IDLE`]).
const REUSE_WITHIN: Duration = Duration::from_secs(30);

/// What a registration asks to be checked.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Handle {
    /// A device allocation of at least `len` bytes.
    Mem { ordinal: usize, handle: [u8; HANDLE_LEN], len: u64 },
    /// An interprocess event.
    Event { ordinal: usize, handle: [u8; HANDLE_LEN] },
}

impl Handle {
    fn line(&self) -> String {
        let hex = |h: &[u8; HANDLE_LEN]| h.iter().map(|b| format!("{b:02x}")).collect::<String>();
        match self {
            Handle::Mem { ordinal, handle, len } => format!("mem {ordinal} {len} {}\n", hex(handle)),
            Handle::Event { ordinal, handle } => format!("event {ordinal} {}\n", hex(handle)),
        }
    }

    fn parse(line: &str) -> Result<Handle, String> {
        let parts: Vec<&str> = line.split_whitespace().collect();
        let handle = |hex: &str| -> Result<[u8; HANDLE_LEN], String> {
            let mut h = [0u8; HANDLE_LEN];
            if hex.len() != 2 * HANDLE_LEN {
                return Err(format!("a handle is {HANDLE_LEN} bytes in hex"));
            }
            for (i, b) in h.iter_mut().enumerate() {
                *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|e| e.to_string())?;
            }
            Ok(h)
        };
        let num = |s: &str| s.parse::<u64>().map_err(|e| format!("{s:?}: {e}"));
        match parts[..] {
            ["mem", o, len, hex] => Ok(Handle::Mem { ordinal: num(o)? as usize, len: num(len)?, handle: handle(hex)? }),
            ["event", o, hex] => Ok(Handle::Event { ordinal: num(o)? as usize, handle: handle(hex)? }),
            _ => Err(format!("not a check: {line:?}")),
        }
    }

    /// Opens, reads and closes the handle in this process.
    fn open_and_close(&self) -> Result<(), ipc::Refused> {
        match *self {
            Handle::Mem { ordinal, handle, len } => ipc::check_handle(ordinal, &handle, Some(len)),
            Handle::Event { ordinal, handle } => ipc::check_handle(ordinal, &handle, None),
        }
    }
}

/// `hkvd check-ipc-handles`: answers checks from stdin until it closes or
/// nothing comes for [`CHECKER_IDLE`].
pub fn serve_checks() -> std::io::Result<()> {
    let (tx, rx) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut out = std::io::stdout().lock();
    loop {
        let line = match rx.recv_timeout(CHECKER_IDLE) {
            Ok(l) => l,
            Err(_) => return Ok(()),
        };
        let (answer, lost) = match Handle::parse(&line) {
            Err(e) => (format!("err {e}"), false),
            Ok(h) => match h.open_and_close() {
                Ok(()) => ("ok".to_string(), false),
                Err(r) => {
                    let kind = if r.context_lost { "lost" } else { "err" };
                    (format!("{kind} {}", r.why.replace('\n', " ")), r.context_lost)
                }
            },
        };
        writeln!(out, "{answer}")?;
        out.flush()?;
        if lost {
            // The context cannot check more: the daemon starts a new checker.
            return Ok(());
        }
    }
}

/// A running checker: its stdin, its answers (read by a thread, which
/// reaps the process once its stdout closes) and when it last answered.
struct Checker {
    child: Arc<parking_lot::Mutex<Child>>,
    stdin: ChildStdin,
    answers: Receiver<String>,
    used: Instant,
}

impl Checker {
    fn start() -> Result<Checker, String> {
        // This executable even where its file was replaced or removed
        // since the start (an upgrade of a running daemon).
        let exe = "/proc/self/exe";
        let mut child = Command::new(exe)
            .arg0("hkvd")
            .arg(SUBCOMMAND)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start {exe} {SUBCOMMAND} ({e})"))?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let (tx, answers) = mpsc::channel();
        let child = Arc::new(parking_lot::Mutex::new(child));
        let reaped = child.clone();
        let reader = std::thread::Builder::new().name("ipc-checker".into()).spawn(move || {
            let mut out = BufReader::new(stdout);
            let mut line = String::new();
            // Until end of file: the checker exited (or was killed).
            while matches!(out.read_line(&mut line), Ok(n) if n > 0) {
                let _ = tx.send(line.trim_end().to_string());
                line.clear();
            }
            // Reaped here, whoever ended it; the status stays in `Child`.
            let _ = reaped.lock().wait();
        });
        if let Err(e) = reader {
            let mut c = child.lock();
            let _ = c.kill();
            let _ = c.wait();
            return Err(format!("cannot start a thread ({e})"));
        }
        Ok(Checker { child, stdin, answers, used: Instant::now() })
    }

    /// Whether the process is still running.
    fn running(&self) -> bool {
        matches!(self.child.lock().try_wait(), Ok(None))
    }

    /// Ends the process (its reader thread reaps it; a process already
    /// reaped is not signalled).
    fn end(self) {
        let _ = self.child.lock().kill();
    }
}

static CHECKER: parking_lot::Mutex<Option<Checker>> = parking_lot::Mutex::new(None);

/// Has a checking process open and close `h`; an error says why it is
/// refused. Blocking (up to [`CHECK_DEADLINE`]): call it off the executor.
pub(crate) fn check(h: &Handle) -> Result<(), String> {
    let mut slot = CHECKER.lock();
    if let Some(c) = slot.take_if(|c| c.used.elapsed() > REUSE_WITHIN || !c.running()) {
        c.end();
    }
    if slot.is_none() {
        *slot = Some(Checker::start()?);
    }
    let c = slot.as_mut().expect("started above");
    if let Err(e) = c.stdin.write_all(h.line().as_bytes()).and_then(|()| c.stdin.flush()) {
        slot.take().expect("present").end();
        return Err(format!("the handle checker stopped ({e})"));
    }
    match c.answers.recv_timeout(CHECK_DEADLINE) {
        Ok(a) => {
            c.used = Instant::now();
            if let Some(e) = a.strip_prefix("lost ") {
                // The checker exits: its context is gone.
                slot.take().expect("present").end();
                return Err(e.to_string());
            }
            match a.strip_prefix("err ") {
                None if a == "ok" => Ok(()),
                Some(e) => Err(e.to_string()),
                None => Err(format!("the handle checker answered {a:?}")),
            }
        }
        Err(RecvTimeoutError::Timeout) => {
            slot.take().expect("present").end();
            Err(format!(
                "opening it did not finish within {} s in the process that checks handles",
                CHECK_DEADLINE.as_secs()
            ))
        }
        Err(RecvTimeoutError::Disconnected) => {
            // The reader reaped it before its channel closed.
            let c = slot.take().expect("present");
            let status = c.child.lock().wait().map(|s| s.to_string()).unwrap_or_else(|e| e.to_string());
            tracing::warn!(%status, "an IPC handle killed the process that checks handles; refused");
            Err(format!(
                "opening it killed the process that checks handles before the daemon opens them ({status}); the \
                 handle is not one cuIpcGetMemHandle / cuIpcGetEventHandle gave"
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_lines_round_trip() {
        let mut handle = [0u8; HANDLE_LEN];
        for (i, b) in handle.iter_mut().enumerate() {
            *b = (i * 37) as u8;
        }
        for h in [Handle::Mem { ordinal: 3, handle, len: 1 << 40 }, Handle::Event { ordinal: 0, handle }] {
            let back = Handle::parse(h.line().trim_end()).unwrap();
            assert_eq!(format!("{back:?}"), format!("{h:?}"));
        }
        assert!(Handle::parse("mem 0 12 abcd").is_err());
        assert!(Handle::parse("open 0").is_err());
    }
}
