//! The port an example serves on: `$PORT`, else 3000.

/// `$PORT`, or 3000 when it is not set; an error that says so when it is not a port.
pub fn from_env() -> Result<u16, String> {
    match std::env::var("PORT") {
        Ok(port) => port
            .parse()
            .map_err(|_| format!("PORT must be a port number, got {port:?}")),
        Err(_) => Ok(3000),
    }
}
