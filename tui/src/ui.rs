//! Drawing. Colors are accents on the terminal's own foreground and
//! background (selection is reverse video), so they read on dark and light
//! themes alike; every area is laid out by constraints, so any terminal size,
//! down to a single cell, draws without panicking.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Cell, Clear, Gauge, Paragraph, Row, Sparkline, Table, Tabs, Wrap};
use ratatui::Frame;

use crate::app::{App, Mode, View};
use crate::model::Table as T;

fn human(n: f64) -> String {
    let a = n.abs();
    if a >= 1e9 {
        format!("{:.1}G", n / 1e9)
    } else if a >= 1e6 {
        format!("{:.1}M", n / 1e6)
    } else if a >= 1e3 {
        format!("{:.1}k", n / 1e3)
    } else {
        format!("{n:.0}")
    }
}

fn bytes(n: u64) -> String {
    let n = n as f64;
    if n >= 1e9 {
        format!("{:.1} GB", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.1} MB", n / 1e6)
    } else {
        format!("{:.0} kB", n / 1e3)
    }
}

fn bar(frac: f64, width: usize) -> String {
    let full = ((frac.clamp(0.0, 1.0) * width as f64).round() as usize).min(width);
    format!("{}{} {:>5.1}%", "█".repeat(full), "░".repeat(width - full), frac * 100.0)
}

fn load_color(frac: f64) -> Color {
    if frac >= 0.95 {
        Color::Red
    } else if frac >= 0.75 {
        Color::Yellow
    } else {
        Color::Green
    }
}

/// The smallest terminal the views fit in; below it the console says so
/// instead of drawing views whose rows and columns would be cut.
const MIN_AREA: (u16, u16) = (60, 16);

/// Draws the whole console.
pub fn draw(f: &mut Frame, app: &App) {
    let a = f.area();
    if a.width < MIN_AREA.0 || a.height < MIN_AREA.1 {
        let text = format!(
            "hkvd top needs {}x{} or more; this terminal is {}x{}. q quits.",
            MIN_AREA.0, MIN_AREA.1, a.width, a.height
        );
        f.render_widget(Paragraph::new(text).wrap(Wrap { trim: true }), a);
        return;
    }
    let [header, tabs, body, footer] =
        Layout::vertical([Constraint::Length(1), Constraint::Length(1), Constraint::Min(0), Constraint::Length(2)])
            .areas(a);
    draw_header(f, app, header);
    let titles = ["Overview", "Table", "Devices"];
    let idx = match app.view {
        View::Overview => 0,
        View::Table => 1,
        View::Devices => 2,
    };
    f.render_widget(
        Tabs::new(titles)
            .select(idx)
            .highlight_style(Style::default().add_modifier(Modifier::REVERSED | Modifier::BOLD)),
        tabs,
    );
    match app.view {
        View::Overview => draw_overview(f, app, body),
        View::Table => draw_table(f, app, body),
        View::Devices => draw_devices(f, app, body),
    }
    draw_footer(f, app, footer);
    match app.mode {
        Mode::Help => draw_help(f),
        Mode::Confirm => draw_popup(f, "Checkpoint", "Start a checkpoint now? (y / n)"),
        _ => {}
    }
}

fn draw_header(f: &mut Frame, app: &App, area: Rect) {
    let line = match (&app.down, &app.snap) {
        (Some(e), _) => Line::from(vec![
            Span::styled(
                " hkvd down ",
                Style::default().fg(Color::Red).add_modifier(Modifier::BOLD | Modifier::REVERSED),
            ),
            Span::raw(format!(" {e} — reconnecting to {}", app.socket)),
        ]),
        (None, Some(s)) => {
            let badge = format!(" hkvd {} ", s.version);
            // Whole items, the least important left out first (the socket,
            // then the request count, ...): at 80 columns the line was cut
            // mid-value (`1 conn  114.8`).
            let items = [
                (format!("up {}", uptime(s.uptime_s)), 0),
                (s.backend.clone(), 2),
                (format!("{} shards", s.shards), 4),
                (format!("{} conn", s.connections), 3),
                (format!("{} req", human(s.requests as f64)), 5),
                (format!("{} err", s.errors), 1),
                (app.socket.clone(), 6),
            ];
            let room = (area.width as usize).saturating_sub(badge.chars().count() + 1);
            let shown = fit_items(&items, room, 2);
            Line::from(vec![
                Span::styled(badge, Style::default().add_modifier(Modifier::BOLD | Modifier::REVERSED)),
                Span::raw(format!(" {}", shown.join("  "))),
            ])
        }
        (None, None) => Line::raw(format!(" connecting to {} …", app.socket)),
    };
    f.render_widget(Paragraph::new(line), area);
}

/// The texts of `items` (text, rank: 0 the last to go) that fit `width`
/// cells with `gap` cells between them ([`fit`]), in their given order.
fn fit_items(items: &[(String, u8)], width: usize, gap: usize) -> Vec<String> {
    let keep = fit(items.iter().map(|(t, rank)| (t.chars().count(), *rank)), width, gap);
    kept(items.iter().map(|(t, _)| t.clone()), &keep)
}

fn uptime(s: f64) -> String {
    let s = s as u64;
    if s >= 86400 {
        format!("{}d{}h", s / 86400, s % 86400 / 3600)
    } else if s >= 3600 {
        format!("{}h{}m", s / 3600, s % 3600 / 60)
    } else {
        format!("{}m{}s", s / 60, s % 60)
    }
}

/// The overview's columns.
const OVERVIEW_COLUMNS: [Column; 12] = [
    ("table", 8, 0),
    ("dim", 4, 9),
    ("policy", 9, 8),
    ("mode", 6, 10),
    ("size", 10, 2),
    ("capacity", 10, 6),
    ("load", 17, 3),
    ("hit %", 6, 1),
    ("ops/s", 7, 5),
    ("keys/s", 7, 4),
    ("evict/s", 7, 7),
    ("reject/s", 8, 11),
];

/// A view's column: title, width, and rank (0 the last to go when the
/// terminal is too narrow for all of a view's columns).
type Column = (&'static str, u16, u8);

/// Which of `cols` fit `width` cells (one cell between columns) ([`fit`]).
fn fit_columns(cols: &[Column], width: u16) -> Vec<bool> {
    fit(cols.iter().map(|c| (usize::from(c.1), c.2)), usize::from(width), 1)
}

/// Which of the things of `(width, rank)` fit `width` cells with `gap`
/// cells between two: the lowest ranks first (the lowest always), then
/// the others in rank order while they fit.
fn fit(things: impl Iterator<Item = (usize, u8)>, width: usize, gap: usize) -> Vec<bool> {
    let things: Vec<(usize, u8)> = things.collect();
    let mut keep = vec![false; things.len()];
    let mut order: Vec<usize> = (0..things.len()).collect();
    order.sort_by_key(|&i| things[i].1);
    let mut used = 0;
    for i in order {
        let need = things[i].0 + if used > 0 { gap } else { 0 };
        if used + need > width && used > 0 {
            break;
        }
        used += need;
        keep[i] = true;
    }
    keep
}

/// The items of `all` whose column `keep` holds.
fn kept<T>(all: impl IntoIterator<Item = T>, keep: &[bool]) -> Vec<T> {
    all.into_iter().zip(keep).filter(|(_, &k)| k).map(|(x, _)| x).collect()
}

/// The widths of the kept columns.
fn kept_widths(cols: &[Column], keep: &[bool]) -> Vec<Constraint> {
    kept(cols.iter().map(|c| Constraint::Length(c.1)), keep)
}

/// The widest a name column grows (a longer name is cut): a name column
/// free to grow took what the others left (96 cells at 200 columns) and
/// pushed them to the far right.
const NAME_CAP: usize = 32;

/// `cols` with the first (a name) as wide as the longest of `names`, at
/// least its usual width and at most [`NAME_CAP`].
fn name_sized(cols: &[Column], names: impl IntoIterator<Item = usize>) -> Vec<Column> {
    let mut out = cols.to_vec();
    let widest = names.into_iter().max().unwrap_or(0).min(NAME_CAP) as u16;
    out[0].1 = out[0].1.max(widest);
    out
}

fn draw_overview(f: &mut Frame, app: &App, area: Rect) {
    // The detail panel's 9 rows give way on a short terminal, so that the
    // list keeps room for a few tables (6 rows: 3 tables at 60x16).
    let detail_rows = if area.height >= 18 { 9 } else { area.height.saturating_sub(6).min(9) };
    let [list, detail] = Layout::vertical([Constraint::Min(3), Constraint::Length(detail_rows)]).areas(area);
    // The columns that fit the panel, in their usual order (a narrow
    // terminal drops reject/s first, then mode, dim, policy, evict/s,
    // capacity, ops/s).
    let visible = app.visible();
    let cols = name_sized(&OVERVIEW_COLUMNS, visible.iter().map(|t| t.name.chars().count()));
    let keep = fit_columns(&cols, list.width.saturating_sub(2));
    let header =
        Row::new(kept(OVERVIEW_COLUMNS.map(|c| c.0), &keep)).style(Style::default().add_modifier(Modifier::BOLD));
    let rows = visible.iter().enumerate().map(|(i, t)| {
        let r = app.rates.get(&t.name).copied().unwrap_or_default();
        let load = t.load();
        let cells = [
            Cell::from(t.name.clone()),
            Cell::from(t.dim.to_string()),
            Cell::from(t.policy.clone()),
            Cell::from(t.mode.clone()),
            Cell::from(t.size().to_string()),
            Cell::from(t.capacity().to_string()),
            Cell::from(bar(load, 10)).style(Style::default().fg(load_color(load))),
            Cell::from(t.hit_rate().map(|h| format!("{:.2}", h * 100.0)).unwrap_or_else(|| "-".into())),
            Cell::from(human(r.ops)),
            Cell::from(human(r.keys)),
            Cell::from(human(r.evictions)),
            Cell::from(human(r.rejections)),
        ];
        let row = Row::new(kept(cells, &keep));
        if i == app.selected {
            row.style(Style::default().add_modifier(Modifier::REVERSED))
        } else {
            row
        }
    });
    let widths = kept_widths(&cols, &keep);
    let title =
        if app.filter.is_empty() { " tables ".to_string() } else { format!(" tables matching /{} ", app.filter) };
    f.render_widget(
        Table::new(rows, widths).header(header).block(Block::default().borders(Borders::ALL).title(title)),
        list,
    );
    let Some(t) = app.current_table() else {
        f.render_widget(
            Paragraph::new(match &app.snap {
                Some(s) if !s.tables.is_empty() => format!("no table matches /{} (esc clears)", app.filter),
                Some(_) => "no tables (hkvctl create-table …)".into(),
                None => "waiting for stats".into(),
            })
            .block(Block::default().borders(Borders::ALL)),
            detail,
        );
        return;
    };
    let [sparks, lock] = Layout::horizontal([Constraint::Percentage(60), Constraint::Percentage(40)]).areas(detail);
    draw_sparklines(f, app, t, sparks);
    draw_lock(f, t, lock);
}

fn draw_sparklines(f: &mut Frame, app: &App, t: &T, area: Rect) {
    let block = Block::default().borders(Borders::ALL).title(format!(" {} — last minutes ", t.name));
    let inner = block.inner(area);
    f.render_widget(block, area);
    let [a, b] = Layout::vertical([Constraint::Percentage(50), Constraint::Percentage(50)]).areas(inner);
    let h = app.history.get(&t.name);
    for (area, label, data, color) in [
        (a, "evictions/s", h.map(|h| &h.evictions), Color::Yellow),
        (b, "rejections/s", h.map(|h| &h.rejections), Color::Magenta),
    ] {
        let [l, s] = Layout::horizontal([Constraint::Length(20), Constraint::Min(0)]).areas(area);
        let last = data.and_then(|d| d.back()).copied().unwrap_or(0);
        f.render_widget(Paragraph::new(format!("{label} {}", human(last as f64))), l);
        let tail: Vec<u64> =
            data.map(|d| d.iter().rev().take(s.width as usize).rev().copied().collect()).unwrap_or_default();
        f.render_widget(Sparkline::default().data(&tail).style(Style::default().fg(color)), s);
    }
}

fn draw_lock(f: &mut Frame, t: &T, area: Rect) {
    let mut running = [0u64; 3];
    let mut waiting = [0u64; 3];
    let mut waits = [0u64; 3];
    let mut wait_s = [0f64; 3];
    let mut active = vec![];
    for s in &t.shards {
        for g in 0..3 {
            running[g] += s.lock.running[g];
            waiting[g] += s.lock.waiting[g];
            waits[g] += s.lock.waits[g];
            wait_s[g] += s.lock.wait_s[g];
        }
        if !s.lock.active.is_empty() && !active.contains(&s.lock.active) {
            active.push(s.lock.active.clone());
        }
    }
    let active = if active.is_empty() { "idle".to_string() } else { active.join(", ") };
    let mut lines = vec![Line::from(vec![
        Span::raw("active: "),
        Span::styled(active, Style::default().add_modifier(Modifier::BOLD)),
    ])];
    // The columns that fit, whole: at 80x24 the panel is 28 cells wide
    // and cut the header mid-word (`waiting    w`); the least important go.
    let keep = fit_columns(&LOCK_COLUMNS, area.width.saturating_sub(2));
    let row = |cells: [String; 5]| {
        let mut out = String::new();
        for (i, (c, col)) in cells.iter().zip(&LOCK_COLUMNS).enumerate().filter(|(i, _)| keep[*i]) {
            if i == 0 {
                out += &format!("{c:<w$}", w = col.1 as usize);
            } else {
                out += &format!(" {c:>w$}", w = col.1 as usize);
            }
        }
        Line::raw(out)
    };
    lines.push(row(LOCK_COLUMNS.map(|c| c.0.to_string())));
    for (g, name) in ["readers", "updaters", "inserters"].iter().enumerate() {
        lines.push(row([
            name.to_string(),
            running[g].to_string(),
            waiting[g].to_string(),
            waits[g].to_string(),
            format!("{:.2}", wait_s[g]),
        ]));
    }
    f.render_widget(Paragraph::new(lines).block(Block::default().borders(Borders::ALL).title(" lock groups ")), area);
}

/// The lock-groups panel's columns: waits (a count since start) goes
/// first, then the seconds waited.
const LOCK_COLUMNS: [Column; 5] =
    [("group", 9, 0), ("running", 7, 1), ("waiting", 7, 2), ("waits", 8, 4), ("wait s", 8, 3)];

/// The table view's shard columns.
const SHARD_COLUMNS: [Column; 12] = [
    ("shard", 5, 0),
    ("size", 10, 2),
    ("capacity", 10, 6),
    ("load", 15, 3),
    ("hit %", 6, 1),
    ("evictions", 10, 4),
    ("rejections", 10, 11),
    ("lock", 8, 8),
    ("R/U/I run", 9, 10),
    ("R/U/I wait", 10, 5),
    ("device", 9, 7),
    ("host", 9, 9),
];

fn draw_table(f: &mut Frame, app: &App, area: Rect) {
    let Some(t) = app.current_table() else {
        f.render_widget(Paragraph::new("no table selected").block(Block::default().borders(Borders::ALL)), area);
        return;
    };
    // The bottom panels' 14 rows give way on a short terminal, so that the
    // shards (and a backed table's tier) keep their rows; under 6 they go.
    let wanted = 3 + t.shards.len().min(8) as u16 + if t.backing.is_some() { 5 } else { 0 };
    let bottom_rows = match area.height.saturating_sub(3 + wanted) {
        r if r >= 6 => r.min(14),
        _ => 0,
    };
    let [gauge, rest, bottom] =
        Layout::vertical([Constraint::Length(3), Constraint::Min(3), Constraint::Length(bottom_rows)]).areas(area);
    let [ops, curve] = Layout::horizontal([Constraint::Percentage(45), Constraint::Percentage(55)]).areas(bottom);
    crate::curve::draw(f, t, curve);
    let by_type = app.by_type.get(&t.name).cloned().unwrap_or_default();
    let op_rows = by_type
        .iter()
        .map(|(n, o, k)| Row::new(vec![Cell::from(n.clone()), Cell::from(human(*o)), Cell::from(human(*k))]));
    // The operation's name as wide as the longest (not all the panel left).
    let op_width = by_type.iter().map(|(n, _, _)| n.chars().count()).max().unwrap_or(0).clamp(9, NAME_CAP) as u16;
    f.render_widget(
        Table::new(op_rows, [Constraint::Length(op_width), Constraint::Length(9), Constraint::Length(8)])
            .header(Row::new(["operation", "batches/s", "keys/s"]).style(Style::default().add_modifier(Modifier::BOLD)))
            .block(Block::default().borders(Borders::ALL).title(" operations per second by type ")),
        ops,
    );
    f.render_widget(
        Gauge::default()
            .block(
                Block::default()
                    .borders(Borders::ALL)
                    .title(format!(" {} — dim {}, {}, {} ", t.name, t.dim, t.policy, t.mode)),
            )
            .gauge_style(Style::default().fg(load_color(t.load())))
            .ratio(t.load())
            .label(format!("load {:.1}%  ({} of {})", t.load() * 100.0, t.size(), t.capacity())),
        gauge,
    );
    let cols = name_sized(&SHARD_COLUMNS, [t.shards.len().saturating_sub(1).to_string().len()]);
    let keep = fit_columns(&cols, area.width.saturating_sub(2));
    let header = Row::new(kept(SHARD_COLUMNS.map(|c| c.0), &keep)).style(Style::default().add_modifier(Modifier::BOLD));
    let rows = t.shards.iter().enumerate().map(|(i, s)| {
        let load = if s.capacity == 0 { 0.0 } else { s.size as f64 / s.capacity as f64 };
        let (h, m) = (s.hits, s.misses);
        let cells = [
            Cell::from(i.to_string()),
            Cell::from(s.size.to_string()),
            Cell::from(s.capacity.to_string()),
            Cell::from(bar(load, 8)).style(Style::default().fg(load_color(load))),
            Cell::from(if h + m > 0 { format!("{:.2}", 100.0 * h as f64 / (h + m) as f64) } else { "-".into() }),
            Cell::from(s.evictions.to_string()),
            Cell::from(s.rejections.to_string()),
            Cell::from(if s.lock.active.is_empty() { "idle".into() } else { s.lock.active.clone() }),
            Cell::from(format!("{}/{}/{}", s.lock.running[0], s.lock.running[1], s.lock.running[2])),
            Cell::from(format!("{}/{}/{}", s.lock.waiting[0], s.lock.waiting[1], s.lock.waiting[2])),
            Cell::from(bytes(s.fast_bytes)),
            Cell::from(bytes(s.host_bytes)),
        ];
        Row::new(kept(cells, &keep))
    });
    let widths = kept_widths(&cols, &keep);
    let rest = match &t.backing {
        Some(b) => {
            let [shards, tier] = Layout::vertical([Constraint::Min(3), Constraint::Length(5)]).areas(rest);
            draw_backing(f, b, tier);
            shards
        }
        None => rest,
    };
    f.render_widget(
        Table::new(rows, widths).header(header).block(Block::default().borders(Borders::ALL).title(" shards ")),
        rest,
    );
}

/// A backed table's tier: where its reads were answered, the write-back
/// queue (the window a crash would lose), bytes each way, latency and
/// staleness, errors by node.
fn draw_backing(f: &mut Frame, b: &hkv_client::proto::stats::BackingStats, area: Rect) {
    let reads = b.hits + b.filled + b.absent + b.late + b.unavailable;
    let pct = |n: u64| if reads == 0 { "-".to_string() } else { format!("{:.1}%", 100.0 * n as f64 / reads as f64) };
    let errors: u64 = b.node_errors.values().sum();
    let lines = vec![
        Line::from(format!(
            "reads: cache {}  filled {}  absent {}  late {}  unavailable {}   fetch p50 {} µs, p99 {} µs",
            pct(b.hits),
            pct(b.filled),
            pct(b.absent),
            pct(b.late),
            pct(b.unavailable),
            b.fetch_p50_us,
            b.fetch_p99_us
        )),
        Line::from(format!(
            "queue: {} rows, {} of {}, oldest {} ms, {} writers refused   in {} out {}   rows written {}",
            b.queue_rows,
            bytes(b.queue_bytes),
            bytes(b.queue_limit_bytes),
            b.queue_oldest_ms,
            b.queue_full,
            bytes(b.bytes_in),
            bytes(b.bytes_out),
            b.rows_written
        )),
        Line::from(format!(
            "other hosts: {} invalidations, staleness p50 {} µs, p99 {} µs   node errors {}{}",
            b.invalidations,
            b.staleness_p50_us,
            b.staleness_p99_us,
            errors,
            // This host's writes other hosts have not heard yet (the
            // stream's node refused their entries), when there are any.
            if b.unpublished_entries + b.unpublished_resets > 0 {
                format!(
                    "   unheard: {} stream entries ({} of {}), {} resets",
                    b.unpublished_entries,
                    bytes(b.unpublished_bytes),
                    bytes(b.unpublished_limit_bytes),
                    b.unpublished_resets
                )
            } else {
                String::new()
            }
        )),
    ];
    f.render_widget(
        Paragraph::new(lines).block(Block::default().borders(Borders::ALL).title(format!(" cluster ({}) ", b.mode))),
        area,
    );
}

/// The devices view's columns.
const DEVICE_COLUMNS: [Column; 7] = [
    ("device", 7, 0),
    ("tables", 7, 6),
    ("entries", 12, 2),
    ("capacity", 12, 4),
    ("load", 17, 1),
    ("device memory", 14, 3),
    ("host memory", 12, 5),
];

fn draw_devices(f: &mut Frame, app: &App, area: Rect) {
    let Some(s) = &app.snap else {
        f.render_widget(Paragraph::new("waiting for stats").block(Block::default().borders(Borders::ALL)), area);
        return;
    };
    let n = s.tables.iter().map(|t| t.shards.len()).max().unwrap_or(0);
    let cols = name_sized(&DEVICE_COLUMNS, [n.saturating_sub(1).to_string().len()]);
    let keep = fit_columns(&cols, area.width.saturating_sub(2));
    let header =
        Row::new(kept(DEVICE_COLUMNS.map(|c| c.0), &keep)).style(Style::default().add_modifier(Modifier::BOLD));
    let rows = (0..n).map(|i| {
        let shards: Vec<_> = s.tables.iter().filter_map(|t| t.shards.get(i)).collect();
        let (size, cap) = (shards.iter().map(|x| x.size).sum::<u64>(), shards.iter().map(|x| x.capacity).sum::<u64>());
        let load = if cap == 0 { 0.0 } else { size as f64 / cap as f64 };
        let cells = [
            Cell::from(i.to_string()),
            Cell::from(shards.len().to_string()),
            Cell::from(size.to_string()),
            Cell::from(cap.to_string()),
            Cell::from(bar(load, 10)).style(Style::default().fg(load_color(load))),
            Cell::from(bytes(shards.iter().map(|x| x.fast_bytes).sum())),
            Cell::from(bytes(shards.iter().map(|x| x.host_bytes).sum())),
        ];
        let row = Row::new(kept(cells, &keep));
        if i == app.selected {
            row.style(Style::default().add_modifier(Modifier::REVERSED))
        } else {
            row
        }
    });
    let widths = kept_widths(&cols, &keep);
    f.render_widget(
        Table::new(rows, widths)
            .header(header)
            .block(Block::default().borders(Borders::ALL).title(format!(" devices — {} ", s.backend))),
        area,
    );
}

fn draw_footer(f: &mut Frame, app: &App, area: Rect) {
    let [ck, keys] = Layout::vertical([Constraint::Length(1), Constraint::Length(1)]).areas(area);
    let c = app.snap.as_ref().map(|s| &s.checkpoint);
    // The status line in the longest form that fits (a 16-digit id, or an
    // error, was cut off at 60 columns), else the shortest cut with "…".
    let w = ck.width as usize;
    match c.and_then(|c| c.running.as_ref()) {
        Some(p) => {
            let ratio = if p.total == 0 { 0.0 } else { (p.done as f64 / p.total as f64).clamp(0.0, 1.0) };
            let label = fit_line(
                &[
                    format!("checkpoint {}: {}/{} entries, ETA {:.0}s", p.id, p.done, p.total, p.eta_s),
                    format!("checkpoint {}/{} entries, ETA {:.0}s", p.done, p.total, p.eta_s),
                    format!("ckpt {:.0}%, ETA {:.0}s", ratio * 100.0, p.eta_s),
                ],
                w,
            );
            f.render_widget(
                Gauge::default().gauge_style(Style::default().fg(Color::Cyan)).ratio(ratio).label(label),
                ck,
            );
        }
        None => {
            let (next, short_next) = match c.and_then(|c| c.next_in_s) {
                Some(s) => (format!("  next in {s:.0}s"), format!("  next {s:.0}s")),
                None => ("  next: on demand (c)".into(), "  next: c".into()),
            };
            let forms = match c.and_then(|c| c.last.as_ref()) {
                Some((id, n, secs, None)) => vec![
                    format!("last checkpoint {id}: {n} entries in {secs:.1}s{next}"),
                    format!("last checkpoint: {n} entries in {secs:.1}s{next}"),
                    format!("ckpt: {n} entries, {secs:.1}s{short_next}"),
                ],
                Some((id, _, _, Some(e))) => vec![
                    format!("last checkpoint {id} FAILED: {e}{next}"),
                    format!("last checkpoint FAILED: {e}{next}"),
                    // The error cut, the schedule kept.
                    format!("{}{short_next}", cut(&format!("ckpt FAILED: {e}"), w.saturating_sub(short_next.len()))),
                ],
                None => match c.and_then(|c| c.restored.as_ref()) {
                    Some((id, n)) => vec![
                        format!("no checkpoint since the restore of {id} ({n} entries){next}"),
                        format!("no checkpoint since the restore ({n} entries){next}"),
                        format!("no ckpt since the restore{short_next}"),
                    ],
                    None => vec![format!("no checkpoint yet{next}")],
                },
            };
            f.render_widget(Paragraph::new(fit_line(&forms, w)), ck);
        }
    }
    let text = match app.mode {
        Mode::Filter => format!("/{}▏ (enter: keep, esc: clear)", app.filter),
        _ => {
            let msg = app.message.as_deref().map(|m| format!("  — {m}")).unwrap_or_default();
            format!("q quit  ? help  tab view  ↑↓/jk move  / filter  c checkpoint{msg}")
        }
    };
    f.render_widget(Paragraph::new(text).style(Style::default().add_modifier(Modifier::DIM)), keys);
}

/// The first of `forms` (longest first) that fits `width` cells, else the
/// last cut to fit.
fn fit_line(forms: &[String], width: usize) -> String {
    match forms.iter().find(|f| f.chars().count() <= width) {
        Some(f) => f.clone(),
        None => cut(forms.last().map_or("", String::as_str), width),
    }
}

/// `s` in at most `width` cells, ending in "…" when cut.
fn cut(s: &str, width: usize) -> String {
    if s.chars().count() <= width {
        return s.to_string();
    }
    let mut out: String = s.chars().take(width.saturating_sub(1)).collect();
    out.push('…');
    out
}

fn centered(area: Rect, w: u16, h: u16) -> Rect {
    let w = w.min(area.width);
    let h = h.min(area.height);
    Rect { x: area.x + (area.width - w) / 2, y: area.y + (area.height - h) / 2, width: w, height: h }
}

fn draw_popup(f: &mut Frame, title: &str, text: &str) {
    let area = centered(f.area(), 44, 5);
    f.render_widget(Clear, area);
    f.render_widget(
        Paragraph::new(text)
            .wrap(Wrap { trim: true })
            .block(Block::default().borders(Borders::ALL).title(format!(" {title} "))),
        area,
    );
}

fn draw_help(f: &mut Frame) {
    let lines = [
        "q, Esc, Ctrl-C   quit (the terminal is restored; Esc clears a filter first)",
        "?                this help (any key closes it)",
        "tab / shift-tab  overview → table by shard → devices",
        "↑ ↓  or  k j     move the selection",
        "/                filter tables by name (enter keeps, esc clears)",
        "c                start a checkpoint (asks first)",
        "",
        "load bars: green < 75 %, yellow < 95 %, red above",
        "sparklines: evictions and rejections per second",
        "lock groups: readers and updaters share, inserters run alone",
    ];
    // As wide as the longest line and its borders (a fixed 68 cut the
    // first line at any terminal size); on a narrower terminal the lines
    // wrap, and the box grows by the rows they take.
    let widest = lines.iter().map(|l| l.chars().count()).max().unwrap_or(0) as u16 + 2;
    let width = widest.min(f.area().width);
    let inner = width.saturating_sub(2).max(1) as usize;
    let rows: usize = lines.iter().map(|l| l.chars().count().div_ceil(inner).max(1)).sum();
    let area = centered(f.area(), width, rows as u16 + 2);
    f.render_widget(Clear, area);
    f.render_widget(
        Paragraph::new(lines.iter().map(|l| Line::raw(*l)).collect::<Vec<_>>())
            .wrap(Wrap { trim: false })
            .block(Block::default().borders(Borders::ALL).title(" hkvd top — help ")),
        area,
    );
}
