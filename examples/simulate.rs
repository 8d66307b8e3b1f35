//! Pictures that choose an algorithm: every algorithm over the same traffic, drawn.
//!
//! ```text
//! cargo run --example simulate -- --out docs/simulation
//! ```
//!
//! Writes one SVG per algorithm into the directory: four rows of traffic (a burst, a
//! steady stream at twice the rate, an attacker timing requests at a fixed window's seam,
//! Poisson arrivals), each request a mark on a 60-second time line, green when admitted,
//! red when denied; a shaping bucket's admitted requests are drawn from arrival to the
//! moment they are let through. Every policy allows 10 requests per 10 seconds (or 1 a
//! second with bursts of 10). Time is a manual clock and the arrivals are seeded: the same
//! run writes the same bytes.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use tollgate::clock::ManualClock;
use tollgate::{MemoryStore, Outcome, Policy, PolicySet, Rate};

const SECONDS: u64 = 60;
const WIDTH: f64 = 900.0;
const LEFT: f64 = 190.0;
const ROW: f64 = 70.0;
const TOP: f64 = 60.0;

/// A named traffic pattern: arrival times in milliseconds.
struct Traffic {
    name: &'static str,
    arrivals: Vec<u64>,
}

fn traffic() -> Vec<Traffic> {
    // A burst of 30 at the start, then 10 more at 30 s.
    let mut burst: Vec<u64> = (0..30).map(|i| i * 20).collect();
    burst.extend((0..10).map(|i| 30_000 + i * 20));
    // Two a second, all minute: twice the sustained rate.
    let steady = (0..2 * SECONDS).map(|i| i * 500).collect();
    // The attacker: 10 requests just before each 10 s window ends and 10 just after.
    let mut seam = Vec::new();
    for window in 1..6u64 {
        let edge = window * 10_000;
        seam.extend((0..10).map(|i| edge - 300 + i * 25));
        seam.extend((0..10).map(|i| edge + 10 + i * 25));
    }
    // Poisson arrivals at 1.5 a second (seeded).
    let mut poisson = Vec::new();
    let (mut t, mut state) = (0.0f64, 0x2545_f491_4f6c_dd1du64);
    loop {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let uniform = (state >> 11) as f64 / (1u64 << 53) as f64;
        t += -(1.0 - uniform).ln() / 1.5 * 1000.0;
        if t >= (SECONDS * 1000) as f64 {
            break;
        }
        poisson.push(t as u64);
    }
    vec![
        Traffic {
            name: "burst",
            arrivals: burst,
        },
        Traffic {
            name: "2x the rate",
            arrivals: steady,
        },
        Traffic {
            name: "window seam",
            arrivals: seam,
        },
        Traffic {
            name: "Poisson 1.5/s",
            arrivals: poisson,
        },
    ]
}

fn policies() -> Vec<(&'static str, Policy)> {
    let ten = Duration::from_secs(10);
    vec![
        (
            "fixed-window",
            Policy::fixed_window("fixed-window", 10, ten).unwrap(),
        ),
        (
            "sliding-log",
            Policy::sliding_log("sliding-log", 10, ten).unwrap(),
        ),
        (
            "sliding-window",
            Policy::sliding_window("sliding-window", 10, ten).unwrap(),
        ),
        (
            "token-bucket",
            Policy::token_bucket("token-bucket", 10, Rate::per_second(1)).unwrap(),
        ),
        (
            "leaky-bucket",
            Policy::leaky_bucket("leaky-bucket", 10, Rate::per_second(1)).unwrap(),
        ),
        (
            "leaky-shaping",
            Policy::leaky_bucket_shaping(
                "leaky-shaping",
                Rate::per_second(1),
                Duration::from_secs(9),
            )
            .unwrap(),
        ),
        (
            "gcra",
            Policy::gcra("gcra", Rate::per_second(1), 10).unwrap(),
        ),
    ]
}

/// One request's fate: arrival, and the delay it was held (`None`: denied).
type Fate = (u64, Option<u64>);

fn run(policy: &Policy, arrivals: &[u64]) -> Vec<Fate> {
    let clock = ManualClock::new();
    // Start on a window boundary, as a fixed window aligned to the epoch would.
    let start = Duration::from_secs(1_000_000);
    let store = MemoryStore::builder().clock(clock.clone()).build();
    let set = PolicySet::from(policy.clone());
    arrivals
        .iter()
        .map(|&at| {
            clock.set(start + Duration::from_millis(at));
            let decision = store.check("client", &set, 1);
            match decision.outcome() {
                Outcome::Allowed { delay } => (at, Some(delay.as_millis() as u64)),
                _ => (at, None),
            }
        })
        .collect()
}

fn x(ms: u64) -> f64 {
    LEFT + (WIDTH - LEFT - 20.0) * ms as f64 / (SECONDS * 1000) as f64
}

/// The most requests admitted within any `window` ms.
fn worst_window(fates: &[Fate], window: u64) -> usize {
    let admitted: Vec<u64> = fates
        .iter()
        .filter_map(|&(at, delay)| delay.map(|d| at + d))
        .collect();
    admitted
        .iter()
        .map(|&start| {
            admitted
                .iter()
                .filter(|&&t| t >= start && t < start + window)
                .count()
        })
        .max()
        .unwrap_or(0)
}

fn render(name: &str, policy: &Policy) -> String {
    let rows = traffic();
    let height = TOP + ROW * rows.len() as f64 + 40.0;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text x="10" y="24" font-size="16" font-weight="bold">{name}: {:?}</text>"#,
        policy.algorithm()
    );
    let _ = writeln!(
        svg,
        r##"<text x="10" y="44" fill="#555">green: admitted (a line: held back by shaping), red: denied; grey lines every 10 s</text>"##
    );
    for second in (0..=SECONDS).step_by(10) {
        let at = x(second * 1000);
        let _ = writeln!(
            svg,
            r##"<line x1="{at:.1}" y1="{TOP}" x2="{at:.1}" y2="{:.1}" stroke="#ddd"/><text x="{at:.1}" y="{:.1}" text-anchor="middle" fill="#555">{second} s</text>"##,
            height - 35.0,
            height - 20.0
        );
    }
    for (index, row) in rows.iter().enumerate() {
        let y = TOP + ROW * index as f64 + ROW / 2.0;
        let fates = run(policy, &row.arrivals);
        let admitted = fates.iter().filter(|(_, d)| d.is_some()).count();
        let _ = writeln!(
            svg,
            r##"<text x="10" y="{:.1}">{}</text><text x="10" y="{:.1}" fill="#555">{} of {} in, max {} per 10 s</text>"##,
            y - 4.0,
            row.name,
            y + 12.0,
            admitted,
            fates.len(),
            worst_window(&fates, 10_000)
        );
        for &(at, delay) in &fates {
            let cx = x(at);
            match delay {
                Some(0) => {
                    let _ = writeln!(
                        svg,
                        r##"<circle cx="{cx:.1}" cy="{:.1}" r="3" fill="#2a9d3a"/>"##,
                        y - 8.0
                    );
                }
                Some(delay) => {
                    let _ = writeln!(
                        svg,
                        r##"<line x1="{cx:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#2a9d3a" stroke-opacity="0.5"/><circle cx="{:.1}" cy="{:.1}" r="3" fill="#2a9d3a"/>"##,
                        y - 8.0,
                        x(at + delay),
                        y - 8.0,
                        x(at + delay),
                        y - 8.0
                    );
                }
                None => {
                    let _ = writeln!(
                        svg,
                        r##"<circle cx="{cx:.1}" cy="{:.1}" r="3" fill="#d43c3c"/>"##,
                        y + 8.0
                    );
                }
            }
        }
    }
    svg.push_str("</svg>\n");
    svg
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut out = PathBuf::from("simulation");
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--out" => out = PathBuf::from(args.next().ok_or("--out needs a directory")?),
            other => return Err(format!("unknown argument {other:?} (use --out DIR)").into()),
        }
    }
    std::fs::create_dir_all(&out)?;
    for (name, policy) in policies() {
        let path = out.join(format!("{name}.svg"));
        std::fs::write(&path, render(name, &policy))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_charts_in_the_readme_are_what_a_run_draws() {
        // The committed charts (docs/simulation) are what this run draws, byte for byte:
        // a change to an algorithm or to the drawing shows here until they are redrawn.
        let committed = [
            include_str!("../docs/simulation/fixed-window.svg"),
            include_str!("../docs/simulation/sliding-log.svg"),
            include_str!("../docs/simulation/sliding-window.svg"),
            include_str!("../docs/simulation/token-bucket.svg"),
            include_str!("../docs/simulation/leaky-bucket.svg"),
            include_str!("../docs/simulation/leaky-shaping.svg"),
            include_str!("../docs/simulation/gcra.svg"),
        ];
        for ((name, policy), committed) in policies().iter().zip(committed) {
            assert_eq!(
                render(name, policy),
                committed,
                "{name}: redraw docs/simulation"
            );
        }
    }

    #[test]
    fn the_pictures_show_what_each_algorithm_does() {
        let rows = traffic();
        let seam = &rows[2].arrivals;
        let by_name: Vec<(&str, Vec<Fate>)> = policies()
            .iter()
            .map(|(name, policy)| (*name, run(policy, seam)))
            .collect();
        let worst = |name: &str| {
            let (_, fates) = by_name.iter().find(|(n, _)| *n == name).unwrap();
            worst_window(fates, 10_000)
        };
        // The fixed window lets twice its limit through across a seam...
        assert_eq!(worst("fixed-window"), 20);
        // ...the sliding log never more than its limit in any window...
        assert_eq!(worst("sliding-log"), 10);
        // ...and the sliding counter stays between the two.
        assert!(worst("sliding-window") <= 20);
        // The shaping bucket holds requests back instead of refusing them all.
        let shaped = run(&policies()[5].1, &rows[0].arrivals);
        assert!(shaped.iter().any(|(_, delay)| delay.is_some_and(|d| d > 0)));
    }
}
