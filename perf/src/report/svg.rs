//! latency.svg: one panel per metric, one row per VMM: every sample as a
//! dot, a box from p25 to p75, whiskers from min to max, the median as a
//! thick bar and p90/p99 as ticks. Each panel has its own linear scale from
//! zero, so rows within a panel compare directly. Hand-written SVG text.

use std::collections::BTreeMap;
use std::fmt::Write;

use crate::results::{Metric, Results};
use crate::stats::percentile;

use super::fmt_value;

const WIDTH: f64 = 980.0;
const PLOT_X: f64 = 440.0;
const PLOT_W: f64 = 500.0;
const ROW_H: f64 = 26.0;
const TITLE_H: f64 = 22.0;
const AXIS_H: f64 = 18.0;
const GAP: f64 = 12.0;
const MUTED: &str = "#555";

/// Escapes text for XML content and attribute values.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if (c as u32) < 0x20 && c != '\n' && c != '\t' => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

fn colour(subject: crate::backend::Subject) -> &'static str {
    match subject {
        crate::backend::Subject::Vmm => "#1f77b4",
        crate::backend::Subject::Firecracker => "#ff7f0e",
    }
}

/// Renders the chart.
pub fn render(r: &Results) -> String {
    // Panels in first-seen order, each with the metrics (one per VMM) sharing its id.
    let mut order: Vec<&str> = Vec::new();
    let mut panels: BTreeMap<&str, Vec<&Metric>> = BTreeMap::new();
    for m in r.scenarios.iter().flat_map(|s| &s.metrics) {
        if m.samples.is_empty() {
            continue;
        }
        if !panels.contains_key(m.id.as_str()) {
            order.push(&m.id);
        }
        panels.entry(&m.id).or_default().push(m);
    }
    let mut body = String::new();
    let mut y = 52.0;
    for id in &order {
        let metrics = &panels[id];
        y = panel(&mut body, metrics, y);
    }
    if order.is_empty() {
        let _ = writeln!(
            body,
            r#"<text x="20" y="{:.0}" font-size="13">No samples were measured (see results.md for skipped scenarios).</text>"#,
            y + 10.0
        );
        y += 30.0;
    }
    let height = y + 10.0;
    let mut s = String::new();
    let _ = writeln!(s, r#"<?xml version="1.0" encoding="UTF-8"?>"#);
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH:.0}" height="{height:.0}" viewBox="0 0 {WIDTH:.0} {height:.0}" font-family="sans-serif">"#
    );
    let _ = writeln!(
        s,
        r#"<rect x="0" y="0" width="{WIDTH:.0}" height="{height:.0}" fill="white"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="20" y="20" font-size="16" font-weight="bold">perf: distributions, {} on {} ({} cores)</text>"#,
        escape(&r.started_at),
        escape(&r.machine.cpu_model),
        r.machine.cores
    );
    let _ = writeln!(
        s,
        r#"<text x="20" y="38" font-size="11" fill="{MUTED}">dots = samples (warm-up excluded) · box = p25 to p75 · whiskers = min to max · thick bar = median · thin ticks = p90, p99 · each panel scaled from 0</text>"#
    );
    s.push_str(&body);
    s.push_str("</svg>\n");
    s
}

fn panel(s: &mut String, metrics: &[&Metric], top: f64) -> f64 {
    let Some(first) = metrics.first() else {
        return top;
    };
    let max = metrics
        .iter()
        .flat_map(|m| m.samples.iter().copied())
        .fold(0.0f64, f64::max);
    let max = if max > 0.0 { max * 1.05 } else { 1.0 };
    let x = |v: f64| PLOT_X + (v / max).clamp(0.0, 1.0) * PLOT_W;
    let _ = writeln!(
        s,
        r#"<text x="20" y="{:.1}" font-size="13" font-weight="bold">{} ({})</text>"#,
        top + 15.0,
        escape(&first.label),
        escape(&first.unit)
    );
    let mut y = top + TITLE_H;
    for m in metrics {
        let mid = y + ROW_H / 2.0;
        let c = colour(m.subject);
        let mut sorted = m.samples.clone();
        sorted.sort_by(f64::total_cmp);
        let (p25, p50, p75) = (
            percentile(&sorted, 25.0),
            percentile(&sorted, 50.0),
            percentile(&sorted, 75.0),
        );
        let (p90, p99) = (percentile(&sorted, 90.0), percentile(&sorted, 99.0));
        let (lo, hi) = (sorted[0], sorted[sorted.len() - 1]);
        let _ = writeln!(
            s,
            r#"<text x="30" y="{:.1}" font-size="12" fill="{c}">{} · n={} · median {} {}</text>"#,
            mid + 4.0,
            m.subject,
            sorted.len(),
            fmt_value(p50),
            escape(&m.unit)
        );
        let _ = writeln!(
            s,
            r#"<line x1="{:.1}" y1="{mid:.1}" x2="{:.1}" y2="{mid:.1}" stroke="{c}" stroke-width="1"/>"#,
            x(lo),
            x(hi)
        );
        let _ = writeln!(
            s,
            r#"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="{c}" fill-opacity="0.25" stroke="{c}"/>"#,
            x(p25),
            mid - 7.0,
            (x(p75) - x(p25)).max(1.0),
            14.0
        );
        for (i, v) in m.samples.iter().enumerate() {
            let jitter = (i % 5) as f64 * 2.5 - 5.0;
            let _ = writeln!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="1.8" fill="{c}" fill-opacity="0.6"/>"#,
                x(*v),
                mid + jitter
            );
        }
        let _ = writeln!(
            s,
            r#"<line x1="{0:.1}" y1="{1:.1}" x2="{0:.1}" y2="{2:.1}" stroke="black" stroke-width="3"/>"#,
            x(p50),
            mid - 9.0,
            mid + 9.0
        );
        for p in [p90, p99] {
            let _ = writeln!(
                s,
                r#"<line x1="{0:.1}" y1="{1:.1}" x2="{0:.1}" y2="{2:.1}" stroke="black" stroke-width="1"/>"#,
                x(p),
                mid - 5.0,
                mid + 5.0
            );
        }
        y += ROW_H;
    }
    // Axis with ticks at 0, 25, 50, 75 and 100 % of the scale.
    let _ = writeln!(
        s,
        r##"<line x1="{PLOT_X:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#888"/>"##,
        PLOT_X + PLOT_W
    );
    for i in 0..=4 {
        let v = max * f64::from(i) / 4.0;
        let _ = writeln!(
            s,
            r##"<line x1="{0:.1}" y1="{y:.1}" x2="{0:.1}" y2="{1:.1}" stroke="#888"/><text x="{0:.1}" y="{2:.1}" font-size="10" text-anchor="middle" fill="#555">{3}</text>"##,
            x(v),
            y + 4.0,
            y + 14.0,
            fmt_value(v)
        );
    }
    y + AXIS_H + GAP
}
