//! The accept loop: HTTP/1.1 connections served by hyper with a header read timeout (which
//! also closes idle keep-alive connections), at most `max_connections` at a time, the one
//! over the limit answered 503 at once and closed, and a graceful shutdown that lets every
//! open connection finish its request.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderValue, header};
use axum::response::IntoResponse;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

use super::error::ApiError;

/// The largest connection limit (the permits of one semaphore acquire).
pub(crate) const MAX_CONNECTIONS: usize = 1 << 20;

/// How long a refused connection is given to send its request head; twice this to take its
/// 503.
const REFUSAL_TIME: Duration = Duration::from_secs(1);

/// Refusals answered at once even under a small connection limit.
const MIN_REFUSALS: usize = 64;

/// How often a refused connection is logged as a warning.
const REFUSAL_WARNING_EVERY: Duration = Duration::from_secs(10);

/// How long to wait before accepting again after `accept` failed (out of descriptors).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// What bounds the connections.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    /// Time to send a request head, from when the connection is ready for one.
    pub header_timeout: Duration,
    /// Connections served at once.
    pub max_connections: usize,
}

/// Accepts connections on `listener` and serves `app` on them until `signal` completes,
/// then waits for the open connections to finish their requests and close.
pub(crate) async fn run(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    signal: impl Future<Output = ()>,
) {
    // Checked by `HttpOptions::check`: at least 1, at most MAX_CONNECTIONS.
    let max = limits.max_connections.clamp(1, MAX_CONNECTIONS);
    let permits = Arc::new(Semaphore::new(max));
    // Refused connections hold a descriptor for up to 2 x REFUSAL_TIME: bounded too.
    let refusals = Arc::new(Semaphore::new(max.max(MIN_REFUSALS)));
    let (closing, closed) = watch::channel(false);
    let mut signal = std::pin::pin!(signal);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => stream,
                Err(e) => {
                    tracing::warn!("accepting a connection failed: {e}");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
            () = &mut signal => break,
        };
        match Arc::clone(&permits).try_acquire_owned() {
            Ok(permit) => {
                tokio::spawn(serve_connection(
                    stream,
                    app.clone(),
                    limits.header_timeout,
                    closed.clone(),
                    permit,
                ));
            }
            Err(_) => match Arc::clone(&refusals).try_acquire_owned() {
                Ok(permit) => {
                    tokio::spawn(refuse(stream, max, permit));
                }
                // Too many refusals in flight as well: close it without an answer.
                Err(_) => drop(stream),
            },
        }
    }
    drop(listener);
    let _ = closing.send(true);
    // Every connection holds a permit until it closes.
    let all = u32::try_from(max).unwrap_or(u32::MAX);
    let _ = permits.acquire_many(all).await;
}

/// Serves one connection until it closes, or until `closed` turns true, then finishes the
/// request in progress and closes it.
async fn serve_connection(
    stream: TcpStream,
    app: Router,
    header_timeout: Duration,
    mut closed: watch::Receiver<bool>,
    _permit: OwnedSemaphorePermit,
) {
    let _ = stream.set_nodelay(true);
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(header_timeout).keep_alive(true);
    let connection = builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app));
    let mut connection = std::pin::pin!(connection);
    tokio::select! {
        result = connection.as_mut() => {
            if let Err(e) = result {
                tracing::debug!("a connection ended: {e}");
            }
        }
        () = async { let _ = closed.wait_for(|&c| c).await; } => {
            connection.as_mut().graceful_shutdown();
            if let Err(e) = connection.await {
                tracing::debug!("a connection ended during shutdown: {e}");
            }
        }
    }
}

/// Answers every request of a connection over the limit with a 503 and closes it. hyper
/// reads the request head first, so that closing does not reset the connection before the
/// client reads the answer; the whole exchange is bounded by [`REFUSAL_TIME`].
async fn refuse(stream: TcpStream, max: usize, _permit: OwnedSemaphorePermit) {
    let service = hyper::service::service_fn(move |_request| async move {
        let mut response =
            ApiError::unavailable(format!("the server is at its limit of {max} connections; retry later"))
                .into_response();
        response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        Ok::<_, std::convert::Infallible>(response)
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(REFUSAL_TIME).keep_alive(false);
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    let _ = tokio::time::timeout(REFUSAL_TIME.saturating_mul(2), connection).await;
    warn_refusal(max);
}

/// Logs a refused connection: a warning at most every [`REFUSAL_WARNING_EVERY`] (a flood of
/// connections must not flood the log), the others at debug level.
fn warn_refusal(max: usize) {
    static LAST: std::sync::Mutex<Option<std::time::Instant>> = std::sync::Mutex::new(None);
    let now = std::time::Instant::now();
    let due = match LAST.lock() {
        Ok(mut last) => {
            let due = last.is_none_or(|t| now.duration_since(t) >= REFUSAL_WARNING_EVERY);
            if due {
                *last = Some(now);
            }
            due
        }
        Err(_) => true,
    };
    if due {
        tracing::warn!("connections refused with 503: {max} connections are open (--max-connections)");
    } else {
        tracing::debug!("a connection was refused: {max} connections are open");
    }
}
