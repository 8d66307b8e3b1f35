//! How far the sliding window counter strays from the exact sliding log.
//!
//! ```text
//! cargo run --release --example sliding_accuracy
//! ```
//!
//! Poisson arrivals (unit cost) at several multiples of the limit are decided by the log
//! and by counters of 1, 4 and 10 sub-windows side by side, each on its own state; a
//! "wrong decision" is one where a counter and the log disagree. Because two limiters that
//! once disagree go on from different histories, each counter's own admissions are also
//! replayed into an exact log: "over" is a request the counter admitted that the exact
//! rule would have denied on the counter's own history, "under" the reverse. Then the worst case: the
//! limit's worth of requests arrives at the very end of a sub-window, and each counter is
//! asked how many it admits within one window of the first.

use tollgate::algorithm::{CounterState, LogState, SlidingLog, SlidingWindow, Verdict};

type Ring = CounterState<Box<[u64]>>;

const SECOND: u64 = 1_000_000_000;

/// A small seeded generator (xorshift64*), so every run measures the same traffic.
struct Random(u64);

impl Random {
    fn next_f64(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn main() {
    let limit = 100;
    let window = 60 * SECOND;
    let splits = [1u64, 4, 10];
    let counters =
        splits.map(|k| SlidingWindow::new(limit, window, k).expect("k divides a minute"));
    let log = SlidingLog::new(limit, window).expect("a minute is a window");
    println!("limit {limit} per minute, Poisson arrivals, 1,000 windows per load");
    println!(
        "| load (x limit) | arrivals | log admitted | k = 1: differs from the log / over / under \
         | k = 4 | k = 10 |"
    );
    println!("|---|---|---|---|---|---|");
    for load in [0.5, 0.9, 1.0, 1.2, 2.0] {
        let mut random = Random(0x9e37_79b9_7f4a_7c15);
        let rate = load * limit as f64 / window as f64; // arrivals per nanosecond
        let mut states: Vec<Ring> = counters.iter().map(Ring::for_algorithm).collect();
        let mut log_state = LogState::default();
        let (mut now, mut arrivals, mut by_log) = (0u64, 0u64, 0u64);
        let mut wrong = [0u64; 3];
        // Each counter's own admitted history, kept in an exact log: where the counter's
        // answer differs from the exact rule on the very history it made.
        let mut shadows: Vec<LogState> = counters.iter().map(|_| LogState::default()).collect();
        let (mut over, mut under) = ([0u64; 3], [0u64; 3]);
        let end = 1_000 * window;
        while now < end {
            now += (-(1.0 - random.next_f64()).ln() / rate) as u64 + 1;
            arrivals += 1;
            log.refresh(&mut log_state, now);
            let exact = matches!(log.check(&log_state, now, 1), Verdict::Admit { .. });
            if exact {
                log.commit(&mut log_state, now, 1);
                by_log += 1;
            }
            for (i, counter) in counters.iter().enumerate() {
                let (state, shadow) = (&mut states[i], &mut shadows[i]);
                counter.refresh(state, now);
                log.refresh(shadow, now);
                let admitted = matches!(counter.check(state, now, 1), Verdict::Admit { .. });
                let rule = matches!(log.check(shadow, now, 1), Verdict::Admit { .. });
                if admitted {
                    counter.commit(state, now, 1);
                    log.commit(shadow, now, 1);
                }
                wrong[i] += u64::from(admitted != exact);
                over[i] += u64::from(admitted && !rule);
                under[i] += u64::from(!admitted && rule);
            }
        }
        let percent = |n: u64| format!("{:.1}%", 100.0 * n as f64 / arrivals as f64);
        let cell = |i: usize| {
            format!(
                "{} / {} / {}",
                percent(wrong[i]),
                percent(over[i]),
                percent(under[i])
            )
        };
        println!(
            "| {load} | {arrivals} | {by_log} | {} | {} | {} |",
            cell(0),
            cell(1),
            cell(2)
        );
    }

    // Worst case: the limit's worth arrives in the last nanoseconds of a sub-window, then
    // one arrival per millisecond; count what is admitted within one window of the first.
    for counter in counters {
        let span = window / counter.sub_windows();
        let mut state = Ring::for_algorithm(&counter);
        let seam = 10 * window + span;
        let first = seam - limit;
        let mut admitted = 0;
        let mut at = first;
        while at < first + window {
            counter.refresh(&mut state, at);
            if matches!(counter.check(&state, at, 1), Verdict::Admit { .. }) {
                counter.commit(&mut state, at, 1);
                admitted += 1;
            }
            at += if at < seam { 1 } else { SECOND / 1_000 };
        }
        println!(
            "worst case, k = {}: {admitted} admitted within one window for a limit of {limit} \
             (bound: {})",
            counter.sub_windows(),
            limit + limit / counter.sub_windows(),
        );
    }
}
