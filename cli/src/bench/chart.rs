//! The sweep chart (`kvwire bench --chart FILE.svg`): GB/s of kvwire beside the raw baseline
//! of the same run, and per-request latency percentiles, against the page size, one line per
//! in-flight depth.

use plotters::prelude::*;

use super::{human_bytes, Report};

/// Line colours, one per depth (cycled).
const COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

/// Writes the chart of `report` as SVG to `path`.
pub fn write_svg(report: &Report, path: &std::path::Path) -> Result<(), String> {
    draw(report, path).map_err(|e| format!("chart {}: {e}", path.display()))
}

fn draw(report: &Report, path: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
    let mut pages: Vec<u32> = report.cases.iter().map(|c| c.page_bytes).collect();
    pages.sort_unstable();
    pages.dedup();
    let mut depths: Vec<u32> = report.cases.iter().map(|c| c.concurrency).collect();
    depths.sort_unstable();
    depths.dedup();
    if pages.is_empty() {
        return Err("no cases to draw".into());
    }
    // Page sizes on an even axis, labelled by size.
    let x_of = |page: u32| pages.iter().position(|&p| p == page).unwrap_or(0) as f64;
    let x_max = (pages.len() as f64 - 1.0).max(1.0);
    let label = |x: &f64| {
        let i = x.round();
        if (x - i).abs() < 1e-6 && i >= 0.0 {
            pages
                .get(i as usize)
                .map(|&p| human_bytes(u64::from(p)))
                .unwrap_or_default()
        } else {
            String::new()
        }
    };

    let root = SVGBackend::new(path, (1280, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let title = format!(
        "kvwire bench, transport {}, verify {}, {} pages x {} buffers per transfer",
        report.transport,
        format!("{:?}", report.spec.verify).to_lowercase(),
        report.spec.pages,
        report.spec.buffers
    );
    let root = root.titled(&title, ("sans-serif", 18))?;
    let (left, right) = root.split_horizontally(640);

    // GB/s: kvwire (solid) and the raw baseline of the same run (thin), per depth.
    let top = report
        .cases
        .iter()
        .flat_map(|c| [Some(c.gb_per_s), c.raw_gb_per_s])
        .flatten()
        .fold(0.0f64, f64::max)
        * 1.15;
    let mut gbps = ChartBuilder::on(&left)
        .caption("throughput, GB/s (10^9 B/s)", ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(52)
        .build_cartesian_2d(-0.2f64..x_max + 0.2, 0.0f64..top.max(0.001))?;
    gbps.configure_mesh()
        .x_labels(pages.len().max(2))
        .x_label_formatter(&label)
        .x_desc("page per buffer")
        .y_desc("GB/s")
        .draw()?;
    for (i, &depth) in depths.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let at = |f: &dyn Fn(&super::CaseResult) -> Option<f64>| {
            let mut v: Vec<(f64, f64)> = report
                .cases
                .iter()
                .filter(|c| c.concurrency == depth)
                .filter_map(|c| f(c).map(|y| (x_of(c.page_bytes), y)))
                .collect();
            v.sort_by(|a, b| a.0.total_cmp(&b.0));
            v
        };
        gbps.draw_series(LineSeries::new(
            at(&|c| Some(c.gb_per_s)),
            colour.stroke_width(3),
        ))?
        .label(format!("kvwire, {depth} in flight"))
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], colour.stroke_width(3)));
        let raw = at(&|c| c.raw_gb_per_s);
        if !raw.is_empty() {
            gbps.draw_series(LineSeries::new(raw, colour.mix(0.6).stroke_width(1)))?
                .label(format!("raw TCP, {depth} in flight run"))
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 18, y)], colour.mix(0.6).stroke_width(1))
                });
        }
    }
    gbps.configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;

    // Latency percentiles, log scale, per depth: p50 solid, p99 thinner, p99.9 thinnest.
    let lat: Vec<f64> = report
        .cases
        .iter()
        .flat_map(|c| [c.p50_ms, c.p99_ms, c.p999_ms])
        .filter(|v| *v > 0.0)
        .collect();
    let lo = lat.iter().copied().fold(f64::INFINITY, f64::min).min(1.0) * 0.8;
    let hi = lat.iter().copied().fold(0.0f64, f64::max).max(lo * 10.0) * 1.25;
    let mut latency = ChartBuilder::on(&right)
        .caption(
            "per request, reservation to verified, ms",
            ("sans-serif", 16),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(52)
        .build_cartesian_2d(-0.2f64..x_max + 0.2, (lo..hi).log_scale())?;
    latency
        .configure_mesh()
        .x_labels(pages.len().max(2))
        .x_label_formatter(&label)
        .x_desc("page per buffer")
        .y_desc("ms")
        .draw()?;
    for (i, &depth) in depths.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        for (name, width, pick) in [
            (
                "p50",
                3u32,
                (|c: &super::CaseResult| c.p50_ms) as fn(&super::CaseResult) -> f64,
            ),
            ("p99", 2, |c| c.p99_ms),
            ("p99.9", 1, |c| c.p999_ms),
        ] {
            let mut v: Vec<(f64, f64)> = report
                .cases
                .iter()
                .filter(|c| c.concurrency == depth && pick(c) > 0.0)
                .map(|c| (x_of(c.page_bytes), pick(c)))
                .collect();
            v.sort_by(|a, b| a.0.total_cmp(&b.0));
            latency
                .draw_series(LineSeries::new(v, colour.stroke_width(width)))?
                .label(format!("{name}, {depth} in flight"))
                .legend(move |(x, y)| {
                    PathElement::new([(x, y), (x + 18, y)], colour.stroke_width(width))
                });
        }
    }
    latency
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()?;
    root.present()?;
    Ok(())
}
