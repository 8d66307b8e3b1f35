//! Policies from a configuration file, reloaded while running.
//!
//! ```text
//! cargo run --example config                       # serves on 127.0.0.1:3000 ($PORT)
//! TOLLGATE_CONFIG=my.toml cargo run --example config
//!
//! curl -i http://127.0.0.1:3000/                          # plan "default": api, daily (and burst-trial, in shadow)
//! curl -i -H 'x-api-key: demo' http://127.0.0.1:3000/      # the same, by the key
//! curl -i -H 'x-api-key: pro-acme' http://127.0.0.1:3000/  # plan "pro": api-pro
//! curl -i -H 'x-api-key: pro-made-up' http://127.0.0.1:3000/  # unknown: by address
//! # edit examples/tollgate.toml, then (or just save it: file changes are picked up too)
//! kill -HUP <pid>
//! ```
//!
//! The file is `examples/tollgate.toml` (or `$TOLLGATE_CONFIG`). A reload that fails (an
//! invalid file) is reported with the entry at fault and changes nothing.

#[path = "support/logging.rs"]
mod logging;
#[path = "support/port.rs"]
mod port;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::routing::get;
use tollgate::MemoryStore;
use tollgate::config::{LimiterConfig, LiveLayer};

fn load(path: &Path) -> Result<LimiterConfig, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let config: LimiterConfig =
        toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    config
        .check()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(config)
}

/// The API keys this app knows, and their plans (an app looks them up in its database).
const KEYS: [(&str, Option<&str>); 2] = [("demo", None), ("pro-acme", Some("pro"))];

/// Authentication, before the limiter: a known API key gets its plan header; a key the
/// app does not know is dropped, so the request is limited by its address (a client
/// inventing keys would otherwise get a fresh quota with each). A plan header the client
/// sent is dropped.
async fn plan_of_key(mut request: axum::extract::Request) -> axum::extract::Request {
    let known = request
        .headers()
        .get("x-api-key")
        .and_then(|key| key.to_str().ok())
        .and_then(|key| KEYS.iter().find(|(known, _)| *known == key));
    let plan = known.map(|(_, plan)| *plan);
    let headers = request.headers_mut();
    headers.remove("x-plan");
    match plan {
        Some(Some(plan)) => {
            headers.insert("x-plan", axum::http::HeaderValue::from_static(plan));
        }
        Some(None) => {}
        None => {
            headers.remove("x-api-key");
        }
    }
    request
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Reloads `layer` from `path`, saying what happened.
fn reload(layer: &LiveLayer, path: &Path, why: &str) {
    match load(path).and_then(|config| layer.reload(&config).map_err(|e| e.to_string())) {
        Ok(()) => println!("reloaded {} ({why})", path.display()),
        Err(error) => eprintln!("kept the running configuration: {error}"),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    logging::init();
    let port = port::from_env()?;
    let path = std::env::var_os("TOLLGATE_CONFIG")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/examples/tollgate.toml"
            ))
        });
    let layer = LiveLayer::new(MemoryStore::new(), &load(&path)?)?;

    // SIGHUP reloads.
    #[cfg(unix)]
    {
        let (layer, path) = (layer.clone(), path.clone());
        let mut hangups = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
        tokio::spawn(async move {
            while hangups.recv().await.is_some() {
                reload(&layer, &path, "SIGHUP");
            }
        });
    }
    // So does saving the file.
    {
        let (layer, path) = (layer.clone(), path.clone());
        tokio::spawn(async move {
            let mut seen = modified(&path);
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let now = modified(&path);
                if now != seen {
                    seen = now;
                    reload(&layer, &path, "the file changed");
                }
            }
        });
    }

    let app = Router::new()
        .route("/", get(|| async { "hello from behind tollgate\n" }))
        .route("/search", get(|| async { "search results\n" }))
        .layer(layer)
        // Outermost: the plan comes from who the client is, never from what it says.
        .layer(axum::middleware::map_request(plan_of_key));
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    let addr = listener.local_addr()?;
    println!(
        "tollgate config example listening on http://{addr}, serving {} (pid {}: kill -HUP to reload)",
        path.display(),
        std::process::id()
    );
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .await?;
    Ok(())
}
