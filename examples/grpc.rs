//! A tonic gRPC server behind tollgate: the classic `helloworld.Greeter/SayHello`.
//!
//! ```text
//! cargo run --example grpc                        # serves on 127.0.0.1:3000 ($PORT)
//! cargo run --example grpc --features tonic       # the same, the limiter reading tonic itself
//! ```
//!
//! Every client gets a token bucket of 5 refilled 1 per second: the `x-api-key` metadata
//! entry when it holds a key the service knows, else the peer address (which tonic
//! records per connection). A key the service does not know counts as none: a client
//! making up a new key for each call would otherwise get a new bucket each time.
//! A denied call is a gRPC status, RESOURCE_EXHAUSTED (8), with `retry-after`,
//! `ratelimit` and `ratelimit-policy` in its metadata and a `google.rpc.RetryInfo` detail;
//! admitted calls carry the rate-limit metadata too.
//!
//! The Greeter is written out by hand (what `tonic-build` would generate from the
//! `helloworld.proto` below), so the example needs no `protoc`:
//!
//! ```text
//! service Greeter { rpc SayHello (HelloRequest) returns (HelloReply); }
//! message HelloRequest { string name = 1; }
//! message HelloReply { string message = 1; }
//! ```

#[path = "support/port.rs"]
mod port;

#[cfg(all(test, feature = "tonic"))]
#[path = "support/certificates.rs"]
mod certificates;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tollgate::key::{ClientIp, KeyError, KeyErrorKind, KeyExtractor, KeyExtractorExt};
use tollgate::{Key, MemoryStore, Policy, PolicyError, Rate, RateLimitLayer};
use tonic::body::Body;
use tonic::server::{NamedService, UnaryService};

/// `helloworld.HelloRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HelloRequest {
    #[prost(string, tag = "1")]
    pub name: String,
}

/// `helloworld.HelloReply`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HelloReply {
    #[prost(string, tag = "1")]
    pub message: String,
}

/// The path of `SayHello`.
pub const SAY_HELLO: &str = "/helloworld.Greeter/SayHello";

/// The path of `SayHelloStream`: three replies to one request (a server stream). One
/// streaming call costs what one call costs, when it starts.
pub const SAY_HELLO_STREAM: &str = "/helloworld.Greeter/SayHelloStream";

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The Greeter service, as tonic's generated server code would route it.
#[derive(Clone, Default)]
pub struct Greeter;

impl NamedService for Greeter {
    const NAME: &'static str = "helloworld.Greeter";
}

struct SayHello;

impl UnaryService<HelloRequest> for SayHello {
    type Response = HelloReply;
    type Future = BoxFuture<Result<tonic::Response<HelloReply>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<HelloRequest>) -> Self::Future {
        let name = request.into_inner().name;
        Box::pin(async move {
            Ok(tonic::Response::new(HelloReply {
                message: format!("Hello {name}!"),
            }))
        })
    }
}

struct SayHelloStream;

type Replies = futures_util::stream::Iter<std::vec::IntoIter<Result<HelloReply, tonic::Status>>>;

impl tonic::server::ServerStreamingService<HelloRequest> for SayHelloStream {
    type Response = HelloReply;
    type ResponseStream = Replies;
    type Future = BoxFuture<Result<tonic::Response<Replies>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<HelloRequest>) -> Self::Future {
        let name = request.into_inner().name;
        Box::pin(async move {
            let replies: Vec<_> = (1..=3)
                .map(|n| {
                    Ok(HelloReply {
                        message: format!("Hello {name}, {n} of 3!"),
                    })
                })
                .collect();
            Ok(tonic::Response::new(futures_util::stream::iter(replies)))
        })
    }
}

impl tower::Service<http::Request<Body>> for Greeter {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<http::Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        if request.uri().path() == SAY_HELLO {
            Box::pin(async move {
                let codec = tonic_prost::ProstCodec::<HelloReply, HelloRequest>::default();
                let mut grpc = tonic::server::Grpc::new(codec);
                Ok(grpc.unary(SayHello, request).await)
            })
        } else if request.uri().path() == SAY_HELLO_STREAM {
            Box::pin(async move {
                let codec = tonic_prost::ProstCodec::<HelloReply, HelloRequest>::default();
                let mut grpc = tonic::server::Grpc::new(codec);
                Ok(grpc.server_streaming(SayHelloStream, request).await)
            })
        } else {
            Box::pin(async { Ok(tonic::Status::unimplemented("no such method").into_http()) })
        }
    }
}

/// The API keys this service knows (a service looks them up where it keeps them).
const API_KEYS: [&str; 3] = ["demo", "team-a", "streamer"];

/// A known API key from the `x-api-key` metadata entry, hashed (no key reaches a store
/// or a log in clear); none for a key the service does not know, which the client could
/// change on every call, a new bucket each time.
fn known_api_key() -> impl KeyExtractor + Clone {
    tollgate::key::from_fn(|parts| {
        parts
            .headers
            .get("x-api-key")
            .map(|value| value.as_bytes())
            .filter(|value| API_KEYS.iter().any(|known| known.as_bytes() == *value))
            .map(|value| Key::hashed("x-api-key", value))
            .ok_or_else(|| KeyError::missing(KeyErrorKind::Client, "no known API key"))
    })
}

/// The limiter: 5 calls, refilled 1 a second, per known API key or else per peer
/// address. (In a service, the layer that checks keys runs before the limiter, and the
/// key is what it verified.)
pub fn limiter() -> Result<RateLimitLayer<MemoryStore, impl KeyExtractor + Clone>, PolicyError> {
    Ok(RateLimitLayer::new(MemoryStore::new())
        .policy(Policy::token_bucket("api", 5, Rate::per_second(1))?)
        .key(known_api_key().or(ClientIp::peer())))
}

/// Serves the Greeter behind the limiter on `listener` until the process ends. With
/// tollgate's `tonic` feature the limiter reads tonic's connection info and answers in
/// tonic's body type itself.
#[cfg(feature = "tonic")]
pub async fn serve(listener: tokio::net::TcpListener) -> Result<(), Box<dyn std::error::Error>> {
    tonic::transport::Server::builder()
        .layer(limiter()?)
        .add_service(Greeter)
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
        .await?;
    Ok(())
}

/// Serves the Greeter behind the limiter on `listener` until the process ends. Without
/// tollgate's `tonic` feature, two small layers do what it would: the peer address as a
/// `SocketAddr` extension (which `ClientIp` reads), and tonic's body wrapped so the
/// limiter can answer in it.
#[cfg(not(feature = "tonic"))]
pub async fn serve(listener: tokio::net::TcpListener) -> Result<(), Box<dyn std::error::Error>> {
    tonic::transport::Server::builder()
        .layer(tower::util::MapRequestLayer::new(peer_as_extension))
        .layer(limiter()?)
        .layer(tollgate::body::WrapBodyLayer::new())
        .add_service(Greeter)
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
        .await?;
    Ok(())
}

/// The peer address tonic records, as the `SocketAddr` extension `ClientIp` reads.
#[cfg(not(feature = "tonic"))]
fn peer_as_extension(mut request: http::Request<Body>) -> http::Request<Body> {
    let peer = request
        .extensions()
        .get::<tonic::transport::server::TcpConnectInfo>()
        .and_then(tonic::transport::server::TcpConnectInfo::remote_addr);
    if let Some(peer) = peer {
        request.extensions_mut().insert(peer);
    }
    request
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let port = port::from_env()?;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!(
        "tollgate gRPC example: helloworld.Greeter on {} (5 calls, 1 a second, per known x-api-key or peer)",
        listener.local_addr()?
    );
    serve(listener).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A real tonic client connected to `addr`.
    async fn client(addr: std::net::SocketAddr) -> tonic::client::Grpc<tonic::transport::Channel> {
        let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        tonic::client::Grpc::new(channel)
    }

    async fn call(
        addr: std::net::SocketAddr,
        name: &str,
        key: Option<&str>,
    ) -> Result<tonic::Response<HelloReply>, tonic::Status> {
        let mut client = client(addr).await;
        client.ready().await.unwrap();
        let mut request = tonic::Request::new(HelloRequest { name: name.into() });
        if let Some(key) = key {
            request
                .metadata_mut()
                .insert("x-api-key", key.parse().unwrap());
        }
        let codec = tonic_prost::ProstCodec::<HelloRequest, HelloReply>::default();
        client
            .unary(
                request,
                http::uri::PathAndQuery::from_static(SAY_HELLO),
                codec,
            )
            .await
    }

    #[tokio::test]
    async fn a_real_tonic_client_is_limited_with_grpc_statuses() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move { serve(listener).await.unwrap() });
        // Keyed by the peer address: tonic's connection info reaches the key extractor.
        for i in 0..5 {
            let reply = call(addr, "Ferris", None).await.unwrap();
            assert_eq!(reply.get_ref().message, "Hello Ferris!");
            let rate = reply.metadata().get("ratelimit").unwrap().to_str().unwrap();
            assert!(rate.starts_with(&format!("\"api\";r={};", 4 - i)), "{rate}");
        }
        let status = call(addr, "Ferris", None).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(status.message().contains("api"), "{}", status.message());
        assert!(status.metadata().get("retry-after").is_some());
        assert!(status.metadata().get("ratelimit-policy").is_some());
        // google.rpc.Status with a google.rpc.RetryInfo detail.
        let details = status.details();
        assert!(!details.is_empty());
        assert!(details.windows(9).any(|w| w == b"RetryInfo"));
        // A known API key is its own client.
        assert!(call(addr, "Key", Some("team-a")).await.is_ok());
        server.abort();
    }

    /// A client making up a new API key for each call gets no new bucket each time: a
    /// key the service does not know counts as none, and the call as its address's.
    #[tokio::test]
    async fn made_up_api_keys_share_their_address_bucket() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move { serve(listener).await.unwrap() });
        let started = std::time::Instant::now();
        let mut admitted = 0;
        for i in 0..10 {
            let made_up = format!("made-up-{i}");
            admitted += u64::from(call(addr, "Mallory", Some(&made_up)).await.is_ok());
        }
        // A bucket of 5 for the address, and one more for each second the calls took.
        let refilled = started.elapsed().as_secs();
        assert!(
            admitted >= 5 && admitted <= 5 + refilled,
            "{admitted} admitted"
        );
        server.abort();
    }

    #[cfg(feature = "tonic")]
    #[tokio::test]
    async fn with_the_feature_the_limiter_reads_tonic_itself() {
        // No adapter layers: the limiter alone, keyed by the peer tonic records.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .layer(
                    RateLimitLayer::new(MemoryStore::new())
                        .policy(Policy::token_bucket("api", 1, Rate::per_hour(1)).unwrap())
                        .key(ClientIp::peer()),
                )
                .add_service(Greeter)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
                .await
                .unwrap();
        });
        assert!(call(addr, "a", None).await.is_ok());
        let status = call(addr, "a", None).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        server.abort();
    }

    /// A store that is always away.
    #[cfg(feature = "tonic")]
    #[derive(Clone)]
    struct Away;

    #[cfg(feature = "tonic")]
    impl tollgate::Store for Away {
        fn decide(
            &self,
            _: &tollgate::Key,
            _: &tollgate::PolicySet,
            _: u64,
        ) -> tollgate::DecideFuture {
            tollgate::DecideFuture::ready(Err(tollgate::StoreError::new(
                tollgate::StoreErrorKind::Unavailable,
                "connection refused",
            )))
        }
    }

    #[tokio::test]
    async fn a_streaming_call_costs_one_call_when_it_starts() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move { serve(listener).await.unwrap() });
        let mut client = client(addr).await;
        for call in 0..2 {
            client.ready().await.unwrap();
            let mut request = tonic::Request::new(HelloRequest {
                name: "Ferris".into(),
            });
            request
                .metadata_mut()
                .insert("x-api-key", "streamer".parse().unwrap());
            let codec = tonic_prost::ProstCodec::<HelloRequest, HelloReply>::default();
            let response = client
                .server_streaming(
                    request,
                    http::uri::PathAndQuery::from_static(SAY_HELLO_STREAM),
                    codec,
                )
                .await
                .unwrap();
            // Three messages, one unit: the bucket of 5 has 4, then 3, left.
            let rate = response
                .metadata()
                .get("ratelimit")
                .unwrap()
                .to_str()
                .unwrap();
            assert!(
                rate.starts_with(&format!("\"api\";r={};", 4 - call)),
                "{rate}"
            );
            let mut stream = response.into_inner();
            let mut replies = 0;
            while let Some(reply) = stream.message().await.unwrap() {
                assert!(reply.message.starts_with("Hello Ferris"));
                replies += 1;
            }
            assert_eq!(replies, 3);
        }
        server.abort();
    }

    #[cfg(feature = "tonic")]
    #[tokio::test]
    async fn a_store_failure_under_fail_closed_is_unavailable() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .layer(
                    RateLimitLayer::new(Away)
                        .policy(Policy::token_bucket("api", 5, Rate::per_second(1)).unwrap())
                        .key(ClientIp::peer())
                        .on_store_error(tollgate::FailureMode::FailClosed),
                )
                .add_service(Greeter)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
                .await
                .unwrap();
        });
        let status = call(addr, "Ferris", None).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unavailable);
        server.abort();
    }

    /// Over TLS tonic records the TCP peer beside its TLS connection info: the peer key
    /// finds it on a TLS server as on a plain one.
    #[cfg(feature = "tonic")]
    #[tokio::test]
    async fn a_tls_connections_peer_is_its_key() {
        use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};
        let (ca, certificate, key) = crate::certificates::signed_for_loopback();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .tls_config(ServerTlsConfig::new().identity(Identity::from_pem(certificate, key)))
                .unwrap()
                .layer(
                    RateLimitLayer::new(MemoryStore::new())
                        .policy(Policy::token_bucket("api", 2, Rate::per_hour(1)).unwrap())
                        .key(ClientIp::peer()),
                )
                .add_service(Greeter)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
                .await
                .unwrap();
        });
        let channel = tonic::transport::Channel::from_shared(format!("https://{addr}"))
            .unwrap()
            .tls_config(
                ClientTlsConfig::new()
                    .ca_certificate(Certificate::from_pem(ca))
                    .domain_name("localhost"),
            )
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut client = tonic::client::Grpc::new(channel);
        let mut answers = Vec::new();
        for _ in 0..3 {
            client.ready().await.unwrap();
            let codec = tonic_prost::ProstCodec::<HelloRequest, HelloReply>::default();
            let request = tonic::Request::new(HelloRequest {
                name: "Ferris".into(),
            });
            let answer = client
                .unary(
                    request,
                    http::uri::PathAndQuery::from_static(SAY_HELLO),
                    codec,
                )
                .await;
            answers.push(answer.map_or_else(|status| status.code(), |_| tonic::Code::Ok));
        }
        assert_eq!(
            answers,
            [
                tonic::Code::Ok,
                tonic::Code::Ok,
                tonic::Code::ResourceExhausted
            ]
        );
        server.abort();
    }
}
