//! A soak run, not part of CI: millions of generated hostile inputs through the key
//! extractors, the header parsers, the policy constructors, the GraphQL coster and the
//! layers, counting panics (and failed checks, which panic too). It must end with 0.
//!
//! ```text
//! cargo run --release --all-features --example soak -- 10000000
//! cargo run --release --all-features --example soak -- 100000 --seed 7 --only graphql
//! cargo run --release --all-features --example soak -- 1 --seed 7 --only graphql --from 81234
//! ```
//!
//! Every input is generated from the seed, its target and its index alone, so a panic is
//! replayed with `--only TARGET --from INDEX` and a count of 1. CI runs a short slice of
//! the same generators (`tests/soak.rs`).

mod targets;

use std::process::ExitCode;

use targets::{Options, TARGETS};

fn main() -> ExitCode {
    let mut options = Options {
        count: 10_000_000,
        seed: 0x7011_6a7e,
        only: None,
        from: 0,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| {
            args.next()
                .unwrap_or_else(|| panic!("{name} needs a value"))
        };
        match arg.as_str() {
            "--seed" => options.seed = parse(&value("--seed")),
            "--from" => options.from = parse(&value("--from")),
            "--only" => {
                let name = value("--only");
                let Some(target) = TARGETS.iter().copied().find(|t| t.name() == name) else {
                    eprintln!(
                        "unknown target {name:?}; targets: {}",
                        TARGETS.map(|t| t.name()).join(", ")
                    );
                    return ExitCode::FAILURE;
                };
                options.only = Some(target);
            }
            count => options.count = parse(count),
        }
    }
    println!(
        "soak: {} inputs, seed {:#x}{}",
        options.count,
        options.seed,
        options
            .only
            .map(|t| format!(", only {}", t.name()))
            .unwrap_or_default()
    );
    let report = targets::soak(&options, |tally| {
        println!(
            "  {:<12} {:>10} inputs {:>6} panics {:>9.1?}  ({:.0} inputs/s)",
            tally.target.name(),
            tally.inputs,
            tally.panics,
            tally.elapsed,
            tally.inputs as f64 / tally.elapsed.as_secs_f64().max(1e-9),
        );
    });
    for failure in &report.first_failures {
        println!("  panic: {failure}");
    }
    println!(
        "total: {} inputs, {} panics, {:.1?}",
        report.inputs(),
        report.panics(),
        report.elapsed
    );
    if report.panics() == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn parse(text: &str) -> u64 {
    let text = text.replace('_', "");
    let parsed = match text.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => text.parse(),
    };
    parsed.unwrap_or_else(|_| panic!("not a number: {text:?}"))
}
