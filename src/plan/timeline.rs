//! Timeline pictures: ranks as rows, each task a box coloured by replica and pass (forward
//! lighter, backward darker; a REDUCE, the STEP and host copies in colours of their own), idle
//! time left blank, and under them each rank's device memory over time. The same drawing
//! serves the predicted schedule (`gems plan --timeline`) and the measured one (`gems train
//! --timeline`), so the two can be laid side by side.

use std::fmt::Write;

use crate::memory::Held;
use crate::schemes::schedule::{Pass, Timed};

/// Colours per replica: (forward, backward).
const COLOURS: [(&str, &str); 4] = [
    ("#9ecae1", "#3182bd"),
    ("#fdae6b", "#e6550d"),
    ("#a1d99b", "#31a354"),
    ("#bcbddc", "#756bb1"),
];

/// Colours of a REDUCE (gradients summed over a stage's holders) and of the STEP (the
/// optimizer), the same for every replica.
const REDUCE: &str = "#c51b8a";
const STEP: &str = "#636363";
/// Colour of an OFFLOAD or PREFETCH (a micro-batch's saved tensors copied to the host tier or
/// back).
const COPY: &str = "#bd9e39";

/// `tasks[r]`: rank r's tasks with start and end in seconds. `held[r]`: rank r's device bytes
/// over time, as (seconds, bytes) points ([`curve`]).
pub fn svg(title: &str, tasks: &[Vec<Timed>], held: &[Vec<(f64, u64)>]) -> String {
    let end = tasks
        .iter()
        .flatten()
        .map(|t| t.end)
        .fold(0.0, f64::max)
        .max(1e-12);
    let (left, width, row, gap, top) = (70.0, 900.0, 28.0, 6.0, 66.0);
    let ranks = tasks.len();
    let mem_top = top + ranks as f64 * (row + gap) + 30.0;
    let mem_h = 90.0;
    let height = mem_top + mem_h + 40.0;
    let x = |t: f64| left + width * t / end;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{height}" font-family="sans-serif" font-size="11">"#,
        left + width + 20.0
    );
    let _ = writeln!(
        s,
        r#"<text x="{left}" y="20" font-size="14">{}</text>"#,
        escape(title)
    );
    // The legend, two rows under the title: what each box is (replica 0's colours; others
    // are shaded alike).
    let (f, b) = COLOURS[0];
    let (mut lx, mut ly) = (left, 28.0);
    for (label, fill, opacity) in [
        ("F forward", f, 1.0),
        ("B/BW backward", b, 1.0),
        ("W weight gradients", b, 0.45),
        ("RECV waiting", "grey", 1.0),
        ("SEND posted", "black", 1.0),
        ("REDUCE gradient sums", REDUCE, 1.0),
        ("STEP optimizer", STEP, 1.0),
        ("OFFLOAD/PREFETCH host copies", COPY, 1.0),
    ] {
        // About 6.5 px a character at 11 px.
        let wide = 34.0 + 6.5 * label.chars().count() as f64;
        if lx + wide > left + width {
            (lx, ly) = (left, ly + 16.0);
        }
        let _ = writeln!(
            s,
            r#"<rect x="{lx}" y="{ly}" width="12" height="12" fill="{fill}" fill-opacity="{opacity}"/><text x="{}" y="{}">{label}</text>"#,
            lx + 16.0,
            ly + 10.0
        );
        lx += wide;
    }
    for (r, list) in tasks.iter().enumerate() {
        let y = top + r as f64 * (row + gap);
        let _ = writeln!(s, r#"<text x="4" y="{}">rank {r}</text>"#, y + row * 0.65);
        let _ = writeln!(
            s,
            r#"<rect x="{left}" y="{y}" width="{width}" height="{row}" fill="none" stroke="silver"/>"#
        );
        for t in list {
            let (f, b) = COLOURS[t.task.replica % COLOURS.len()];
            // Forward light, backward dark, a weight pass (W) dark and faded; a send a tick at
            // the moment it is posted, a receive's wait a thin grey bar; a REDUCE and the STEP
            // boxes of their own colours.
            let (class, fill, opacity) = match t.task.pass {
                Pass::Forward => ("task", f, 1.0),
                Pass::Backward | Pass::Input => ("task", b, 1.0),
                Pass::Weight => ("task", b, 0.45),
                Pass::Reduce => ("reduce", REDUCE, 1.0),
                Pass::Step => ("step", STEP, 1.0),
                Pass::Offload | Pass::Prefetch => ("copy", COPY, 1.0),
                Pass::SendActivations | Pass::SendGradients => {
                    let _ = writeln!(
                        s,
                        r#"<line class="send" x1="{0:.2}" y1="{1}" x2="{0:.2}" y2="{2}" stroke="black" stroke-width="0.8"><title>{3}: {4:.4} s</title></line>"#,
                        x(t.start),
                        y + row * 0.75,
                        y + row,
                        t.task,
                        t.start
                    );
                    continue;
                }
                Pass::RecvActivations | Pass::RecvGradients => {
                    if t.end > t.start {
                        let _ = writeln!(
                            s,
                            r#"<rect class="wait" x="{:.2}" y="{}" width="{:.2}" height="3" fill="grey"><title>{} waited: {:.4}–{:.4} s</title></rect>"#,
                            x(t.start),
                            y + row - 3.0,
                            (x(t.end) - x(t.start)).max(0.5),
                            t.task,
                            t.start,
                            t.end
                        );
                    }
                    continue;
                }
            };
            let what = match t.task.pass.is_collective() {
                true => t.task.to_string(),
                false => format!(
                    "{} replica {} stage {} micro-batch {}",
                    t.task.pass.code(),
                    t.task.replica,
                    t.task.stage,
                    t.task.micro
                ),
            };
            let w = (x(t.end) - x(t.start)).max(0.5);
            let _ = writeln!(
                s,
                r#"<rect class="{class}" x="{:.2}" y="{y}" width="{w:.2}" height="{row}" fill="{fill}" fill-opacity="{opacity}" stroke="white" stroke-width="0.5"><title>{what}: {:.4}–{:.4} s</title></rect>"#,
                x(t.start),
                t.start,
                t.end
            );
        }
    }
    let most = held
        .iter()
        .flatten()
        .map(|&(_, b)| b)
        .max()
        .unwrap_or(0)
        .max(1);
    let _ = writeln!(
        s,
        r#"<text x="4" y="{}">memory</text><text x="{left}" y="{}">device memory per rank, up to {}</text>"#,
        mem_top + 12.0,
        mem_top - 4.0,
        crate::memory::human_bytes(most)
    );
    let _ = writeln!(
        s,
        r#"<rect x="{left}" y="{mem_top}" width="{width}" height="{mem_h}" fill="none" stroke="silver"/>"#
    );
    for (r, points) in held.iter().enumerate() {
        let colour = COLOURS[r % COLOURS.len()].1;
        let mut path = format!("M {left} {}", mem_top + mem_h);
        let mut prev = 0u64;
        for &(t, b) in points {
            let yv = |v: u64| mem_top + mem_h - mem_h * v as f64 / most as f64;
            let _ = write!(
                path,
                " L {:.2} {:.2} L {:.2} {:.2}",
                x(t),
                yv(prev),
                x(t),
                yv(b)
            );
            prev = b;
        }
        let _ = writeln!(
            s,
            r#"<path d="{path}" fill="none" stroke="{colour}" stroke-width="1.5"><title>rank {r}: device memory, peak {}</title></path>"#,
            crate::memory::human_bytes(points.iter().map(|p| p.1).max().unwrap_or(0))
        );
    }
    let _ = writeln!(
        s,
        r#"<text x="{left}" y="{}">0 s</text><text x="{}" y="{}" text-anchor="end">{end:.4} s</text>"#,
        height - 12.0,
        left + width,
        height - 12.0
    );
    s.push_str("</svg>\n");
    s
}

fn escape(t: &str) -> String {
    t.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Each rank's device bytes over time as points of a curve: through each task, the most it
/// held at once (from the task's start), then what it held at its end. `held[r][i]` belongs to
/// `tasks[r][i]` (metered for a plan, measured for a run).
pub fn curve(tasks: &[Vec<Timed>], held: &[Vec<Held>]) -> Vec<Vec<(f64, u64)>> {
    (tasks.iter().zip(held))
        .map(|(list, bytes)| {
            (list.iter().zip(bytes))
                .flat_map(|(t, h)| [(t.start, h.peak), (t.end, h.live)])
                .collect()
        })
        .collect()
}
