//! Hand-written SVG charts: lines over a numeric x axis, latency distributions over a percentile
//! axis, and grouped bars. No plotting library: a few hundred bytes of markup per chart.

use std::fmt::Write as _;

const WIDTH: f64 = 860.0;
const HEIGHT: f64 = 480.0;
const LEFT: f64 = 86.0;
const RIGHT: f64 = 40.0;
const TOP: f64 = 84.0;
const BOTTOM: f64 = 64.0;
const COLORS: [&str; 8] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf", "#7f7f7f"];

/// A named line or bar series.
#[derive(Debug, Clone)]
pub struct Line {
    /// Legend text.
    pub name: String,
    /// (x, y) points.
    pub points: Vec<(f64, f64)>,
    /// Dashed (e.g. for the direct baseline).
    pub dashed: bool,
}

/// Axis titles and the chart title.
#[derive(Debug, Clone)]
pub struct Labels<'a> {
    /// Chart title.
    pub title: &'a str,
    /// X axis title.
    pub x: &'a str,
    /// Y axis title.
    pub y: &'a str,
}

/// A line chart; the y axis starts at 0.
pub fn line_chart(labels: &Labels<'_>, lines: &[Line]) -> String {
    let xs = lines.iter().flat_map(|l| l.points.iter().map(|p| p.0));
    let (x_min, x_max) = bounds(xs, 0.0, 1.0);
    let y_max = lines.iter().flat_map(|l| l.points.iter().map(|p| p.1)).fold(0.0_f64, f64::max);
    let x_ticks = nice_ticks(x_min, x_max, 8);
    let y_ticks = nice_ticks(0.0, if y_max > 0.0 { y_max * 1.08 } else { 1.0 }, 6);
    let x_axis = Axis::linear(tick_bounds(&x_ticks, x_min, x_max));
    let y_axis = Axis::linear(tick_bounds(&y_ticks, 0.0, y_max));
    let mut svg = header(labels);
    grid(&mut svg, &x_axis, &y_axis, &x_ticks, &y_ticks, &fmt_tick, &fmt_tick);
    for (i, line) in lines.iter().enumerate() {
        polyline(&mut svg, line, COLORS[i % COLORS.len()], &x_axis, &y_axis);
        // Few samples: mark them, so a one-point series is still visible.
        if line.points.len() <= 30 {
            markers(&mut svg, line, COLORS[i % COLORS.len()], &x_axis, &y_axis);
        }
    }
    legend(&mut svg, lines.iter().enumerate().map(|(i, l)| (l.name.as_str(), COLORS[i % COLORS.len()], l.dashed)));
    svg.push_str("</svg>\n");
    svg
}

/// A latency distribution chart: x is the percentile on a "number of nines" scale (50, 90, 99,
/// 99.9 ...), y is the latency on a log scale. Points are (percentile, microseconds).
pub fn percentile_chart(labels: &Labels<'_>, lines: &[Line]) -> String {
    let nines = |p: f64| -(1.0 - p.clamp(0.0, 99.9999) / 100.0).log10();
    let transformed: Vec<Line> = lines
        .iter()
        .map(|l| Line {
            name: l.name.clone(),
            points: l.points.iter().filter(|p| p.0 < 100.0).map(|p| (nines(p.0), p.1.max(1.0).log10())).collect(),
            dashed: l.dashed,
        })
        .collect();
    let x_max = transformed.iter().flat_map(|l| l.points.iter().map(|p| p.0)).fold(1.0_f64, f64::max).ceil();
    let (y_lo, y_hi) = bounds(transformed.iter().flat_map(|l| l.points.iter().map(|p| p.1)), 0.0, 1.0);
    let y_lo = y_lo.floor();
    let y_hi = if y_hi.ceil() <= y_lo { y_lo + 1.0 } else { y_hi.ceil() };
    let mut x_ticks: Vec<f64> = (0..=x_max as usize).map(|n| n as f64).collect();
    x_ticks.insert(1.min(x_ticks.len()), 2f64.log10());
    let mut y_ticks = Vec::new();
    let mut decade = y_lo;
    while decade <= y_hi + 1e-9 {
        for m in [1.0_f64, 2.0, 5.0] {
            let t = decade + m.log10();
            if t <= y_hi + 1e-9 {
                y_ticks.push(t);
            }
        }
        decade += 1.0;
    }
    let x_axis = Axis::linear((0.0, x_max.max(1.0)));
    let y_axis = Axis::linear((y_lo, y_hi));
    let mut svg = header(labels);
    let x_label = |t: f64| {
        let p = 100.0 * (1.0 - 10f64.powf(-t));
        if t == 0.0 { "0".to_owned() } else { trim_number(&format!("{p:.4}")) }
    };
    let y_label = |t: f64| fmt_tick(10f64.powf(t).round());
    grid(&mut svg, &x_axis, &y_axis, &x_ticks, &y_ticks, &x_label, &y_label);
    for (i, line) in transformed.iter().enumerate() {
        polyline(&mut svg, line, COLORS[i % COLORS.len()], &x_axis, &y_axis);
        markers(&mut svg, line, COLORS[i % COLORS.len()], &x_axis, &y_axis);
    }
    legend(&mut svg, lines.iter().enumerate().map(|(i, l)| (l.name.as_str(), COLORS[i % COLORS.len()], l.dashed)));
    svg.push_str("</svg>\n");
    svg
}

/// Grouped bars: one group per category, one bar per series (the series' points are
/// (category index, value)).
pub fn bar_chart(labels: &Labels<'_>, categories: &[String], series: &[Line]) -> String {
    let y_max = series.iter().flat_map(|l| l.points.iter().map(|p| p.1)).fold(0.0_f64, f64::max);
    let y_ticks = nice_ticks(0.0, if y_max > 0.0 { y_max * 1.12 } else { 1.0 }, 6);
    let y_axis = Axis::linear(tick_bounds(&y_ticks, 0.0, y_max));
    let x_axis = Axis::linear((0.0, categories.len().max(1) as f64));
    let mut svg = header(labels);
    grid(&mut svg, &x_axis, &y_axis, &[], &y_ticks, &|_| String::new(), &fmt_tick);
    let group_width = x_axis.px(1.0) - x_axis.px(0.0);
    let bar_width = group_width * 0.8 / series.len().max(1) as f64;
    for (c, category) in categories.iter().enumerate() {
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" class="tick">{}</text>"#,
            x_axis.px(c as f64 + 0.5),
            HEIGHT - BOTTOM + 18.0,
            escape(category)
        );
        for (s, line) in series.iter().enumerate() {
            let Some(value) = line.points.iter().find(|p| p.0 as usize == c).map(|p| p.1) else { continue };
            let x = x_axis.px(c as f64) + group_width * 0.1 + bar_width * s as f64;
            let y = y_axis.py(value);
            let _ = writeln!(
                svg,
                r#"<rect x="{x:.1}" y="{y:.1}" width="{:.1}" height="{:.1}" fill="{}"/>"#,
                (bar_width - 2.0).max(1.0),
                (y_axis.py(0.0) - y).max(0.0),
                COLORS[s % COLORS.len()]
            );
            let _ = writeln!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" class="value">{}</text>"#,
                x + bar_width / 2.0 - 1.0,
                y - 4.0,
                fmt_value(value)
            );
        }
    }
    legend(&mut svg, series.iter().enumerate().map(|(i, l)| (l.name.as_str(), COLORS[i % COLORS.len()], false)));
    svg.push_str("</svg>\n");
    svg
}

struct Axis {
    lo: f64,
    hi: f64,
}

impl Axis {
    fn linear((lo, hi): (f64, f64)) -> Self {
        if hi > lo { Self { lo, hi } } else { Self { lo, hi: lo + 1.0 } }
    }

    fn px(&self, x: f64) -> f64 {
        LEFT + (x - self.lo) / (self.hi - self.lo) * (WIDTH - LEFT - RIGHT)
    }

    fn py(&self, y: f64) -> f64 {
        HEIGHT - BOTTOM - (y - self.lo) / (self.hi - self.lo) * (HEIGHT - TOP - BOTTOM)
    }
}

fn header(labels: &Labels<'_>) -> String {
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">"#
    );
    svg.push_str(
        "<style>.tick{font-size:12px;fill:#333}.axis{font-size:13px;fill:#111}.title{font-size:16px;font-weight:bold;fill:#111}.legend{font-size:12px;fill:#111}.value{font-size:11px;fill:#333}</style>\n",
    );
    let _ = writeln!(svg, r##"<rect width="100%" height="100%" fill="#ffffff"/>"##);
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="28" text-anchor="middle" class="title">{}</text>"#,
        WIDTH / 2.0,
        escape(labels.title)
    );
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" class="axis">{}</text>"#,
        LEFT + (WIDTH - LEFT - RIGHT) / 2.0,
        HEIGHT - 18.0,
        escape(labels.x)
    );
    let _ = writeln!(
        svg,
        r#"<text transform="translate(20,{:.1}) rotate(-90)" text-anchor="middle" class="axis">{}</text>"#,
        TOP + (HEIGHT - TOP - BOTTOM) / 2.0,
        escape(labels.y)
    );
    svg
}

fn grid(
    svg: &mut String,
    x_axis: &Axis,
    y_axis: &Axis,
    x_ticks: &[f64],
    y_ticks: &[f64],
    x_label: &dyn Fn(f64) -> String,
    y_label: &dyn Fn(f64) -> String,
) {
    for &t in y_ticks {
        let y = y_axis.py(t);
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e0e0e0"/>"##,
            WIDTH - RIGHT
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end" class="tick">{}</text>"#,
            LEFT - 6.0,
            y + 4.0,
            escape(&y_label(t))
        );
    }
    for &t in x_ticks {
        let x = x_axis.px(t);
        let _ = writeln!(
            svg,
            r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="#eeeeee"/>"##,
            HEIGHT - BOTTOM
        );
        let _ = writeln!(
            svg,
            r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle" class="tick">{}</text>"#,
            HEIGHT - BOTTOM + 18.0,
            escape(&x_label(t))
        );
    }
    let _ = writeln!(
        svg,
        r##"<polyline points="{LEFT},{TOP} {LEFT},{b} {r},{b}" fill="none" stroke="#333"/>"##,
        b = HEIGHT - BOTTOM,
        r = WIDTH - RIGHT
    );
}

fn polyline(svg: &mut String, line: &Line, color: &str, x_axis: &Axis, y_axis: &Axis) {
    if line.points.is_empty() {
        return;
    }
    let points: Vec<String> =
        line.points.iter().map(|p| format!("{:.1},{:.1}", x_axis.px(p.0), y_axis.py(p.1))).collect();
    let dash = if line.dashed { r#" stroke-dasharray="7,4""# } else { "" };
    let _ = writeln!(
        svg,
        r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"{dash}/>"#,
        points.join(" ")
    );
}

/// A dot on every point of `line`.
fn markers(svg: &mut String, line: &Line, color: &str, x_axis: &Axis, y_axis: &Axis) {
    for p in &line.points {
        let _ =
            writeln!(svg, r#"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="{color}"/>"#, x_axis.px(p.0), y_axis.py(p.1));
    }
}

/// One row (or two) of legend entries between the title and the plot, so it never hides data.
fn legend<'a>(svg: &mut String, entries: impl Iterator<Item = (&'a str, &'a str, bool)>) {
    let mut x = LEFT;
    let mut y = 50.0;
    for (name, color, dashed) in entries {
        let width = name.chars().count() as f64 * 7.0 + 48.0;
        if x + width > WIDTH - RIGHT && x > LEFT {
            x = LEFT;
            y += 18.0;
        }
        let dash = if dashed { r#" stroke-dasharray="7,4""# } else { "" };
        let _ = writeln!(
            svg,
            r#"<line x1="{x:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{color}" stroke-width="3"{dash}/>"#,
            y - 4.0,
            x + 24.0,
            y - 4.0
        );
        let _ = writeln!(svg, r#"<text x="{:.1}" y="{y:.1}" class="legend">{}</text>"#, x + 30.0, escape(name));
        x += width;
    }
}

fn bounds(values: impl Iterator<Item = f64>, default_lo: f64, default_hi: f64) -> (f64, f64) {
    let (lo, hi) =
        values.filter(|v| v.is_finite()).fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if lo.is_finite() && hi.is_finite() { (lo, hi) } else { (default_lo, default_hi) }
}

fn tick_bounds(ticks: &[f64], lo: f64, hi: f64) -> (f64, f64) {
    match (ticks.first(), ticks.last()) {
        (Some(&a), Some(&b)) if b > a => (a.min(lo), b.max(hi)),
        _ => (lo, hi),
    }
}

/// Round tick values (1, 2 or 5 times a power of ten apart) covering [lo, hi].
pub fn nice_ticks(lo: f64, hi: f64, target: usize) -> Vec<f64> {
    let span = (hi - lo).abs().max(1e-9);
    let raw = span / target.max(1) as f64;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * magnitude).find(|s| *s >= raw).unwrap_or(10.0 * magnitude);
    let start = (lo / step).floor() * step;
    let mut ticks = Vec::new();
    let mut t = start;
    while t <= hi + step * 0.999 && ticks.len() < 100 {
        ticks.push(if t.abs() < step * 1e-9 { 0.0 } else { t });
        t += step;
    }
    ticks
}

fn fmt_value(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        trim_number(&format!("{v:.2}"))
    }
}

fn fmt_tick(v: f64) -> String {
    if v.abs() >= 1_000_000.0 {
        trim_number(&format!("{:.2}", v / 1_000_000.0)) + "M"
    } else if v.abs() >= 10_000.0 {
        trim_number(&format!("{:.1}", v / 1000.0)) + "k"
    } else if v.fract().abs() < 1e-9 {
        format!("{v:.0}")
    } else {
        trim_number(&format!("{v:.2}"))
    }
}

fn trim_number(s: &str) -> String {
    if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.').to_owned() } else { s.to_owned() }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// Writes `svg` to `dir/name`, creating the directory.
pub fn write(dir: &std::path::Path, name: &str, svg: &str) -> anyhow::Result<std::path::PathBuf> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join(name);
    std::fs::write(&path, svg)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round() {
        assert_eq!(nice_ticks(0.0, 10.0, 5), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        assert_eq!(nice_ticks(0.0, 950.0, 5), vec![0.0, 200.0, 400.0, 600.0, 800.0, 1000.0]);
    }

    #[test]
    fn charts_are_closed_svg_documents() {
        let labels = Labels { title: "t <&>", x: "s", y: "MiB/s" };
        let lines = vec![
            Line { name: "direct".into(), points: vec![(1.0, 10.0), (2.0, 12.0)], dashed: true },
            Line { name: "tunnel".into(), points: vec![(1.0, 4.0), (2.0, 5.0)], dashed: false },
        ];
        for svg in [
            line_chart(&labels, &lines),
            percentile_chart(
                &labels,
                &[Line { name: "x".into(), points: vec![(50.0, 30.0), (99.9, 400.0)], dashed: false }],
            ),
            bar_chart(&labels, &["a".into(), "b".into()], &lines),
        ] {
            assert!(svg.starts_with("<svg"));
            assert!(svg.trim_end().ends_with("</svg>"));
            assert!(svg.contains("t &lt;&amp;&gt;"));
        }
    }
}
