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

/// Formats a number for tables and labels with three significant digits
/// (no exponent; at most six decimals).
pub fn fmt_value(v: f64) -> String {
    if !v.is_finite() {
        return "-".into();
    }
    if v == 0.0 {
        return "0".into();
    }
    let magnitude = v.abs().log10().floor() as i32;
    let decimals = (2 - magnitude).clamp(0, 6) as usize;
    format!("{v:.decimals$}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn values_keep_three_significant_digits() {
        assert_eq!(super::fmt_value(0.0), "0");
        assert_eq!(super::fmt_value(1234.4), "1234");
        assert_eq!(super::fmt_value(27.46), "27.5");
        assert_eq!(super::fmt_value(6.333), "6.33");
        assert_eq!(super::fmt_value(0.0625), "0.0625");
        assert_eq!(super::fmt_value(0.003906), "0.00391");
        assert_eq!(super::fmt_value(f64::NAN), "-");
    }
}
