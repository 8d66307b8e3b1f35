//! How far the sliding window counter strays from the exact sliding log.
//!
//! ```text
//! cargo run --release --example sliding_accuracy
//! ```
//!
//! Poisson arrivals (unit cost) at several multiples of the limit are decided by both
//! algorithms side by side, each on its own state; a "wrong decision" is one where the
//! counter and the log disagree. Then the worst case: the previous window's requests all
//! arrive at its very end, and the counter is asked how many it admits in the next
//! window's length.

use tollgate::algorithm::{CounterState, LogState, SlidingLog, SlidingWindow, Verdict};

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
    let counter = SlidingWindow { limit, window };
    let log = SlidingLog { limit, window };
    println!("limit {limit} per minute, Poisson arrivals, 1,000 windows per load");
    println!("| load (x limit) | arrivals | wrong decisions | counter admitted | log admitted |");
    println!("|---|---|---|---|---|");
    for load in [0.5, 0.9, 1.0, 1.2, 2.0] {
        let mut random = Random(0x9e37_79b9_7f4a_7c15);
        let rate = load * limit as f64 / window as f64; // arrivals per nanosecond
        let (mut counter_state, mut log_state) = (CounterState::default(), LogState::default());
        let (mut now, mut arrivals, mut wrong, mut by_counter, mut by_log) = (0u64, 0, 0, 0, 0);
        let end = 1_000 * window;
        while now < end {
            now += (-(1.0 - random.next_f64()).ln() / rate) as u64 + 1;
            arrivals += 1;
            counter.refresh(&mut counter_state, now);
            log.refresh(&mut log_state, now);
            let a = matches!(counter.check(&counter_state, now, 1), Verdict::Admit { .. });
            let b = matches!(log.check(&log_state, now, 1), Verdict::Admit { .. });
            if a {
                counter.commit(&mut counter_state, now, 1);
                by_counter += 1;
            }
            if b {
                log.commit(&mut log_state, now, 1);
                by_log += 1;
            }
            wrong += u64::from(a != b);
        }
        println!(
            "| {load} | {arrivals} | {:.1}% | {by_counter} | {by_log} |",
            100.0 * wrong as f64 / arrivals as f64
        );
    }

    // Worst case: limit 10; the previous window's 10 arrive in its last nanoseconds.
    let small = SlidingWindow { limit: 10, window };
    let mut state = CounterState::default();
    let seam = 10 * window;
    let mut admitted_in_window = 0;
    for i in 0..10 {
        let at = seam - 10 + i;
        small.refresh(&mut state, at);
        if matches!(small.check(&state, at, 1), Verdict::Admit { .. }) {
            small.commit(&mut state, at, 1);
            admitted_in_window += 1;
        }
    }
    // Then one arrival per millisecond for the next window's length, counting those
    // admitted within one window of the first.
    let mut at = seam;
    while at < seam - 10 + window {
        small.refresh(&mut state, at);
        if matches!(small.check(&state, at, 1), Verdict::Admit { .. }) {
            small.commit(&mut state, at, 1);
            admitted_in_window += 1;
        }
        at += SECOND / 1_000;
    }
    println!(
        "worst case, limit 10: {admitted_in_window} admitted within one window (the exact log admits 10)"
    );
}
