//! The console's state and its key handling.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};

use hkv_client::proto::stats::Stats;

use crate::model::{self, Rates, Snapshot};

/// Samples kept per sparkline: 10 minutes at 4 polls a second.
pub const HISTORY: usize = 2400;

/// The views `tab` cycles through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum View {
    /// Every table.
    Overview,
    /// One table, shard by shard.
    Table,
    /// Per device (shard actor), over all tables.
    Devices,
}

/// What the keyboard is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Moving around.
    Normal,
    /// The help overlay.
    Help,
    /// Typing a table-name filter.
    Filter,
    /// Asking whether to start a checkpoint.
    Confirm,
}

/// What the loop must do after a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Nothing.
    None,
    /// Leave, restoring the terminal.
    Quit,
    /// Ask the daemon for a checkpoint.
    Checkpoint,
}

/// Per-table history for the sparklines.
#[derive(Debug, Clone, Default)]
pub struct History {
    /// Evictions per second.
    pub evictions: VecDeque<u64>,
    /// Rejections per second.
    pub rejections: VecDeque<u64>,
    /// Load factor in per mille.
    pub load: VecDeque<u64>,
}

/// The console state.
#[derive(Debug)]
pub struct App {
    /// Socket shown in the header.
    pub socket: String,
    /// The latest stats.
    pub snap: Option<Snapshot>,
    prev: Option<(Snapshot, Instant)>,
    /// Per-table rates from the last two polls.
    pub rates: HashMap<String, Rates>,
    /// Per-table history.
    pub history: HashMap<String, History>,
    /// Per table: (op type, batches/s, keys/s) of the op types that ran.
    pub by_type: HashMap<String, Vec<(String, f64, f64)>>,
    /// Current view.
    pub view: View,
    /// Current key mode.
    pub mode: Mode,
    /// Selected row (table in overview, shard in table view).
    pub selected: usize,
    /// Table-name filter.
    pub filter: String,
    /// Why the daemon is unreachable, while it is.
    pub down: Option<String>,
    /// A message for the footer.
    pub message: Option<String>,
    /// Redraw now.
    pub dirty: bool,
}

impl App {
    /// A console for the daemon at `socket`.
    pub fn new(socket: String) -> App {
        App {
            socket,
            snap: None,
            prev: None,
            rates: HashMap::new(),
            history: HashMap::new(),
            by_type: HashMap::new(),
            view: View::Overview,
            mode: Mode::Normal,
            selected: 0,
            filter: String::new(),
            down: None,
            message: None,
            dirty: true,
        }
    }

    /// Takes a stats document polled at `now`.
    pub fn on_stats(&mut self, v: &Stats, now: Instant) {
        let snap = model::snapshot(v);
        if let Some((prev, at)) = &self.prev {
            let secs = now.duration_since(*at).as_secs_f64();
            // A restarted daemon (uptime went back) starts the rates afresh.
            if secs > 0.0 && snap.uptime_s >= prev.uptime_s {
                for t in &snap.tables {
                    if let Some(p) = prev.tables.iter().find(|p| p.name == t.name) {
                        let r = model::rates(p, t, secs);
                        self.rates.insert(t.name.clone(), r);
                        self.by_type.insert(t.name.clone(), model::rates_by_type(&snap.op_names, p, t, secs));
                        let h = self.history.entry(t.name.clone()).or_default();
                        for (q, x) in [
                            (&mut h.evictions, r.evictions as u64),
                            (&mut h.rejections, r.rejections as u64),
                            (&mut h.load, (t.load() * 1000.0) as u64),
                        ] {
                            q.push_back(x);
                            if q.len() > HISTORY {
                                q.pop_front();
                            }
                        }
                    }
                }
            }
        }
        if self.down.take().is_some() {
            self.message = Some("reconnected".into());
        }
        self.prev = Some((snap.clone(), now));
        self.snap = Some(snap);
        self.clamp();
        self.dirty = true;
    }

    /// The daemon could not be reached.
    pub fn on_down(&mut self, why: String) {
        // What the last checkpoint request said is stale once the daemon is gone.
        self.message = None;
        self.down = Some(why);
        self.dirty = true;
    }

    /// The answer to a checkpoint request.
    pub fn on_checkpoint_started(&mut self, r: Result<(), String>) {
        self.message = Some(match r {
            Ok(()) => "checkpoint started".into(),
            Err(e) => format!("checkpoint refused: {e}"),
        });
        self.dirty = true;
    }

    /// Tables matching the filter, by name.
    pub fn visible(&self) -> Vec<&model::Table> {
        let Some(s) = &self.snap else { return vec![] };
        let mut v: Vec<&model::Table> = s.tables.iter().filter(|t| t.name.contains(&self.filter)).collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// The selected table (overview) or the table shown (table view).
    pub fn current_table(&self) -> Option<&model::Table> {
        let v = self.visible();
        let i = match self.view {
            View::Overview | View::Table => self.selected.min(v.len().saturating_sub(1)),
            View::Devices => 0,
        };
        v.get(i).copied()
    }

    fn rows(&self) -> usize {
        match self.view {
            View::Overview | View::Table => self.visible().len(),
            View::Devices => self.snap.as_ref().map(|s| s.shards as usize).unwrap_or(0),
        }
    }

    fn clamp(&mut self) {
        let n = self.rows();
        if self.selected >= n {
            self.selected = n.saturating_sub(1);
        }
    }

    /// One line for the log file.
    pub fn status_line(&self) -> String {
        match (&self.down, &self.snap) {
            (Some(e), _) => format!("down: {e}"),
            (None, Some(s)) => format!("up {:.0}s, {} tables, {} requests", s.uptime_s, s.tables.len(), s.requests),
            (None, None) => "waiting for stats".into(),
        }
    }

    /// Handles a key.
    pub fn on_key(&mut self, k: KeyEvent) -> Action {
        self.dirty = true;
        if k.modifiers.contains(KeyModifiers::CONTROL) && k.code == KeyCode::Char('c') {
            return Action::Quit;
        }
        match self.mode {
            Mode::Help => {
                if k.code == KeyCode::Char('q') {
                    return Action::Quit;
                }
                self.mode = Mode::Normal;
            }
            Mode::Filter => match k.code {
                KeyCode::Enter => self.mode = Mode::Normal,
                KeyCode::Esc => {
                    self.filter.clear();
                    self.mode = Mode::Normal;
                }
                KeyCode::Backspace => {
                    self.filter.pop();
                }
                KeyCode::Char(c) if !c.is_control() => {
                    self.filter.push(c);
                    self.selected = 0;
                }
                _ => {}
            },
            Mode::Confirm => {
                self.mode = Mode::Normal;
                if matches!(k.code, KeyCode::Char('y') | KeyCode::Char('Y')) {
                    self.message = Some("checkpoint requested".into());
                    return Action::Checkpoint;
                }
                self.message = Some("checkpoint cancelled".into());
            }
            Mode::Normal => match k.code {
                // Esc clears a kept filter first (the help says "esc
                // clears"); it quit with the filter still on before.
                KeyCode::Esc if !self.filter.is_empty() => {
                    self.filter.clear();
                    self.clamp();
                }
                KeyCode::Char('q') | KeyCode::Esc => return Action::Quit,
                KeyCode::Char('?') => self.mode = Mode::Help,
                KeyCode::Char('/') => self.mode = Mode::Filter,
                KeyCode::Char('c') => self.mode = Mode::Confirm,
                KeyCode::Tab => {
                    self.view = match self.view {
                        View::Overview => View::Table,
                        View::Table => View::Devices,
                        View::Devices => View::Overview,
                    };
                    self.clamp();
                }
                KeyCode::BackTab => {
                    self.view = match self.view {
                        View::Overview => View::Devices,
                        View::Table => View::Overview,
                        View::Devices => View::Table,
                    };
                    self.clamp();
                }
                KeyCode::Down | KeyCode::Char('j') => {
                    self.selected += 1;
                    self.clamp();
                }
                KeyCode::Up | KeyCode::Char('k') => self.selected = self.selected.saturating_sub(1),
                _ => {}
            },
        }
        Action::None
    }
}
