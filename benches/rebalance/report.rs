//! The printed table, latency samples and the CDF plot.

use super::*;

/// Latencies, sorted.
#[derive(Clone)]
pub(crate) struct Sample(pub(crate) Vec<Duration>);

impl Sample {
    pub(crate) fn new(mut v: Vec<Duration>) -> Sample {
        v.sort();
        Sample(v)
    }
    pub(crate) fn pct(&self, p: f64) -> Duration {
        if self.0.is_empty() {
            return Duration::ZERO;
        }
        let i = ((self.0.len() as f64 - 1.0) * p).round() as usize;
        self.0[i]
    }
    pub(crate) fn max(&self) -> Duration {
        self.0.last().copied().unwrap_or_default()
    }
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The printed table: every row a figure and, for latencies, its multiple of the commit.
pub(crate) struct Table {
    pub(crate) floor: Duration,
    pub(crate) rows: Vec<(String, String, String)>,
}

impl Table {
    pub(crate) fn latency(&mut self, what: impl Into<String>, d: Duration) {
        let multiple = format!("{:.1}x", d.as_secs_f64() / self.floor.as_secs_f64());
        self.push((what.into(), format!("{:.1} ms", ms(d)), multiple));
    }
    pub(crate) fn figure(&mut self, what: impl Into<String>, value: impl Into<String>) {
        self.push((what.into(), value.into(), String::new()));
    }
    /// Rows are also printed as they come, so a run that fails later keeps what it measured.
    pub(crate) fn push(&mut self, row: (String, String, String)) {
        eprintln!("  {}: {} {}", row.0, row.1, row.2);
        self.rows.push(row);
    }
    pub(crate) fn render(&self) -> String {
        let w = self.rows.iter().map(|r| r.0.len()).max().unwrap_or(10);
        let mut out = String::new();
        let _ = writeln!(out, "| {:<w$} | {:>14} | {:>9} |", "measure", "value", "commits");
        let _ = writeln!(out, "|{}|{}|{}|", "-".repeat(w + 2), "-".repeat(16), "-".repeat(11));
        for (what, value, multiple) in &self.rows {
            let _ = writeln!(out, "| {what:<w$} | {value:>14} | {multiple:>9} |");
        }
        out
    }
}

pub(crate) fn ratio(table: &mut Table, baseline: &str, what: &str, tenure: Duration, other: Duration) {
    table.figure(
        format!("ratio {baseline} / tenure: {what}"),
        format!("{:.1}x", other.as_secs_f64() / tenure.as_secs_f64().max(1e-9)),
    );
}

/// Cumulative distributions of per-partition latencies, on a log scale from 1 ms to 10 s, as SVG.
pub(crate) fn cdf_svg(curves: &[(String, Sample)]) -> String {
    let (w, h, left, bottom, top, right) = (760.0, 420.0, 60.0, 50.0, 20.0, 20.0);
    let (plot_w, plot_h) = (w - left - right, h - top - bottom);
    let x_of = |d: Duration| {
        let ms = ms(d).clamp(1.0, 10_000.0);
        left + plot_w * ms.log10() / 4.0
    };
    let y_of = |f: f64| top + plot_h * (1.0 - f);
    let colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"];
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    for (i, label) in ["1 ms", "10 ms", "100 ms", "1 s", "10 s"].iter().enumerate() {
        let x = left + plot_w * i as f64 / 4.0;
        let _ = writeln!(
            svg,
            "<line x1=\"{x}\" y1=\"{top}\" x2=\"{x}\" y2=\"{}\" stroke=\"#ddd\"/>",
            top + plot_h
        );
        let _ = writeln!(
            svg,
            "<text x=\"{x}\" y=\"{}\" text-anchor=\"middle\">{label}</text>",
            top + plot_h + 18.0
        );
    }
    for f in [0.0, 0.5, 1.0] {
        let y = y_of(f);
        let _ = writeln!(
            svg,
            "<line x1=\"{left}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"#ddd\"/>",
            left + plot_w
        );
        let _ =
            writeln!(svg, "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{f:.1}</text>", left - 6.0, y + 4.0);
    }
    let _ = writeln!(
        svg,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">time until the partition is owned again (log scale)</text>",
        left + plot_w / 2.0,
        h - 8.0
    );
    for (i, (label, sample)) in curves.iter().enumerate() {
        let color = colors[i % colors.len()];
        let n = sample.0.len().max(1) as f64;
        let mut points = String::new();
        for (k, d) in sample.0.iter().enumerate() {
            let _ = write!(
                points,
                "{:.1},{:.1} {:.1},{:.1} ",
                x_of(*d),
                y_of(k as f64 / n),
                x_of(*d),
                y_of((k + 1) as f64 / n)
            );
        }
        let _ = writeln!(
            svg,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{points}\"/>"
        );
        let y = top + 16.0 + 18.0 * i as f64;
        let _ = writeln!(
            svg,
            "<line x1=\"{}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"{color}\" stroke-width=\"2\"/>",
            left + 10.0,
            left + 30.0
        );
        let _ = writeln!(svg, "<text x=\"{}\" y=\"{}\">{label}</text>", left + 36.0, y + 4.0);
    }
    svg.push_str("</svg>\n");
    svg
}
