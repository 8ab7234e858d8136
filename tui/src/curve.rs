//! The selected table's live miss-ratio curve, drawn as a chart: capacity
//! factor (1/8× to 8×, a log scale) on x, estimated hit rate on y, and the
//! table's measured hit rate marked at 1×. The curve is an LRU cache's
//! whatever the table's policy: on a table of another policy the title and
//! the legend say so (issue 32), and sampled keys the estimator lost are
//! counted in the legend.

use ratatui::layout::{Constraint, Rect};
use ratatui::style::{Color, Style};
use ratatui::symbols::Marker;
use ratatui::text::Span;
use ratatui::widgets::{Axis, Block, Borders, Chart, Dataset, GraphType, LegendPosition, Paragraph};
use ratatui::Frame;

use crate::model::Table;

/// Draws `t`'s curve into `area` (a note when it has none).
pub fn draw(f: &mut Frame, t: &Table, area: Rect) {
    let lru = t.policy == "lru";
    let title = if lru {
        " hit rate by capacity (LRU, estimated) ".to_string()
    } else {
        format!(" hit rate by capacity (LRU estimate; table evicts by {}) ", t.policy)
    };
    let block = Block::default().borders(Borders::ALL).title(title);
    if !t.curve_on {
        f.render_widget(Paragraph::new("no curve: the daemon runs with --no-mrc").block(block), area);
        return;
    }
    if t.curve.is_empty() {
        // The daemon gives a curve points from 100 sampled lookups on.
        let note = format!("no estimate yet: {} of 100 sampled lookups", t.curve_sampled);
        f.render_widget(Paragraph::new(note).block(block), area);
        return;
    }
    let points: Vec<(f64, f64)> = t.curve.iter().map(|&(x, y)| (x.log2(), y * 100.0)).collect();
    let at_one = t.curve.iter().find(|p| p.0 == 1.0).map(|p| p.1);
    let measured: Vec<(f64, f64)> = t.hit_rate().map(|h| vec![(0.0, h * 100.0)]).unwrap_or_default();
    let legend = match (t.hit_rate(), at_one) {
        (Some(h), Some(e)) if lru => format!("measured {:.1}% (est. {:.1}%)", h * 100.0, e * 100.0),
        (Some(h), Some(e)) => format!("measured {:.1}% ({}; LRU est. {:.1}%)", h * 100.0, t.policy, e * 100.0),
        (Some(h), None) => format!("measured {:.1}%", h * 100.0),
        (None, _) => "measured: no lookups yet".into(),
    };
    let top = points.iter().map(|p| p.1).chain(measured.iter().map(|p| p.1)).fold(0.0, f64::max);
    let y_max = ((top / 10.0).ceil() * 10.0).clamp(10.0, 100.0);
    let datasets = vec![
        Dataset::default()
            .name(match t.curve_dropped {
                0 => "LRU estimate".to_string(),
                n => format!("LRU estimate ({n} samples dropped)"),
            })
            .marker(Marker::Braille)
            .graph_type(GraphType::Line)
            .style(Style::default().fg(Color::Cyan))
            .data(&points),
        Dataset::default()
            .name(legend)
            .marker(Marker::Block)
            .graph_type(GraphType::Scatter)
            .style(Style::default().fg(Color::Yellow))
            .data(&measured),
    ];
    let x_labels = ["1/8x", "1/4x", "1/2x", "1x", "2x", "4x", "8x"].map(Span::raw);
    let y_labels = [0.0, y_max / 2.0, y_max].map(|v| Span::raw(format!("{v:.0}%")));
    let chart = Chart::new(datasets)
        .block(block)
        .x_axis(Axis::default().title("capacity").bounds([-3.0, 3.0]).labels(x_labels))
        .y_axis(Axis::default().title("hit").bounds([0.0, y_max]).labels(y_labels))
        // The curve rises to the right: the bottom right is free for the legend.
        .legend_position(Some(LegendPosition::BottomRight))
        .hidden_legend_constraints((Constraint::Percentage(100), Constraint::Percentage(100)));
    f.render_widget(chart, area);
}
