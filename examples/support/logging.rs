//! Shared by the examples: show tollgate's `tracing` events on stderr.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// The filter when `RUST_LOG` is not set: tollgate's warnings (the store went away, the
/// store answers again). `RUST_LOG=tollgate=debug` adds every denial and store error.
const DEFAULT_FILTER: &str = "tollgate=info";

/// Installs a `fmt` subscriber filtered by `RUST_LOG`, or by [`DEFAULT_FILTER`].
pub fn init() {
    let (filter, bad) = match std::env::var("RUST_LOG") {
        Ok(directives) => match EnvFilter::try_new(&directives) {
            Ok(filter) => (filter, None),
            Err(error) => (EnvFilter::new(DEFAULT_FILTER), Some((directives, error))),
        },
        Err(_) => (EnvFilter::new(DEFAULT_FILTER), None),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    if let Some((directives, error)) = bad {
        eprintln!("RUST_LOG={directives:?} is not a filter ({error}); using {DEFAULT_FILTER}");
    }
}
