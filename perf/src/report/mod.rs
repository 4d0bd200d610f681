//! Writing the results: results.json (everything), results.md (a table) and
//! latency.svg (the distribution of every metric).

pub mod markdown;
pub mod svg;

use std::path::{Path, PathBuf};

use crate::error::{PerfError, Result};
use crate::results::Results;

/// The files written into the output folder.
pub const JSON_FILE: &str = "results.json";
/// Markdown table.
pub const MARKDOWN_FILE: &str = "results.md";
/// SVG chart.
pub const SVG_FILE: &str = "latency.svg";

/// Writes all three files into `out` (created if needed); returns their paths.
pub fn write_all(results: &Results, out: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(out).map_err(PerfError::io("cannot create", out))?;
    let files = [
        (JSON_FILE, serde_json::to_string_pretty(results)? + "\n"),
        (MARKDOWN_FILE, markdown::render(results)),
        (SVG_FILE, svg::render(results)),
    ];
    let mut written = Vec::new();
    for (name, text) in files {
        let path = out.join(name);
        std::fs::write(&path, text).map_err(PerfError::io("cannot write", &path))?;
        written.push(path);
    }
    Ok(written)
}

/// Formats a number for tables and labels: three significant digits-ish.
pub fn fmt_value(v: f64) -> String {
    if !v.is_finite() {
        "-".into()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}
