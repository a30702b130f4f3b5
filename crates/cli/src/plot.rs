//! PNG line charts for evaluation results (plotters, bitmap backend).
//!
//! Text needs a TrueType font; plotters' ab_glyph backend takes one we
//! register from the system (Debian's fonts-dejavu-core), so no font
//! library is linked. Without the font the chart is skipped with a message.

use std::path::Path;

use anyhow::{Context, Result};
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

/// Where Debian's fonts-dejavu-core puts its sans-serif face.
const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// One line: label and (x, y) points.
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// One chart panel.
pub struct Panel {
    pub title: String,
    pub y_label: String,
    pub log_y: bool,
    pub series: Vec<Series>,
}

fn ensure_font() -> Result<()> {
    static REGISTERED: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            let bytes = std::fs::read(FONT).map_err(|e| format!("{FONT}: {e} (install fonts-dejavu-core)"))?;
            register_font("sans-serif", FontStyle::Normal, Box::leak(bytes.into_boxed_slice()))
                .map_err(|_| format!("{FONT}: not a usable TrueType font"))
        })
        .clone()
        .map_err(anyhow::Error::msg)
}

/// Draws the panels side by side, x = k, into a PNG at `path`.
pub fn line_charts(path: &Path, panels: &[Panel]) -> Result<()> {
    ensure_font()?;
    let root = BitMapBackend::new(path, (600 * panels.len() as u32, 450)).into_drawing_area();
    root.fill(&WHITE)?;
    let areas = root.split_evenly((1, panels.len()));
    for (panel, area) in panels.iter().zip(areas) {
        let xs = panel.series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
        let ys = panel.series.iter().flat_map(|s| s.points.iter().map(|p| p.1));
        let (x0, x1) = xs.fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
        let (y0, y1) = ys.fold((f64::MAX, f64::MIN), |(a, b), y| (a.min(y), b.max(y)));
        if x0 > x1 {
            continue;
        }
        let mut chart = ChartBuilder::on(&area);
        chart.caption(&panel.title, ("sans-serif", 20)).margin(12).x_label_area_size(40).y_label_area_size(60);
        let colors = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];
        macro_rules! draw {
            ($chart:expr) => {{
                let mut c = $chart;
                c.configure_mesh().x_desc("k (facts retrieved)").y_desc(&panel.y_label).draw()?;
                for (i, s) in panel.series.iter().enumerate() {
                    let color = colors[i % colors.len()];
                    c.draw_series(LineSeries::new(s.points.clone(), color.stroke_width(2)))?
                        .label(&s.label)
                        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
                    c.draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
                }
                c.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
            }};
        }
        let xr = x0..x1.max(x0 + 1.0);
        if panel.log_y {
            draw!(chart.build_cartesian_2d(xr, (y0.max(1e-3) * 0.8..y1 * 1.25).log_scale())?);
        } else {
            draw!(chart.build_cartesian_2d(xr, 0.0..(y1 * 1.15).max(1e-6))?);
        }
    }
    root.present().with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_a_png() {
        let dir = std::env::temp_dir().join(format!("inferscale-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("chart.png");
        let s = |label: &str, f: f64| Series {
            label: label.into(),
            points: vec![(5.0, f), (20.0, 2.0 * f), (50.0, 3.0 * f)],
        };
        let panels = [
            Panel {
                title: "F1".into(),
                y_label: "F1".into(),
                log_y: false,
                series: vec![s("kv", 0.1), s("prompt", 0.12)],
            },
            Panel {
                title: "TTFT".into(),
                y_label: "ms".into(),
                log_y: true,
                series: vec![s("kv", 40.0), s("prompt", 200.0)],
            },
        ];
        line_charts(&path, &panels).expect("chart");
        let bytes = std::fs::read(&path).expect("png written");
        assert_eq!(&bytes[1..4], b"PNG");
        assert!(bytes.len() > 5_000, "an empty canvas would compress to almost nothing");
        std::fs::remove_dir_all(&dir).ok();
    }
}
