//! PNG line charts (plotters, bitmap backend), for evaluation and
//! load-test results alike.
//!
//! Text needs a TrueType font; plotters' ab_glyph backend takes one we
//! register from the system (Debian's fonts-dejavu-core), so no font
//! library is linked. Without the font drawing fails with a message that
//! says what to install; callers skip the chart and keep their other outputs.

use std::path::Path;

use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

use crate::error::{EvalError, Result};

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

fn ensure_font() -> std::result::Result<(), String> {
    static REGISTERED: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            let bytes = std::fs::read(FONT).map_err(|e| format!("{FONT}: {e} (install fonts-dejavu-core)"))?;
            register_font("sans-serif", FontStyle::Normal, Box::leak(bytes.into_boxed_slice()))
                .map_err(|_| format!("{FONT}: not a usable TrueType font"))
        })
        .clone()
}

/// The canvas and x axis of a chart; [`line_charts`] uses `k` on x and a
/// 600×450 panel each.
#[derive(Debug, Clone)]
pub struct Layout {
    pub x_label: String,
    /// Whole image, pixels.
    pub width: u32,
    pub height: u32,
    /// Line colours by series index (cycled); empty for the default set.
    pub palette: Vec<RGBColor>,
    /// Legend in the upper left (where rising curves leave room) rather
    /// than plotters' middle right.
    pub legend_upper_left: bool,
    /// Minor grid lines: finer reading, but a PNG several times larger.
    pub light_grid: bool,
}

/// Draws the panels side by side, x = k, into a PNG at `path`.
pub fn line_charts(path: &Path, panels: &[Panel]) -> Result<()> {
    let layout = Layout {
        x_label: "k (facts retrieved)".into(),
        width: 600 * panels.len().max(1) as u32,
        height: 450,
        palette: Vec::new(),
        legend_upper_left: false,
        light_grid: true,
    };
    line_charts_with(path, panels, &layout)
}

/// Draws the panels side by side into a PNG at `path`, as `layout` says.
pub fn line_charts_with(path: &Path, panels: &[Panel], layout: &Layout) -> Result<()> {
    draw(path, panels, layout).map_err(|reason| EvalError::Plot { path: path.to_path_buf(), reason })
}

fn draw(path: &Path, panels: &[Panel], layout: &Layout) -> std::result::Result<(), String> {
    ensure_font()?;
    let s = |e: &dyn std::fmt::Display| e.to_string();
    let root = BitMapBackend::new(path, (layout.width, layout.height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| s(&e))?;
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
        let default = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];
        let colors: &[RGBColor] = if layout.palette.is_empty() { &default } else { &layout.palette };
        macro_rules! draw {
            ($chart:expr) => {{
                let mut c = $chart;
                let mut mesh = c.configure_mesh();
                mesh.x_desc(&layout.x_label).y_desc(&panel.y_label);
                if !layout.light_grid {
                    mesh.light_line_style(TRANSPARENT);
                }
                mesh.draw().map_err(|e| s(&e))?;
                for (i, line) in panel.series.iter().enumerate() {
                    let color = colors[i % colors.len()];
                    c.draw_series(LineSeries::new(line.points.clone(), color.stroke_width(2)))
                        .map_err(|e| s(&e))?
                        .label(&line.label)
                        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
                    c.draw_series(line.points.iter().map(|&p| Circle::new(p, 3, color.filled()))).map_err(|e| s(&e))?;
                }
                c.configure_series_labels()
                    .position(if layout.legend_upper_left {
                        SeriesLabelPosition::UpperLeft
                    } else {
                        SeriesLabelPosition::MiddleRight
                    })
                    .background_style(WHITE.mix(0.8))
                    .border_style(BLACK)
                    .draw()
                    .map_err(|e| s(&e))?;
            }};
        }
        let xr = x0..x1.max(x0 + 1.0);
        if panel.log_y {
            draw!(chart.build_cartesian_2d(xr, (y0.max(1e-3) * 0.8..y1 * 1.25).log_scale()).map_err(|e| s(&e))?);
        } else {
            draw!(chart.build_cartesian_2d(xr, 0.0..(y1 * 1.15).max(1e-6)).map_err(|e| s(&e))?);
        }
    }
    root.present().map_err(|e| format!("writing {}: {e}", path.display()))
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
