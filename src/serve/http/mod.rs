//! An OpenAI-compatible HTTP server (`picchio serve --http`), specified in `docs/http.md`.
//!
//! `POST /v1/chat/completions` (JSON or server-sent events), `GET /v1/models`,
//! `GET /v1/models/{id}` and `GET /health`. One [`Session`] lives on one engine thread;
//! requests queue for it in arrival order, and each renders its whole conversation so that
//! the longest common prefix with the cache is reused (reported as
//! `usage.prompt_tokens_details.cached_tokens`). A client that disconnects cancels its
//! generation. Every request is checked before it is queued, so the engine never sees an
//! invalid one.
//!
//! ```no_run
//! # fn run(session: picchio::session::Session) -> picchio::Result<()> {
//! use picchio::serve::http::{HttpOptions, serve};
//!
//! let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| picchio::Error::io("bind", e))?;
//! let server = serve(listener, session, HttpOptions::new("gpt-oss-20b"))?;
//! println!("listening on {}", server.url());
//! server.wait();
//! # Ok(()) }
//! ```

mod api;
mod convert;
mod error;
mod routes;
mod stream;
mod worker;

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use tokio::sync::oneshot;

pub use worker::Stats;

use crate::chat::{HarmonyEncoding, VOCAB_SIZE};
use crate::error::{Error, Result};
use crate::session::Session;

/// The default largest request body: 4 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 << 20;

/// Settings of the server.
#[derive(Clone)]
pub struct HttpOptions {
    /// The model ID reported by `/v1/models` and in every response.
    pub model_id: String,
    /// When set, every `/v1` request needs `Authorization: Bearer <key>` (`/health` does not).
    pub api_key: Option<String>,
    /// Largest request body in bytes; larger ones get 413.
    pub max_body_bytes: usize,
    /// Shut down gracefully on Ctrl-C (for the command line; a library user stops the
    /// server with [`ServerHandle::shutdown`]).
    pub stop_on_ctrl_c: bool,
}

impl HttpOptions {
    /// Defaults for a model called `model_id`: no key, 4 MiB bodies, no signal handling.
    pub fn new(model_id: impl Into<String>) -> Self {
        HttpOptions {
            model_id: model_id.into(),
            api_key: None,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            stop_on_ctrl_c: false,
        }
    }
}

/// Shows everything but the key.
impl std::fmt::Debug for HttpOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpOptions")
            .field("model_id", &self.model_id)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("max_body_bytes", &self.max_body_bytes)
            .field("stop_on_ctrl_c", &self.stop_on_ctrl_c)
            .finish()
    }
}

/// A running server. Dropping it asks the server to stop without waiting.
pub struct ServerHandle {
    addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<()>>,
    engine: Option<JoinHandle<()>>,
    counters: Arc<worker::Counters>,
    stopping: Arc<AtomicBool>,
}

impl ServerHandle {
    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The counters, as `/health` reports them.
    pub fn stats(&self) -> Stats {
        self.counters.snapshot()
    }

    fn signal(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }

    fn join(&mut self) {
        for thread in [self.server.take(), self.engine.take()].into_iter().flatten() {
            if thread.join().is_err() {
                tracing::error!("a server thread panicked");
            }
        }
    }

    /// Stops the server: no new connections, the generation in progress is cancelled, and
    /// returns once every connection has closed and the engine thread has ended.
    pub fn shutdown(mut self) {
        self.signal();
        self.join();
    }

    /// Blocks until the server stops (on Ctrl-C with [`HttpOptions::stop_on_ctrl_c`]).
    pub fn wait(mut self) {
        self.join();
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.signal();
    }
}

/// Serves `session` over HTTP on `listener` (already bound, so that port 0 works) from
/// background threads: an async runtime for the connections and one engine thread that
/// owns the session. Fails if the model's vocabulary is not o200k_harmony's or the runtime
/// cannot start.
pub fn serve(listener: TcpListener, session: Session, options: HttpOptions) -> Result<ServerHandle> {
    let vocab = session.runner().config().vocab_size;
    if vocab < VOCAB_SIZE {
        return Err(Error::invalid(format!(
            "the model's vocabulary has {vocab} tokens; the chat server needs the o200k_harmony \
             vocabulary ({VOCAB_SIZE} tokens) of GPT-OSS"
        )));
    }
    let addr = listener.local_addr().map_err(|e| Error::io("<http listener>", e))?;
    listener.set_nonblocking(true).map_err(|e| Error::io(format!("http://{addr}"), e))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("picchio-http")
        .enable_all()
        .build()
        .map_err(|e| Error::io("<async runtime>", e))?;
    let listener = {
        let _guard = runtime.enter();
        tokio::net::TcpListener::from_std(listener).map_err(|e| Error::io(format!("http://{addr}"), e))?
    };

    let harmony = HarmonyEncoding::new();
    let counters = Arc::new(worker::Counters::default());
    let stopping = Arc::new(AtomicBool::new(false));
    let capacity = session.capacity();
    let (jobs, queue) = std::sync::mpsc::channel();
    let engine = {
        let (counters, stopping) = (Arc::clone(&counters), Arc::clone(&stopping));
        std::thread::Builder::new()
            .name("picchio-engine".into())
            .spawn(move || worker::run(session, harmony, queue, counters, stopping))
            .map_err(|e| Error::io("<engine thread>", e))?
    };
    let created =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let app = Arc::new(routes::App {
        harmony,
        model: api::ModelCard {
            id: options.model_id.clone(),
            object: "model",
            created,
            owned_by: "picchio",
            context_length: capacity,
        },
        capacity,
        api_key: options.api_key.clone(),
        max_body_bytes: options.max_body_bytes,
        jobs,
        counters: Arc::clone(&counters),
        stopping: Arc::clone(&stopping),
    });
    let (shutdown, shutdown_rx) = oneshot::channel::<()>();
    let server = {
        let stopping = Arc::clone(&stopping);
        let ctrl_c = options.stop_on_ctrl_c;
        std::thread::Builder::new()
            .name("picchio-http-main".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let signal = async move {
                        if ctrl_c {
                            tokio::select! {
                                _ = shutdown_rx => {}
                                _ = tokio::signal::ctrl_c() => tracing::info!("interrupted: shutting down"),
                            }
                        } else {
                            let _ = shutdown_rx.await;
                        }
                        // Cancel the generation in progress so that streams end.
                        stopping.store(true, Ordering::SeqCst);
                    };
                    let app = routes::router(app);
                    if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(signal).await {
                        tracing::error!("the HTTP server failed: {e}");
                    }
                });
            })
            .map_err(|e| Error::io("<http thread>", e))?
    };
    tracing::info!("serving {} on http://{addr} ({capacity}-token context)", options.model_id);
    Ok(ServerHandle {
        addr,
        shutdown: Some(shutdown),
        server: Some(server),
        engine: Some(engine),
        counters,
        stopping,
    })
}
