//! A client that paces itself by what the server says, instead of being refused.
//!
//! ```text
//! cargo run --example quickstart &                                   # 10 tokens, 5 per second
//! cargo run --example paced_client -- http://127.0.0.1:3000/ 40
//! ```
//!
//! Sends N sequential GETs to URL through `tollgate::client::PacingLayer` over hyper-util's
//! client, and prints as its last line `sent N, ok X, 429 Y, elapsed S.SS s`. Against the
//! quickstart, 40 requests take about 6 s (10 at once, then 5 a second) with no 429: the
//! layer reads `RateLimit: "api";r=0;t=1` and waits the second before sending on.

use std::time::Instant;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tollgate::client::PacingLayer;
use tower::{Layer, Service, ServiceExt};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: paced_client URL N";
    let url: http::Uri = args.next().ok_or(usage)?.parse()?;
    let count: u64 = args.next().ok_or(usage)?.parse()?;

    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    // No retries: every refusal the server sends is counted, none is hidden by a retry.
    let mut paced = PacingLayer::new().retries(0).layer(client);

    let (mut ok, mut refused) = (0u64, 0u64);
    let started = Instant::now();
    for _ in 0..count {
        let request = Request::get(url.clone()).body(Empty::<Bytes>::new())?;
        let response = paced.ready().await?.call(request).await?;
        match response.status() {
            StatusCode::TOO_MANY_REQUESTS => refused += 1,
            status if status.is_success() => ok += 1,
            status => eprintln!("{status}"),
        }
        // Read the body to its end, so the connection is reused.
        response.into_body().collect().await?;
    }
    println!(
        "sent {count}, ok {ok}, 429 {refused}, elapsed {:.2} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
