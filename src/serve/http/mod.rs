//! An OpenAI-compatible HTTP server (`picchio serve --http`), specified in `docs/http.md`.
//!
//! `POST /v1/chat/completions` and `POST /v1/responses` (JSON or server-sent events),
//! `POST /v1/completions`, `GET`/`DELETE /v1/responses/{id}`,
//! `GET /v1/responses/{id}/input_items`, `POST /tokenize`, `POST /detokenize`, `GET /metrics`,
//! `GET /v1/models`, `GET /v1/models/{id}`, `GET /health`, and a chat page for the browser at
//! `GET /` (`webui`). The [`Session`]'s runner is shared by [`HttpOptions::parallel`] slots
//! ([`crate::slots`]: one session and thread each, their decode steps batched); requests
//! queue for a free slot in arrival order, each going to the slot whose cache shares the
//! longest prefix with its whole rendered conversation, which is reused (reported as
//! `usage.prompt_tokens_details.cached_tokens`). A client that disconnects cancels its
//! generation, on its slot only. Every request is checked before it is queued, so the engine never sees an
//! invalid one.
//!
//! Connections are accepted by the server's own loop: at most
//! [`HttpOptions::max_connections`] at a time (one more gets an immediate 503 and is closed,
//! so idle connections cannot starve real requests), each closed when its request head does
//! not arrive within [`HttpOptions::header_timeout`] (idle keep-alive connections included);
//! bodies are limited in size ([`HttpOptions::max_body_bytes`], 413) and in time
//! ([`HttpOptions::body_timeout`], 408). [`start`] serves before the model is ready:
//! `/health` and every other route answer 503 until [`ServerHandle::attach`] gives it the
//! session.
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
mod completions;
mod convert;
mod cors;
mod error;
mod input_items;
mod listen;
mod logprobs;
mod metrics;
mod raw;
mod responses;
mod responses_api;
mod responses_stream;
mod routes;
mod sse;
mod store;
mod stream;
mod structured;
mod tokens;
mod webui;
mod worker;

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::sync::oneshot;

pub use worker::Stats;

use crate::chat::{ChatFormat, HarmonyEncoding, VOCAB_SIZE};
use crate::error::{Error, Result};
use crate::session::Session;

/// The default largest request body: 16 MiB, 128 bytes of JSON per token of a 131072-token
/// context (GPT-OSS's longest), which covers text that is all `\u` escapes.
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 << 20;

/// The default time a client has to send a request head (and an idle keep-alive connection
/// has to start its next request): 10 s.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// The default time a client has to send a whole request body: 60 s.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(60);

/// The default number of connections served at once: 256.
pub const DEFAULT_MAX_CONNECTIONS: usize = 256;

/// Settings of the server.
#[derive(Clone)]
pub struct HttpOptions {
    /// The model ID reported by `/v1/models` and in every response.
    pub model_id: String,
    /// When set, every request needs `Authorization: Bearer <key>` (`/health` does not).
    pub api_key: Option<String>,
    /// Largest request body in bytes; larger ones get 413.
    pub max_body_bytes: usize,
    /// How long a connection may take to send a request head, counted from when the server
    /// is ready to read one (so an idle keep-alive connection is closed after this long too).
    pub header_timeout: Duration,
    /// How long a request may take to send its whole body; a slower one gets 408.
    pub body_timeout: Duration,
    /// Connections served at once; one more gets an immediate 503 and is closed.
    pub max_connections: usize,
    /// The origin allowed to make cross-origin (browser) requests, `*` for any; `None`
    /// (the default) sends no CORS headers and leaves `OPTIONS` a 405.
    pub cors_origin: Option<String>,
    /// Shut down gracefully on Ctrl-C (for the command line; a library user stops the
    /// server with [`ServerHandle::shutdown`]). While no session is attached, Ctrl-C exits
    /// the process at once (status 130): there is nothing to drain.
    pub stop_on_ctrl_c: bool,
    /// Hold tool calls to the declared functions with a grammar when a request declares
    /// tools and leaves `tool_choice` at `auto` or `none` (no other structure asked for):
    /// then a call of anything else, or any call under `none`, cannot be generated. Off,
    /// such turns run free and a call of an undeclared function is returned as text.
    /// Required and named calls and response formats always use their grammar.
    pub tool_grammar: bool,
    /// The model's chat format (Harmony by default; [`ChatFormat::for_family`] gives a
    /// model's own), used to render, parse and tokenize every request.
    pub chat_format: ChatFormat,
    /// Slots: conversations served at once, each with its own key/value cache, their
    /// decode steps batched ([`crate::slots`]); requests beyond them queue. A runner that
    /// cannot add that many caches (VRAM or memory runs out) serves fewer, and logs why.
    pub parallel: usize,
}

impl HttpOptions {
    /// Defaults for a model called `model_id`: no key, 16 MiB bodies, 10 s to send a request
    /// head, 60 s to send a body, 256 connections, no CORS, no signal handling, tool calls
    /// held to the declared functions by grammar.
    pub fn new(model_id: impl Into<String>) -> Self {
        HttpOptions {
            model_id: model_id.into(),
            api_key: None,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            cors_origin: None,
            stop_on_ctrl_c: false,
            tool_grammar: true,
            chat_format: ChatFormat::Harmony(HarmonyEncoding::new()),
            parallel: 1,
        }
    }

    /// Refuses settings the server cannot run with, naming the setting.
    fn check(&self) -> Result<()> {
        let positive = |name: &str, ok: bool| {
            if ok { Ok(()) } else { Err(Error::invalid(format!("HttpOptions::{name} must be positive"))) }
        };
        positive("max_body_bytes", self.max_body_bytes > 0)?;
        positive("header_timeout", !self.header_timeout.is_zero())?;
        positive("body_timeout", !self.body_timeout.is_zero())?;
        positive("max_connections", self.max_connections > 0)?;
        positive("parallel", self.parallel > 0)?;
        if let Some(origin) = &self.cors_origin
            && (origin.is_empty() || axum::http::HeaderValue::from_str(origin).is_err())
        {
            return Err(Error::invalid(format!(
                "HttpOptions::cors_origin {origin:?} is not an origin (scheme://host[:port], or *)"
            )));
        }
        if self.max_connections > listen::MAX_CONNECTIONS {
            return Err(Error::invalid(format!(
                "HttpOptions::max_connections {} is over the limit of {}",
                self.max_connections,
                listen::MAX_CONNECTIONS
            )));
        }
        Ok(())
    }
}

/// Shows everything but the key.
impl std::fmt::Debug for HttpOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpOptions")
            .field("model_id", &self.model_id)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("max_body_bytes", &self.max_body_bytes)
            .field("header_timeout", &self.header_timeout)
            .field("body_timeout", &self.body_timeout)
            .field("max_connections", &self.max_connections)
            .field("cors_origin", &self.cors_origin)
            .field("stop_on_ctrl_c", &self.stop_on_ctrl_c)
            .field("chat_format", &self.chat_format.name())
            .field("tool_grammar", &self.tool_grammar)
            .field("parallel", &self.parallel)
            .finish()
    }
}

/// A running server. Dropping it asks the server to stop without waiting.
pub struct ServerHandle {
    addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<()>>,
    engine: Option<JoinHandle<()>>,
    /// The slots' scheduler, joined after the engine threads (it ends with their sessions).
    slots: Option<crate::slots::Slots>,
    /// Slots asked for ([`HttpOptions::parallel`]).
    parallel: usize,
    /// The handlers' shared state: the handle attaches the session to it. Dropped before the
    /// engine thread is joined, since that thread ends when the last queue sender is gone.
    app: Option<Arc<routes::App>>,
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

    /// Whether a session is attached (`/health` answers 200 rather than 503 "loading").
    pub fn is_ready(&self) -> bool {
        self.app.as_ref().is_some_and(|app| app.engine().is_ok())
    }

    /// Gives the server its session: its runner is shared by [`HttpOptions::parallel`]
    /// slots (fewer when the runner keeps fewer key/value caches; the first slot keeps the
    /// session's cached tokens), the engine threads start on them, and `/health` and the API
    /// answer from then on. Fails if the model's vocabulary is not o200k_harmony's, if a
    /// session is already attached, or if a thread cannot start.
    pub fn attach(&mut self, session: Session) -> Result<()> {
        let Some(app) = &self.app else {
            return Err(Error::invalid("the server has stopped: no session can be attached"));
        };
        check_vocab(&app.format, &session)?;
        if app.engine().is_ok() {
            return Err(Error::invalid("the server already has a session"));
        }
        let capacity = session.capacity();
        let (jobs, queue) = std::sync::mpsc::channel();
        let vocab_size = session.runner().config().vocab_size;
        let engine = routes::Engine { model: app.model_card(capacity), capacity, vocab_size, jobs };
        if app.set_engine(engine).is_err() {
            return Err(Error::invalid("the server already has a session"));
        }
        let (runner, history) = session.into_parts();
        let (slots, sessions) = crate::slots::Slots::start(runner, self.parallel, history)?;
        let count = slots.count();
        self.counters.slots.store(count as u64, Ordering::SeqCst);
        let _ = self.counters.scheduler.set(slots.shared_counters());
        self.slots = Some(slots);
        let (counters, stopping, format) =
            (Arc::clone(&self.counters), Arc::clone(&self.stopping), app.format.clone());
        let thread = std::thread::Builder::new()
            .name("picchio-engine".into())
            .spawn(move || worker::run(sessions, format, queue, counters, stopping))
            .map_err(|e| Error::io("<engine thread>", e))?;
        self.engine = Some(thread);
        tracing::info!(
            "the model is ready: {capacity}-token context, {count} slot{} (requests served at once)",
            if count == 1 { "" } else { "s" }
        );
        Ok(())
    }

    fn signal(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }

    fn join(&mut self) {
        if let Some(thread) = self.server.take()
            && thread.join().is_err()
        {
            tracing::error!("the HTTP server thread panicked");
        }
        // The engine thread ends once the last sender of its queue (held by `app`) is gone.
        self.app = None;
        if let Some(thread) = self.engine.take()
            && thread.join().is_err()
        {
            tracing::error!("the engine thread panicked");
        }
        if let Some(slots) = self.slots.take() {
            slots.join();
        }
    }

    /// Stops the server: no new connections, the generation in progress is cancelled, and
    /// returns once every connection has closed and the engine thread has ended.
    pub fn shutdown(mut self) {
        self.signal();
        self.join();
    }

    /// Blocks until the server stops (on Ctrl-C with [`HttpOptions::stop_on_ctrl_c`]) and
    /// returns the final counters.
    pub fn wait(mut self) -> Stats {
        self.join();
        self.counters.snapshot()
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.signal();
    }
}

/// Refuses a Harmony session whose vocabulary is not o200k_harmony's (a ChatML tokenizer
/// of another size works: IDs the tokenizer lacks are never sampled).
fn check_vocab(format: &ChatFormat, session: &Session) -> Result<()> {
    let vocab = session.runner().config().vocab_size;
    let harmony = match format {
        ChatFormat::Harmony(_) => true,
        ChatFormat::ChatMl(_) => false,
    };
    if harmony && vocab < VOCAB_SIZE {
        return Err(Error::invalid(format!(
            "the model's vocabulary has {vocab} tokens; the chat server needs the o200k_harmony \
             vocabulary ({VOCAB_SIZE} tokens) of GPT-OSS"
        )));
    }
    Ok(())
}

/// Serves `session` over HTTP on `listener` (already bound, so that port 0 works) from
/// background threads: an async runtime for the connections and one engine thread that
/// owns the session. Fails if the model's vocabulary is not o200k_harmony's, the options
/// are out of range, or the runtime cannot start.
pub fn serve(listener: TcpListener, session: Session, options: HttpOptions) -> Result<ServerHandle> {
    check_vocab(&options.chat_format, &session)?;
    let mut server = start(listener, options)?;
    if let Err(e) = server.attach(session) {
        server.shutdown();
        return Err(e);
    }
    Ok(server)
}

/// Starts serving on `listener` before the model is ready: `/health` answers 503
/// `{"status": "loading"}` and every other route 503 (after the API key check) until
/// [`ServerHandle::attach`] gives the server its session. So a client (or a supervisor) can
/// tell a server that loads or converts a model from one that is down.
pub fn start(listener: TcpListener, options: HttpOptions) -> Result<ServerHandle> {
    options.check()?;
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

    let counters = Arc::new(worker::Counters::default());
    let stopping = Arc::new(AtomicBool::new(false));
    let app = Arc::new(routes::App::new(
        options.chat_format.clone(),
        &options,
        Arc::clone(&counters),
        Arc::clone(&stopping),
    ));
    let limits =
        listen::Limits { header_timeout: options.header_timeout, max_connections: options.max_connections };
    let (shutdown, shutdown_rx) = oneshot::channel::<()>();
    let server = {
        let stopping = Arc::clone(&stopping);
        let ctrl_c = options.stop_on_ctrl_c;
        let app = Arc::clone(&app);
        std::thread::Builder::new()
            .name("picchio-http-main".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let ready = Arc::clone(&app);
                    let signal = async move {
                        if ctrl_c {
                            tokio::select! {
                                _ = shutdown_rx => {}
                                _ = tokio::signal::ctrl_c() => {
                                    if ready.engine().is_err() {
                                        // Loading: no request can be in flight, nothing to drain.
                                        tracing::info!("interrupted while the model loads: exiting");
                                        std::process::exit(130);
                                    }
                                    tracing::info!("interrupted: shutting down");
                                }
                            }
                        } else {
                            let _ = shutdown_rx.await;
                        }
                        // Cancel the generation in progress so that streams end.
                        stopping.store(true, Ordering::SeqCst);
                    };
                    listen::run(listener, routes::router(app), limits, signal).await;
                });
            })
            .map_err(|e| Error::io("<http thread>", e))?
    };
    tracing::info!("serving {} on http://{addr}", options.model_id);
    Ok(ServerHandle {
        addr,
        shutdown: Some(shutdown),
        server: Some(server),
        engine: None,
        slots: None,
        parallel: options.parallel,
        app: Some(app),
        counters,
        stopping,
    })
}

/// Checks a `POST /v1/chat/completions` body as the server does before it queues a request
/// (the JSON, every field, the rendering of the conversation), without a model, and returns
/// the rendered prompt's length in tokens. The error is the 400 answer's message, prefixed
/// by the field at fault when there is one. For fuzzing, and for tools that check requests
/// offline.
pub fn check_request(body: &[u8]) -> Result<usize> {
    render_request(body, "2026-01-01").map(|prompt| prompt.len())
}

/// The token IDs of the prompt the server renders for a `POST /v1/chat/completions` body
/// (as `POST /tokenize` answers), with `date` (`YYYY-MM-DD`) in the system message; checked
/// as [`check_request`] checks it. For `picchio render`.
pub fn render_request(body: &[u8], date: &str) -> Result<Vec<u32>> {
    render_request_with(&ChatFormat::Harmony(HarmonyEncoding::new()), body, date)
}

/// [`render_request`] in `format` (a ChatML model's prompt for the same request).
pub fn render_request_with(format: &ChatFormat, body: &[u8], date: &str) -> Result<Vec<u32>> {
    let refused = |e: error::ApiError| match e.param {
        Some(param) => Error::invalid(format!("{param}: {}", e.message)),
        None => Error::invalid(e.message),
    };
    let request = convert::parse_request(body).map_err(refused)?;
    let plan = convert::plan(request, date, 0).map_err(refused)?;
    format
        .render_prompt(&plan.conversation)
        .map_err(|e| Error::invalid(format!("messages: the conversation cannot be rendered: {e}")))
}
