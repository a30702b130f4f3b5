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
#[derive(Debug, Clone)]
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
    /// Line colours by series index (cycled); empty for [`PALETTE`].
    pub palette: Vec<RGBColor>,
    /// Minor grid lines: finer reading, but a PNG several times larger.
    pub light_grid: bool,
}

/// Okabe and Ito's colour-blind-safe palette (blue, vermillion, bluish
/// green, reddish purple, orange, sky blue, black): no red/green pair.
pub const PALETTE: [RGBColor; 7] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(0, 0, 0),
];

/// Height in pixels of one legend row (and the legend's padding).
const LEGEND_ROW: f64 = 20.0;

/// Draws the panels side by side, x = k, into a PNG at `path`.
pub fn line_charts(path: &Path, panels: &[Panel]) -> Result<()> {
    let layout = Layout {
        x_label: "k (facts retrieved)".into(),
        width: 600 * panels.len().max(1) as u32,
        height: 450,
        palette: Vec::new(),
        light_grid: true,
    };
    line_charts_with(path, panels, &layout)
}

/// Draws the panels side by side into a PNG at `path`, as `layout` says.
pub fn line_charts_with(path: &Path, panels: &[Panel], layout: &Layout) -> Result<()> {
    let fail = |reason| EvalError::Plot { path: path.to_path_buf(), reason };
    ensure_font().map_err(fail)?;
    let root = BitMapBackend::new(path, (layout.width, layout.height)).into_drawing_area();
    draw(&root, panels, layout).map_err(fail)?;
    root.present().map_err(|e| fail(format!("writing {}: {e}", path.display())))
}

/// Draws the panels into an RGB buffer (`width × height × 3` bytes), for
/// checking what a chart shows without decoding a PNG.
pub fn render(panels: &[Panel], layout: &Layout) -> std::result::Result<Vec<u8>, String> {
    ensure_font()?;
    let mut buf = vec![0u8; layout.width as usize * layout.height as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (layout.width, layout.height)).into_drawing_area();
        draw(&root, panels, layout)?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(buf)
}

/// `x` as an axis or bar label: whole numbers without a decimal point
/// (k = 5, not 5.0), others to three significant digits (0.25, 0.0031).
fn tick(x: &f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e15 {
        return format!("{}", *x as i64);
    }
    let digits = (2 - x.abs().log10().floor() as i32).clamp(0, 12) as usize;
    let s = format!("{x:.digits$}");
    match s.contains('.') {
        true => s.trim_end_matches('0').trim_end_matches('.').to_string(),
        false => s,
    }
}

/// Ticks of a log axis over `lo..hi`: 1, 2 and 5 of every decade, and, when
/// that leaves fewer than three inside (a range within one decade), every
/// whole mantissa 1–9 — so that a log axis always has readable marks.
fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let decades = (lo.max(f64::MIN_POSITIVE).log10().floor() as i32)..=(hi.log10().ceil() as i32);
    let within = |mantissas: &[f64]| -> Vec<f64> {
        decades
            .clone()
            .flat_map(|d| mantissas.iter().map(move |m| m * 10f64.powi(d)))
            .filter(|v| (lo..=hi).contains(v))
            .collect()
    };
    let ticks = within(&[1.0, 2.0, 5.0]);
    if ticks.len() >= 3 { ticks } else { within(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]) }
}

/// An x tick's label: none at a fraction when every x of the data is a
/// whole number (user counts, k), so such an axis never reads 1.10, 1.20.
fn x_label(whole: bool, x: f64) -> String {
    if whole && x.fract() != 0.0 { String::new() } else { tick(&x) }
}

/// The y range: the data's, with room above it for the legend's rows so
/// that the legend never covers a line.
fn y_range(y0: f64, y1: f64, log: bool, legend_rows: usize, plot_height: f64) -> (f64, f64) {
    let room = ((legend_rows as f64 + 1.0) * LEGEND_ROW / plot_height.max(1.0)).min(0.6);
    if log {
        let (lo, hi) = ((y0.max(1e-3) * 0.8).ln(), (y1.max(y0.max(1e-3)) * 1.1).ln());
        (lo.exp(), (lo + (hi - lo).max(0.1) / (1.0 - room)).exp())
    } else {
        let hi = (y1 * 1.05).max(1e-6);
        (0.0, hi / (1.0 - room))
    }
}

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    panels: &[Panel],
    layout: &Layout,
) -> std::result::Result<(), String> {
    let s = |e: &dyn std::fmt::Display| e.to_string();
    root.fill(&WHITE).map_err(|e| s(&e))?;
    let colors: &[RGBColor] = if layout.palette.is_empty() { &PALETTE } else { &layout.palette };
    let areas = root.split_evenly((1, panels.len().max(1)));
    for (panel, area) in panels.iter().zip(areas) {
        let xs: Vec<f64> = panel.series.iter().flat_map(|s| s.points.iter().map(|p| p.0)).collect();
        let ys = panel.series.iter().flat_map(|s| s.points.iter().map(|p| p.1));
        let (x0, x1) = xs.iter().fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
        let (y0, y1) = ys.fold((f64::MAX, f64::MIN), |(a, b), y| (a.min(y), b.max(y)));
        if x0 > x1 {
            continue;
        }
        // One x for every point (a run at one k): a line has nowhere to
        // go, so each series is a bar at its own place on the axis, named
        // there (no legend).
        let single_x = x0 == x1;
        let plot_height = f64::from(area.dim_in_pixel().1) - 100.0;
        let legend_rows = if single_x { 0 } else { panel.series.len() };
        let (ylo, yhi) = y_range(y0, y1, panel.log_y, legend_rows, plot_height);
        let y_desc = if panel.log_y { format!("{} (log scale)", panel.y_label) } else { panel.y_label.clone() };
        let mut chart = ChartBuilder::on(&area);
        chart.caption(&panel.title, ("sans-serif", 20)).margin(12).x_label_area_size(40).y_label_area_size(60);
        let labels: Vec<String> = panel.series.iter().map(|s| s.label.clone()).collect();
        let bar_tick = move |i: &f64| {
            let j = i.round();
            if (i - j).abs() < 1e-6 && j >= 0.0 {
                labels.get(j as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        };
        let whole = xs.iter().all(|x| x.fract() == 0.0);
        let x_tick = move |x: &f64| x_label(whole, *x);
        let x_desc = if single_x { format!("{} = {}", layout.x_label, tick(&x0)) } else { layout.x_label.clone() };
        macro_rules! draw {
            ($chart:expr) => {{
                let mut c = $chart;
                let mut mesh = c.configure_mesh();
                mesh.x_desc(&x_desc).y_desc(&y_desc).y_label_formatter(&tick);
                if single_x {
                    mesh.x_labels(panel.series.len()).x_label_formatter(&bar_tick).disable_x_mesh();
                } else {
                    mesh.x_label_formatter(&x_tick);
                }
                if !layout.light_grid {
                    mesh.light_line_style(TRANSPARENT);
                }
                mesh.draw().map_err(|e| s(&e))?;
                for (i, line) in panel.series.iter().enumerate() {
                    let color = colors[i % colors.len()];
                    let legend =
                        move |(x, y): (i32, i32)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(3));
                    if single_x {
                        let (x, base) = (i as f64, ylo);
                        let bars = line
                            .points
                            .iter()
                            .map(|&(_, y)| Rectangle::new([(x - 0.3, base), (x + 0.3, y)], color.filled()));
                        c.draw_series(bars).map_err(|e| s(&e))?.label(&line.label).legend(legend);
                        // Each bar's value above it: a bar chart is read
                        // for its numbers.
                        let values = line.points.iter().map(|&(_, y)| {
                            Text::new(tick(&y), (x - 0.12, y), ("sans-serif", 14).into_font().color(&BLACK))
                        });
                        c.draw_series(values).map_err(|e| s(&e))?;
                        continue;
                    }
                    // Earlier series draw wider lines and larger markers, so
                    // that a later one drawn over it leaves it showing.
                    let under = (panel.series.len() - 1 - i).min(3) as u32;
                    c.draw_series(LineSeries::new(line.points.clone(), color.stroke_width(2 + under)))
                        .map_err(|e| s(&e))?
                        .label(&line.label)
                        .legend(legend);
                    // A marker shape per series, so that a line drawn over
                    // another still shows both.
                    let style = if (i / 3) % 2 == 0 { color.filled() } else { color.stroke_width(2) };
                    let size = 4 + 2 * under as i32;
                    let pts = line.points.iter().copied();
                    match i % 3 {
                        0 => c.draw_series(pts.map(|p| Circle::new(p, size, style))).map(|_| ()),
                        1 => c.draw_series(pts.map(|p| TriangleMarker::new(p, size + 2, style))).map(|_| ()),
                        _ => c.draw_series(pts.map(|p| Cross::new(p, size + 1, color.stroke_width(2)))).map(|_| ()),
                    }
                    .map_err(|e| s(&e))?;
                }
                if single_x {
                    continue;
                }
                c.configure_series_labels()
                    .position(SeriesLabelPosition::UpperLeft)
                    .background_style(WHITE.mix(0.85))
                    .border_style(BLACK)
                    .draw()
                    .map_err(|e| s(&e))?;
            }};
        }
        let xr = if single_x { -0.5..(panel.series.len() as f64 - 0.5) } else { x0..x1 };
        if panel.log_y {
            draw!(
                chart
                    .build_cartesian_2d(xr, (ylo..yhi).log_scale().with_key_points(log_ticks(ylo, yhi)))
                    .map_err(|e| s(&e))?
            );
        } else {
            draw!(chart.build_cartesian_2d(xr, ylo..yhi).map_err(|e| s(&e))?);
        }
    }
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

    /// Pixels of exactly `c` in an RGB buffer.
    fn pixels(buf: &[u8], c: RGBColor) -> usize {
        buf.chunks_exact(3).filter(|p| p[0] == c.0 && p[1] == c.1 && p[2] == c.2).count()
    }

    fn layout() -> Layout {
        Layout { x_label: "k".into(), width: 600, height: 450, palette: Vec::new(), light_grid: false }
    }

    #[test]
    fn every_series_shows_whether_it_has_many_points_or_one() {
        let many = |label: &str, f: f64| Series {
            label: label.into(),
            points: vec![(5.0, f), (20.0, 2.0 * f), (50.0, 3.0 * f)],
        };
        let one = |label: &str, f: f64| Series { label: label.into(), points: vec![(20.0, f)] };
        for (what, series) in [
            ("lines", vec![many("kv", 1.0), many("prompt", 1.1), many("blend", 1.2)]),
            ("one k", vec![one("kv", 4.0), one("prompt", 9.0), one("blend", 6.0)]),
        ] {
            for log_y in [false, true] {
                let panel = Panel { title: what.into(), y_label: "ms".into(), log_y, series: series.clone() };
                let buf = render(&[panel], &layout()).expect("render");
                for (i, s) in series.iter().enumerate() {
                    let n = pixels(&buf, PALETTE[i]);
                    assert!(n > 150, "{what} (log {log_y}): series {} drew {n} pixels", s.label);
                }
            }
        }
    }

    #[test]
    fn log_axes_tick_1_2_5_per_decade_and_count_axes_whole_numbers() {
        assert_eq!(log_ticks(3.0, 300.0), vec![5.0, 10.0, 20.0, 50.0, 100.0, 200.0]);
        let few = log_ticks(0.8, 2.5);
        assert!(few.len() >= 3 && few.contains(&1.0) && few.contains(&2.0), "{few:?}");
        // Within one decade, 1–9: never a single mark.
        let narrow = log_ticks(6.0, 9.5);
        assert_eq!(narrow, vec![6.0, 7.0, 8.0, 9.0]);
        assert_eq!(
            (x_label(true, 1.1), x_label(true, 10.0), x_label(false, 1.1)),
            (String::new(), "10".into(), "1.1".into())
        );
    }

    #[test]
    fn whole_ticks_have_no_decimal_point_and_the_legend_sits_above_the_data() {
        assert_eq!(tick(&5.0), "5");
        assert_eq!(tick(&0.25), "0.25");
        assert_eq!(tick(&0.0031), "0.0031");
        assert_eq!(tick(&12.345), "12.3");
        assert_eq!(tick(&1.1), "1.1");
        // Room above the data grows with the legend; the data's top stays below it.
        let (lo, hi) = y_range(0.0, 10.0, false, 4, 300.0);
        assert_eq!(lo, 0.0);
        assert!(hi >= 10.0 / (1.0 - 5.0 * LEGEND_ROW / 300.0) - 1e-9, "{hi}");
        let (lo, hi) = y_range(2.0, 200.0, true, 2, 300.0);
        assert!(lo < 2.0 && hi > 200.0 * 1.5, "{lo}..{hi}");
    }
}
