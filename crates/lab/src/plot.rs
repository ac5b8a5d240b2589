//! The timeline plot: successes and failures per 100 ms of nominal time, with the
//! rollout's events marked, drawn with plotters as SVG and PNG.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::prelude::*;

use crate::LabError;
use crate::scenario::RunResult;
use crate::timeline::EventKind;

const BUCKET_S: f64 = 0.1;

/// (ok, failed) per 100 ms nominal bucket, from the load's start.
pub fn buckets(r: &RunResult) -> Vec<(u32, u32)> {
    let span_s = (r.load_end_ms - r.load_start_ms) / 1000.0 / r.time_scale;
    let n = ((span_s / BUCKET_S).ceil() as usize).clamp(1, 1_000_000);
    let mut v = vec![(0u32, 0u32); n];
    for x in &r.records {
        let t = (x.start_ms - r.load_start_ms) / 1000.0 / r.time_scale;
        let i = ((t / BUCKET_S).floor().max(0.0) as usize).min(n - 1);
        if x.outcome.is_ok() {
            v[i].0 += 1;
        } else {
            v[i].1 += 1;
        }
    }
    v
}

static FONT_OK: OnceLock<bool> = OnceLock::new();

/// The PNG backend draws text with ab_glyph and needs a font file; use a common
/// system one. Without it the PNG is still drawn, without text.
fn register_font() -> bool {
    *FONT_OK.get_or_init(|| {
        for p in [
            "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/dejavu/DejaVuSans.ttf",
            "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
            "/usr/share/fonts/TTF/DejaVuSans.ttf",
        ] {
            if let Ok(bytes) = std::fs::read(p) {
                // plotters keeps a 'static reference to the font; loaded once per process.
                let leaked: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, leaked).is_ok() {
                    return true;
                }
            }
        }
        false
    })
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    r: &RunResult,
    text: bool,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let e = |x: plotters::drawing::DrawingAreaErrorKind<DB::ErrorType>| x.to_string();
    root.fill(&WHITE).map_err(e)?;
    let b = buckets(r);
    let t0 = r.load_start_ms;
    let span = b.len() as f64 * BUCKET_S;
    let ymax = b.iter().map(|(o, _)| *o).max().unwrap_or(1).max(1) as f64 * 1.15;
    let ymin = -(b.iter().map(|(_, f)| *f).max().unwrap_or(0).max(1) as f64) * 1.15;
    let caption = format!(
        "{} run {}: requests per 100 ms of nominal time, {} failed of {}",
        r.behaviour.as_str(),
        r.run + 1,
        r.records.iter().filter(|x| !x.outcome.is_ok()).count(),
        r.records.len()
    );
    let mut builder = ChartBuilder::on(&root);
    builder.margin(15);
    if text {
        builder
            .caption(caption, ("sans-serif", 20))
            .x_label_area_size(40)
            .y_label_area_size(50);
    }
    let mut chart = builder
        .build_cartesian_2d(0f64..span, ymin..ymax)
        .map_err(e)?;
    if text {
        chart
            .configure_mesh()
            .x_desc("nominal seconds since load started")
            .y_desc("requests: ok above, failed below")
            .disable_x_mesh()
            .draw()
            .map_err(e)?;
    }
    let nominal = |ms: f64| (ms - t0) / 1000.0 / r.time_scale;
    // Event markers first, under the data.
    for ev in &r.events {
        let color = match ev.kind {
            EventKind::PodTerminating => RGBColor(230, 140, 0),
            EventKind::PodSigterm => RGBColor(200, 60, 160),
            EventKind::PodReady => RGBColor(40, 90, 220),
            EventKind::LbPool => RGBColor(120, 60, 200),
            EventKind::RolloutStarted | EventKind::RolloutDone => RGBColor(0, 0, 0),
            _ => continue,
        };
        let x = nominal(ev.t_ms);
        if x < 0.0 || x > span {
            continue;
        }
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(x, ymin), (x, ymax)],
                color.stroke_width(1),
            )))
            .map_err(e)?;
    }
    // Successes as green bars above the axis, failures as red bars below it.
    let oks = b
        .iter()
        .enumerate()
        .filter(|(_, (o, _))| *o > 0)
        .map(|(i, (o, _))| {
            let x = i as f64 * BUCKET_S;
            Rectangle::new(
                [(x, 0.0), (x + BUCKET_S, *o as f64)],
                GREEN.mix(0.8).filled(),
            )
        });
    let s = chart.draw_series(oks).map_err(e)?;
    if text {
        s.label("ok")
            .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 20, y + 5)], GREEN.filled()));
    }
    let fails = b
        .iter()
        .enumerate()
        .filter(|(_, (_, f))| *f > 0)
        .map(|(i, (_, f))| {
            let x = i as f64 * BUCKET_S;
            Rectangle::new([(x, -(*f as f64)), (x + BUCKET_S, 0.0)], RED.filled())
        });
    let s = chart.draw_series(fails).map_err(e)?;
    if text {
        s.label("failed")
            .legend(|(x, y)| Rectangle::new([(x, y - 5), (x + 20, y + 5)], RED.filled()));
        let markers: [(&str, RGBColor); 5] = [
            ("pod terminating", RGBColor(230, 140, 0)),
            ("SIGTERM", RGBColor(200, 60, 160)),
            ("pod ready", RGBColor(40, 90, 220)),
            ("LB pool change", RGBColor(120, 60, 200)),
            ("rollout start/end", RGBColor(0, 0, 0)),
        ];
        for (name, c) in markers {
            chart
                .draw_series(std::iter::once(PathElement::new(vec![(-1.0, -1.0)], c)))
                .map_err(e)?
                .label(name)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(1))
                });
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::LowerRight)
            .draw()
            .map_err(e)?;
    }
    root.present().map_err(e)?;
    Ok(())
}

/// Write `<stem>.svg` and `<stem>.png`; returns the paths written.
pub fn write_plots(r: &RunResult, stem: &Path) -> Result<Vec<PathBuf>, LabError> {
    // Not with_extension: the stem contains dots ("pre-1.26").
    let svg = PathBuf::from(format!("{}.svg", stem.display()));
    let png = PathBuf::from(format!("{}.png", stem.display()));
    let err = |p: &Path, m: String| LabError::Invalid(format!("plot {}: {m}", p.display()));
    // Both backends measure text with the registered font.
    let text = register_font();
    draw(
        SVGBackend::new(&svg, (1200, 500)).into_drawing_area(),
        r,
        text,
    )
    .map_err(|m| err(&svg, m))?;
    draw(
        BitMapBackend::new(&png, (1200, 500)).into_drawing_area(),
        r,
        text,
    )
    .map_err(|m| err(&png, m))?;
    Ok(vec![svg, png])
}
