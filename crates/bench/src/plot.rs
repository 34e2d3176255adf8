//! Line charts as standalone SVG files (no dependencies; any browser shows them): loss vs DRAM
//! fraction for `sim` and `plan`, ratios vs DRAM budget for `bench`. Entry point: [`Chart`].

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};

/// One named line.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// A chart: x and y axes with labels, lines, a legend.
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    /// Axis ranges; `None` fits the data (y from 0).
    pub x_range: Option<(f64, f64)>,
    pub y_range: Option<(f64, f64)>,
    /// Formats tick values (e.g. as percentages).
    pub x_percent: bool,
    pub y_percent: bool,
    pub series: Vec<Series>,
}

const COLOURS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

const W: f64 = 760.0;
const H: f64 = 460.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 170.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 55.0;

fn nice_step(span: f64) -> f64 {
    let raw = span / 6.0;
    let mag = 10f64.powf(raw.log10().floor());
    for m in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if m * mag >= raw {
            return m * mag;
        }
    }
    10.0 * mag
}

fn tick(v: f64, percent: bool) -> String {
    if percent {
        let p = v * 100.0;
        if (p - p.round()).abs() < 1e-9 {
            format!("{p:.0}%")
        } else {
            format!("{p:.1}%")
        }
    } else if v.abs() >= 100.0 || (v - v.round()).abs() < 1e-9 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

/// `s` cut to `n` characters (with an ellipsis) so that it fits the chart's width.
fn clip(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        s.chars().take(n - 1).chain(std::iter::once('…')).collect()
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

impl Chart {
    /// The SVG document.
    pub fn svg(&self) -> String {
        let pts = self.series.iter().flat_map(|s| s.points.iter());
        let finite: Vec<(f64, f64)> = pts
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .copied()
            .collect();
        let (x0, x1) = self.x_range.unwrap_or_else(|| {
            let lo = finite.iter().map(|p| p.0).fold(f64::INFINITY, f64::min);
            let hi = finite.iter().map(|p| p.0).fold(f64::NEG_INFINITY, f64::max);
            if lo.is_finite() && hi > lo {
                (lo, hi)
            } else {
                (0.0, 1.0)
            }
        });
        let (y0, y1) = self.y_range.unwrap_or_else(|| {
            let hi = finite.iter().map(|p| p.1).fold(0.0, f64::max);
            (0.0, if hi > 0.0 { hi * 1.05 } else { 1.0 })
        });
        let pw = W - LEFT - RIGHT;
        let ph = H - TOP - BOTTOM;
        let sx = |x: f64| LEFT + (x - x0) / (x1 - x0) * pw;
        let sy = |y: f64| TOP + ph - (y.clamp(y0, y1) - y0) / (y1 - y0) * ph;
        let mut o = String::new();
        let _ = writeln!(
            o,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(o, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
        let _ = writeln!(
            o,
            r#"<text x="10" y="22" font-size="14">{}</text>"#,
            escape(&clip(&self.title, 100))
        );
        // Grid and ticks.
        let step = nice_step(x1 - x0);
        let mut v = (x0 / step).ceil() * step;
        while v <= x1 + step * 1e-6 {
            let x = sx(v);
            let _ = writeln!(
                o,
                r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="#e0e0e0"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
                TOP + ph,
                TOP + ph + 16.0,
                tick(v, self.x_percent)
            );
            v += step;
        }
        let step = nice_step(y1 - y0);
        let mut v = (y0 / step).ceil() * step;
        while v <= y1 + step * 1e-6 {
            let y = sy(v);
            let _ = writeln!(
                o,
                r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e0e0e0"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                LEFT + pw,
                LEFT - 6.0,
                y + 4.0,
                tick(v, self.y_percent)
            );
            v += step;
        }
        let _ = writeln!(
            o,
            r#"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#
        );
        let _ = writeln!(
            o,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            LEFT + pw / 2.0,
            H - 12.0,
            escape(&self.x_label)
        );
        let _ = writeln!(
            o,
            r#"<text transform="translate(16,{:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
            TOP + ph / 2.0,
            escape(&self.y_label)
        );
        for (i, s) in self.series.iter().enumerate() {
            let c = COLOURS[i % COLOURS.len()];
            let path: Vec<String> = s
                .points
                .iter()
                .filter(|(x, y)| x.is_finite() && y.is_finite())
                .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
                .collect();
            let _ = writeln!(
                o,
                r#"<polyline points="{}" fill="none" stroke="{c}" stroke-width="2"/>"#,
                path.join(" ")
            );
            for p in &path {
                let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
                let _ = writeln!(o, r#"<circle cx="{x}" cy="{y}" r="3" fill="{c}"/>"#);
            }
            let ly = TOP + 10.0 + i as f64 * 20.0;
            let lx = LEFT + pw + 14.0;
            let _ = writeln!(
                o,
                r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{c}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
                lx + 22.0,
                lx + 28.0,
                ly + 4.0,
                escape(&s.name)
            );
        }
        o.push_str("</svg>\n");
        o
    }

    /// Loss (0–100%) against DRAM as a fraction of memory (0–100%).
    pub fn loss_vs_dram(title: String, x_label: &str, series: Vec<Series>) -> Chart {
        Chart {
            title,
            x_label: x_label.into(),
            y_label: "throughput loss vs all-DRAM".into(),
            x_range: Some((0.0, 1.0)),
            y_range: Some((0.0, 1.0)),
            x_percent: true,
            y_percent: true,
            series,
        }
    }

    /// A ratio to all-DRAM (from 0, fitted) against the DRAM budget (0–100%).
    pub fn ratio_vs_budget(
        title: String,
        x_label: &str,
        y_label: &str,
        series: Vec<Series>,
    ) -> Chart {
        Chart {
            title,
            x_label: x_label.into(),
            y_label: y_label.into(),
            x_range: Some((0.0, 1.0)),
            y_range: None,
            x_percent: true,
            y_percent: false,
            series,
        }
    }

    /// Writes the chart to `path` and says where.
    pub fn write(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.svg())
            .with_context(|| format!("cannot write the plot {}", path.display()))?;
        eprintln!("plot: {}", path.display());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn svg_has_one_line_per_series_and_scales_points_into_the_plot_area() {
        let c = Chart {
            title: "loss <vs> DRAM".into(),
            x_label: "DRAM".into(),
            y_label: "loss".into(),
            x_range: Some((0.0, 1.0)),
            y_range: None,
            x_percent: true,
            y_percent: true,
            series: vec![
                Series {
                    name: "lru".into(),
                    points: vec![(0.25, 0.5), (0.5, 0.1), (1.0, 0.0)],
                },
                Series {
                    name: "opt".into(),
                    points: vec![(0.25, 0.2), (0.5, f64::NAN)],
                },
            ],
        };
        let s = c.svg();
        assert_eq!(s.matches("<polyline").count(), 2);
        assert!(s.contains("loss &lt;vs&gt; DRAM"));
        assert!(s.contains(">50%<"), "x ticks as percentages");
        // (1.0, 0.0) lands on the plot's right edge and bottom.
        assert!(s.contains(&format!("{:.1},{:.1}", W - RIGHT, H - BOTTOM)));
        // The NaN point is left out, not drawn at a bogus place.
        assert_eq!(s.matches("<circle").count(), 4);
    }
}
