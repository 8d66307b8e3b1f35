//! A short slice of the soak (`examples/soak`, run by hand with millions of inputs): the
//! same generators and checks, 20,000 inputs spread over every target, no panic allowed.
//! `SOAK_SEED` picks another slice.

#![cfg(feature = "graphql")]

#[path = "../examples/soak/targets.rs"]
mod targets;

#[test]
fn a_short_soak_panics_nowhere() {
    let seed = std::env::var("SOAK_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or(0x5eed);
    let options = targets::Options {
        count: 20_000,
        seed,
        only: None,
        from: 0,
    };
    let report = targets::soak(&options, |tally| {
        println!(
            "{}: {} inputs, {} panics, {:?}",
            tally.target.name(),
            tally.inputs,
            tally.panics,
            tally.elapsed
        );
    });
    println!("{} inputs in {:?}", report.inputs(), report.elapsed);
    assert_eq!(report.inputs(), 20_000);
    assert_eq!(
        report.panics(),
        0,
        "seed {seed}: {:#?}",
        report.first_failures
    );
}
