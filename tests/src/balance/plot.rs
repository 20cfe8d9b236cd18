//! PNG latency CDFs, one per scenario, one line per row.
//!
//! The y axis is in "nines" (-log10(1 - q)), so the tail a balancer is
//! judged by (P99, P99.9) gets as much room as the median; the x axis is
//! logarithmic latency.

use std::path::Path;

use anyhow::{Context, Result, anyhow};
use plotters::{
    prelude::*,
    style::{FontStyle, register_font},
};

/// Font read at run time (Debian's fonts-dejavu-core).
pub const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";
const SIZE: (u32, u32) = (1100, 700);
/// Highest quantile drawn: 99.99 % (4 nines).
const MAX_NINES: f64 = 4.0;

/// One line: a label and `(latency ms, quantile)` points, quantile ascending.
pub struct Series<'a> {
    pub label: &'a str,
    pub points: &'a [(f64, f64)],
}

fn register() -> Result<()> {
    let bytes = std::fs::read(FONT).with_context(|| format!("reading the font {FONT}"))?;
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| anyhow!("{FONT} is not a usable font"))
}

fn nines(q: f64) -> f64 {
    -(1.0 - q).max(1e-6).log10()
}

pub fn latency_cdf(path: &Path, title: &str, series: &[Series]) -> Result<()> {
    static REGISTERED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    REGISTERED
        .get_or_init(|| register().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(|e| anyhow!(e))?;
    let all = series.iter().flat_map(|s| s.points.iter());
    let (lo, hi) = all.fold((f64::MAX, 0f64), |(lo, hi), &(ms, _)| {
        (lo.min(ms), hi.max(ms))
    });
    if hi <= 0.0 {
        return Ok(());
    }
    let (lo, hi) = ((lo.max(0.05)) * 0.8, hi * 1.25);
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 26))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d((lo..hi).log_scale(), 0.0..MAX_NINES)
        .map_err(|e| anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc("latency (ms, log scale)")
        .y_desc("percentile")
        .y_labels(5)
        .y_label_formatter(&|y| match y.round() as i32 {
            0 => "0%".into(),
            1 => "90%".into(),
            2 => "99%".into(),
            3 => "99.9%".into(),
            4 => "99.99%".into(),
            _ => String::new(),
        })
        .x_label_formatter(&|x| format!("{x:.1}"))
        .label_style(("sans-serif", 16))
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    for (i, s) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let style =
            ShapeStyle::from(color).stroke_width(if s.label.starts_with("lb ") { 3 } else { 2 });
        chart
            .draw_series(LineSeries::new(
                s.points
                    .iter()
                    .map(|&(ms, q)| (ms.max(lo), nines(q).min(MAX_NINES))),
                style,
            ))
            .map_err(|e| anyhow!("{e}"))?
            .label(s.label)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], style));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .draw()
        .map_err(|e| anyhow!("{e}"))?;
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}
