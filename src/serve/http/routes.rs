//! The routes: `POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/responses`, `GET` and `DELETE
//! /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`, `GET /v1/models`, `GET /v1/models/{id}`, `GET /health`; the API key check (before routing), the body size and time limits, the
//! 503 answers while the model loads, request logging, and OpenAI-shaped 404 and 405 answers.

use std::future::poll_fn;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock, mpsc};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::sse::{KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_core::Stream;
use rand::Rng;
use serde::Serialize;
use tokio::sync::mpsc::unbounded_channel;

use super::HttpOptions;
use super::api::{ChatCompletion, Choice, ModelCard, ModelList, Usage};
use super::completions;
use super::convert;
use super::error::{ApiError, ErrorNote};
use super::logprobs::ChoiceLogprobs;
use super::responses::{self as responses_api, Ending, OutputBuilder, ResponseMeta};
use super::responses_api::ResponsesRequest;
use super::responses_stream::ResponseStream;
use super::sse::ENGINE_GONE;
use super::store::Store;
use super::stream::{ChunkMeta, ChunkStream};
use super::structured::Structured;
use super::worker::{Counters, Failure, Job, Output, Piece, Stats, WorkerMsg};
use crate::chat::{ChatFormat, TurnOptions, render_prompt, today_utc};
use crate::constrain::Grammar;

/// The most bytes reserved for a body before its bytes arrive.
const PREALLOCATE: usize = 64 << 10;

/// How often an idle stream sends a comment, so that a vanished client is noticed.
const KEEP_ALIVE: Duration = Duration::from_secs(10);

/// The engine side of the server, set once the session is attached.
pub(crate) struct Engine {
    /// The served model.
    pub model: ModelCard,
    /// Context capacity in tokens.
    pub capacity: usize,
    /// Token IDs of the model (what an output grammar is compiled over).
    pub vocab_size: usize,
    /// The engine's queue.
    pub jobs: mpsc::Sender<Job>,
}

/// What the handlers share.
pub(crate) struct App {
    /// The chat format.
    pub format: ChatFormat,
    /// The served model's ID.
    pub model_id: String,
    /// The key every request but `/health` must bear, if any.
    pub api_key: Option<String>,
    /// Largest request body in bytes.
    pub max_body_bytes: usize,
    /// How long a request may take to send its body.
    pub body_timeout: Duration,
    /// The engine, once the model is loaded; until then every route answers 503.
    engine: OnceLock<Engine>,
    /// Counters.
    pub counters: Arc<Counters>,
    /// Set when the server shuts down.
    pub stopping: Arc<AtomicBool>,
    /// Stored responses of `POST /v1/responses`.
    pub responses: Arc<Mutex<Store>>,
    /// The origin allowed to make cross-origin requests (`*`: any), if any.
    pub cors_origin: Option<String>,
    /// Police `auto`/`none` tool choices with a grammar ([`HttpOptions::tool_grammar`]).
    pub tool_grammar: bool,
}

impl App {
    /// The shared state of a server with `options` and no engine yet.
    pub fn new(
        format: ChatFormat,
        options: &HttpOptions,
        counters: Arc<Counters>,
        stopping: Arc<AtomicBool>,
    ) -> Self {
        App {
            format,
            model_id: options.model_id.clone(),
            api_key: options.api_key.clone(),
            max_body_bytes: options.max_body_bytes,
            body_timeout: options.body_timeout,
            engine: OnceLock::new(),
            counters,
            stopping,
            responses: Arc::new(Mutex::new(Store::default())),
            cors_origin: options.cors_origin.clone(),
            tool_grammar: options.tool_grammar,
        }
    }

    /// The model card of this server for a context of `capacity` tokens, created now.
    pub fn model_card(&self, capacity: usize) -> ModelCard {
        ModelCard {
            id: self.model_id.clone(),
            object: "model",
            created: unix_now(),
            owned_by: "picchio",
            context_length: capacity,
        }
    }

    /// Sets the engine; gives it back if one is set already.
    pub fn set_engine(&self, engine: Engine) -> Result<(), Engine> {
        self.engine.set(engine)
    }

    /// The engine, or a 503 while the model loads.
    pub fn engine(&self) -> Result<&Engine, ApiError> {
        self.engine
            .get()
            .ok_or_else(|| ApiError::unavailable("the model is loading; retry when GET /health answers 200"))
    }

    fn submit(&self, job: Job) -> Result<(), ApiError> {
        if self.stopping.load(Ordering::SeqCst) {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        let engine = self.engine()?;
        self.counters.enqueued();
        if engine.jobs.send(job).is_err() {
            self.counters.unqueued();
            return Err(ApiError::unavailable("the engine has stopped"));
        }
        Ok(())
    }
}

/// Token counts of a finished request, for the request log.
#[derive(Clone, Copy, Debug)]
struct TokenNote(Usage);

/// Marks a streamed response in the request log.
#[derive(Clone, Copy, Debug)]
struct StreamNote;

/// The application. The key check wraps every route and the fallbacks, so that without a
/// valid key an unknown route is a 401, not a 404 (only `/health` and the chat page's
/// `GET`s need no key).
pub(crate) fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(text_completions))
        .route("/v1/responses", post(create_response))
        .route("/v1/responses/{id}", get(get_response).delete(delete_response))
        .route("/v1/responses/{id}/input_items", get(list_input_items))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(get_model))
        .route("/health", get(health))
        .route("/", get(super::webui::index))
        .route(super::webui::APP_JS_PATH, get(super::webui::app_js))
        .route(super::webui::STYLE_CSS_PATH, get(super::webui::style_css))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(Arc::clone(&app), require_key))
        .layer(middleware::from_fn_with_state(Arc::clone(&app), super::cors::cors))
        .layer(middleware::from_fn(log_requests))
        .with_state(app)
}

/// The one path that needs no key.
const HEALTH: &str = "/health";

/// Logs every request: method, path, status, time, and token counts when known.
async fn log_requests(req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let start = Instant::now();
    let response = next.run(req).await;
    let ms = start.elapsed().as_secs_f64() * 1e3;
    let status = response.status().as_u16();
    let ext = response.extensions();
    if let Some(TokenNote(u)) = ext.get::<TokenNote>() {
        tracing::info!(
            "{method} {path} {status} in {ms:.1} ms: {} prompt tokens ({} cached) + {} completion tokens",
            u.prompt_tokens,
            u.prompt_tokens_details.cached_tokens,
            u.completion_tokens
        );
    } else if ext.get::<StreamNote>().is_some() {
        tracing::info!("{method} {path} {status}, streaming after {ms:.1} ms");
    } else if let Some(ErrorNote(message)) = ext.get::<ErrorNote>() {
        tracing::info!("{method} {path} {status} in {ms:.1} ms: {message}");
    } else {
        tracing::info!("{method} {path} {status} in {ms:.1} ms");
    }
    response
}

/// Compares without an early exit, so the time taken does not tell how much of a key matched.
fn same_key(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether a request needs the key: all but `/health` and the chat page's own `GET`s (the
/// page holds no data, and must load to ask for the key).
fn needs_key(req: &Request) -> bool {
    let path = req.uri().path();
    let page = matches!(*req.method(), Method::GET | Method::HEAD) && super::webui::is_page_path(path);
    path != HEALTH && !page
}

/// Requires `Authorization: Bearer KEY` when a key is set, on every path but `/health` and
/// the chat page, before routing.
async fn require_key(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    if let Some(key) = &app.api_key
        && needs_key(&req)
    {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim());
        match given {
            None => {
                return ApiError::unauthorized(
                    "no API key given: send the header `Authorization: Bearer KEY`",
                )
                .into_response();
            }
            Some(token) if !same_key(token.as_bytes(), key.as_bytes()) => {
                return ApiError::unauthorized("incorrect API key").into_response();
            }
            Some(_) => {}
        }
    }
    next.run(req).await
}

async fn not_found(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::not_found(format!("no route {method} {}", uri.path()))
}

async fn method_not_allowed(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError::method_not_allowed(format!("{} does not accept {method}", uri.path()))
}

/// `GET /health`: liveness, the model, and the counters; 503 `{"status": "loading"}` until
/// the model is ready.
async fn health(State(app): State<Arc<App>>) -> Response {
    #[derive(Serialize)]
    struct Health<'a> {
        status: &'static str,
        model: &'a str,
        context_length: usize,
        #[serde(flatten)]
        stats: Stats,
    }
    #[derive(Serialize)]
    struct Loading<'a> {
        status: &'static str,
        model: &'a str,
    }
    let Ok(engine) = app.engine() else {
        let body = Loading { status: "loading", model: &app.model_id };
        return (StatusCode::SERVICE_UNAVAILABLE, [(header::RETRY_AFTER, "1")], axum::Json(body))
            .into_response();
    };
    let body = Health {
        status: "ok",
        model: &app.model_id,
        context_length: engine.capacity,
        stats: app.counters.snapshot(),
    };
    axum::Json(body).into_response()
}

async fn list_models(State(app): State<Arc<App>>) -> Response {
    match app.engine() {
        Ok(engine) => {
            axum::Json(ModelList { object: "list", data: vec![engine.model.clone()] }).into_response()
        }
        Err(e) => e.into_response(),
    }
}

async fn get_model(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    let engine = match app.engine() {
        Ok(engine) => engine,
        Err(e) => return e.into_response(),
    };
    if id == engine.model.id {
        axum::Json(engine.model.clone()).into_response()
    } else {
        let mut e = ApiError::not_found(format!(
            "the model {id:?} does not exist; this server has {:?}",
            engine.model.id
        ));
        e.param = Some("model".into());
        e.code = Some("model_not_found");
        e.into_response()
    }
}

/// Reads the body within `timeout` (else 408) and `limit` bytes (else 413).
async fn read_body_in_time(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
    timeout: Duration,
) -> Result<Bytes, ApiError> {
    match tokio::time::timeout(timeout, read_body(headers, body, limit)).await {
        Ok(result) => result,
        Err(_) => Err(ApiError::timeout(timeout)),
    }
}

/// Reads the body, up to `limit` bytes. A larger body gets a 413; what the client sends of
/// it is read and dropped first (up to four times the limit), so that it sees the answer
/// rather than a reset connection.
async fn read_body(headers: &HeaderMap, body: Body, limit: usize) -> Result<Bytes, ApiError> {
    let drain_limit = limit.saturating_mul(4);
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    let expects_continue =
        headers.get(header::EXPECT).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if let Some(n) = declared
        && n > limit as u64
        && (expects_continue || n > drain_limit as u64)
    {
        // The client waits for our go-ahead (or the body is too big to drain): answer now.
        return Err(ApiError::too_large(limit));
    }
    let mut stream = body.into_data_stream();
    // Grown as the bytes arrive: a declared length alone reserves at most PREALLOCATE bytes,
    // so that connections that announce big bodies and send nothing cost no memory.
    let reserve = declared.unwrap_or(0).min(limit as u64).min(PREALLOCATE as u64);
    let mut data = Vec::with_capacity(usize::try_from(reserve).unwrap_or(PREALLOCATE));
    let mut total = 0usize;
    while let Some(chunk) = poll_fn(|cx| Pin::new(&mut stream).poll_next(cx)).await {
        let chunk =
            chunk.map_err(|e| ApiError::invalid(None, format!("could not read the request body: {e}")))?;
        total = total.saturating_add(chunk.len());
        if total > drain_limit {
            break;
        }
        if total <= limit {
            data.extend_from_slice(&chunk);
        }
    }
    if total > limit {
        return Err(ApiError::too_large(limit));
    }
    Ok(Bytes::from(data))
}

/// A random ID: `prefix` and 24 letters and digits.
pub(crate) fn new_id(prefix: &str) -> String {
    let tail: String = rand::rng().sample_iter(rand::distr::Alphanumeric).take(24).map(char::from).collect();
    format!("{prefix}{tail}")
}

pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The answer to a failed turn.
pub(crate) fn failure_error(failure: Failure) -> ApiError {
    match failure {
        Failure::ContextFull(m) => ApiError::context_length(m),
        Failure::Invalid(m) => ApiError::invalid(None, m),
        Failure::Engine(m) => ApiError::server(format!("the engine failed: {m}")),
        Failure::ShuttingDown => ApiError::unavailable("the server is shutting down"),
    }
}

async fn chat_completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    chat(app, headers, body).await.unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/chat/completions`: checks the request, renders it (once: the job carries the
/// prompt's token IDs to the engine, which also needs them), checks that it fits, queues
/// it, and answers with one JSON body or a stream of chunks.
async fn chat(app: Arc<App>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let (capacity, vocab_size) = (app.engine()?.capacity, app.engine()?.vocab_size);
    let bytes = read_body_in_time(&headers, body, app.max_body_bytes, app.body_timeout).await?;
    let request = convert::parse_request(&bytes)?;
    let plan = convert::plan(request, &today_utc(), rand::random())?;
    let grammar = compile_grammar(&app.format, plan.structured.clone(), vocab_size, app.tool_grammar).await?;
    // Rendering tokenizes the whole conversation: keep it off the async workers.
    // The job carries the prompt's token IDs, so the engine thread does not render it again.
    let format = app.format.clone();
    let conversation = plan.conversation;
    let prompt = tokio::task::spawn_blocking(move || render_prompt(&format, &conversation))
        .await
        .map_err(|e| ApiError::server(format!("rendering the prompt failed: {e}")))?
        .map_err(|e| {
            ApiError::invalid(Some("messages"), format!("the conversation cannot be rendered: {e}"))
        })?;
    if prompt.len() >= capacity {
        return Err(ApiError::context_length(format!(
            "the prompt is {} tokens, but the context holds {} tokens and at least one must be left \
             for the answer",
            prompt.len(),
            capacity
        )));
    }
    let prompt_token_ids = plan.return_token_ids.then(|| prompt.clone());
    let (tx, mut rx) = unbounded_channel();
    app.submit(Job {
        prompt,
        // The worker clamps the limit to what the context has left after the prompt.
        turn: TurnOptions {
            max_tokens: plan.max_tokens,
            sampling: plan.sampling,
            declared_functions: plan.declared_functions,
            stop: plan.stop,
            grammar,
        },
        output: Output::Harmony,
        events: tx,
        queued_at: Instant::now(),
    })?;
    let meta = ChunkMeta {
        id: new_id("chatcmpl-"),
        created: unix_now(),
        model: app.model_id.clone(),
        include_usage: plan.include_usage,
        exclude_reasoning: plan.exclude_reasoning,
        logprobs: plan.logprobs,
    };
    if plan.stream {
        let stream = ChunkStream::new(rx, meta, Box::new(|| new_id("call_")));
        let mut response = Sse::new(stream).keep_alive(KeepAlive::new().interval(KEEP_ALIVE)).into_response();
        response.extensions_mut().insert(StreamNote);
        return Ok(response);
    }
    let mut logprobs = Vec::new();
    let finished = loop {
        match rx.recv().await {
            Some(WorkerMsg::Done(result)) => break result.map_err(failure_error)?,
            Some(WorkerMsg::Logprobs(entries)) => logprobs.extend(entries),
            Some(WorkerMsg::Started | WorkerMsg::Piece(_)) => {}
            None => return Err(ApiError::unavailable(ENGINE_GONE)),
        }
    };
    let usage = Usage::new(finished.prompt_tokens, finished.cached_tokens, finished.completion_tokens);
    let mut message = convert::response_message(&finished.messages, &mut || new_id("call_"));
    if plan.exclude_reasoning {
        (message.reasoning_content, message.reasoning) = (None, None);
    }
    let completion = ChatCompletion {
        id: meta.id,
        object: "chat.completion",
        created: meta.created,
        model: meta.model,
        choices: vec![Choice {
            index: 0,
            message,
            logprobs: plan.logprobs.then_some(ChoiceLogprobs { content: logprobs, refusal: None }),
            finish_reason: convert::finish_reason(finished.stop, finished.called_tool()),
            token_ids: plan.return_token_ids.then_some(finished.tokens),
        }],
        usage,
        prompt_token_ids,
    };
    let mut response = axum::Json(completion).into_response();
    response.extensions_mut().insert(TokenNote(usage));
    Ok(response)
}

async fn text_completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    complete_text(app, headers, body).await.unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/completions`: checks the request, tokenizes the prompt (off the async
/// workers), checks that it fits, queues it as a raw job, and answers with one
/// `text_completion` or a stream of them.
async fn complete_text(app: Arc<App>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let capacity = app.engine()?.capacity;
    let bytes = read_body_in_time(&headers, body, app.max_body_bytes, app.body_timeout).await?;
    let plan = completions::plan(convert::parse_json(&bytes)?, rand::random())?;
    let tokenizer = app.format.tokenizer();
    let (input, special) = (plan.prompt.clone(), plan.special_tokens);
    let tokens = tokenizer.clone();
    let prompt = tokio::task::spawn_blocking(move || completions::tokenize(&tokens, &input, special))
        .await
        .map_err(|e| ApiError::server(format!("tokenizing the prompt failed: {e}")))?
        .map_err(|e| ApiError::invalid(Some("prompt"), e.to_string()))?;
    if prompt.len() >= capacity {
        let mut e = ApiError::context_length(format!(
            "the prompt is {} tokens, but the context holds {} tokens and at least one must be left \
             for the answer",
            prompt.len(),
            capacity
        ));
        e.param = Some("prompt".into());
        return Err(e);
    }
    let echo = plan.echo.then(|| completions::echo_text(&tokenizer, &plan.prompt));
    let prompt_token_ids = plan.return_token_ids.then(|| prompt.clone());
    let (tx, mut rx) = unbounded_channel();
    app.submit(Job {
        prompt,
        turn: TurnOptions {
            max_tokens: Some(plan.max_tokens),
            sampling: plan.sampling,
            declared_functions: Vec::new(),
            stop: Vec::new(),
            grammar: None,
        },
        output: Output::Raw(plan.text),
        events: tx,
        queued_at: Instant::now(),
    })?;
    let meta = completions::CompletionMeta {
        id: new_id("cmpl-"),
        created: unix_now(),
        model: app.model_id.clone(),
        include_usage: plan.include_usage,
    };
    if plan.stream {
        let stream = completions::CompletionStream::new(rx, meta, echo);
        let mut response = Sse::new(stream).keep_alive(KeepAlive::new().interval(KEEP_ALIVE)).into_response();
        response.extensions_mut().insert(StreamNote);
        return Ok(response);
    }
    let mut text = echo.unwrap_or_default();
    let finished = loop {
        match rx.recv().await {
            Some(WorkerMsg::Done(result)) => break result.map_err(failure_error)?,
            Some(WorkerMsg::Piece(Piece::Content(piece))) => text.push_str(&piece),
            // A raw job sends only content (see `raw::complete_raw`), and no log
            // probabilities (refused on this endpoint).
            Some(
                WorkerMsg::Piece(Piece::Reasoning(_) | Piece::ToolCall { .. })
                | WorkerMsg::Started
                | WorkerMsg::Logprobs(_),
            ) => {}
            None => return Err(ApiError::unavailable(ENGINE_GONE)),
        }
    };
    let (finish_reason, usage) = completions::ending(&finished);
    let choice = completions::TextChoice {
        text,
        index: 0,
        logprobs: None,
        finish_reason: Some(finish_reason),
        token_ids: plan.return_token_ids.then_some(finished.tokens),
    };
    let mut completion = meta.completion(vec![choice], Some(usage));
    completion.prompt_token_ids = prompt_token_ids;
    let mut response = axum::Json(completion).into_response();
    response.extensions_mut().insert(TokenNote(usage));
    Ok(response)
}

/// Renders a conversation off the async workers and checks that it leaves room for an
/// answer; `param` names the request field a refusal is about.
/// Compiles the output grammar of a request, if it has one (one that only polices tool
/// calls only with `tool_grammar`), off the async workers (the first one also builds the
/// vocabulary's token trie).
///
/// Grammars are built over o200k_harmony and Harmony's channels: a ChatML model gets no
/// grammar for `auto`/`none` tool choices, and a 400 for what needs one.
async fn compile_grammar(
    format: &ChatFormat,
    structured: Option<Structured>,
    vocab_size: usize,
    tool_grammar: bool,
) -> Result<Option<Arc<Grammar>>, ApiError> {
    let Some(structured) = structured.filter(|s| tool_grammar || !s.only_polices_tools()) else {
        return Ok(None);
    };
    match format {
        ChatFormat::Harmony(_) => {}
        ChatFormat::ChatMl(_) if structured.only_polices_tools() => return Ok(None),
        ChatFormat::ChatMl(_) => {
            return Err(ApiError::invalid(
                None,
                "`response_format` (json_object or json_schema) and `tool_choice` \"required\" or a named \
                 function need constrained decoding, which this server has only for Harmony (GPT-OSS) \
                 models; this model speaks ChatML",
            ));
        }
    }
    tokio::task::spawn_blocking(move || structured.compile(vocab_size))
        .await
        .map_err(|e| ApiError::server(format!("compiling the output grammar failed: {e}")))?
        .map(Some)
}

async fn render_checked(
    app: &App,
    conversation: crate::chat::Conversation,
    capacity: usize,
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    let format = app.format.clone();
    let prompt = tokio::task::spawn_blocking(move || render_prompt(&format, &conversation))
        .await
        .map_err(|e| ApiError::server(format!("rendering the prompt failed: {e}")))?
        .map_err(|e| ApiError::invalid(Some(param), format!("the conversation cannot be rendered: {e}")))?;
    if prompt.len() >= capacity {
        let mut e = ApiError::context_length(format!(
            "the prompt is {} tokens, but the context holds {} tokens and at least one must be left \
             for the answer",
            prompt.len(),
            capacity
        ));
        e.param = Some(param.into());
        return Err(e);
    }
    Ok(prompt)
}

async fn create_response(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    respond(app, headers, body).await.unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/responses`: checks the request, rebuilds the conversation of its
/// `previous_response_id`, renders and queues it, and answers with the response object or
/// a stream of typed events; stores the finished response unless `store` is false.
async fn respond(app: Arc<App>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let (capacity, vocab_size) = (app.engine()?.capacity, app.engine()?.vocab_size);
    let bytes = read_body_in_time(&headers, body, app.max_body_bytes, app.body_timeout).await?;
    let request: ResponsesRequest = convert::parse_json(&bytes)?;
    let plan = {
        let store = app.responses.lock().map_err(|_| ApiError::server("the response store is poisoned"))?;
        let history = |id: &str| store.history(id);
        responses_api::plan(request, &history, &today_utc(), rand::random())?
    };
    let grammar = compile_grammar(&app.format, plan.structured.clone(), vocab_size, app.tool_grammar).await?;
    let prompt = render_checked(&app, plan.conversation, capacity, "input").await?;
    let (tx, mut rx) = unbounded_channel();
    app.submit(Job {
        prompt,
        turn: TurnOptions {
            max_tokens: plan.max_tokens,
            sampling: plan.sampling,
            declared_functions: plan.declared_functions,
            // The Responses API has no stop strings.
            stop: Vec::new(),
            grammar,
        },
        output: Output::Harmony,
        events: tx,
        queued_at: Instant::now(),
    })?;
    let store = plan.echo.store;
    let meta = ResponseMeta {
        id: new_id("resp_"),
        created_at: unix_now(),
        model: app.model_id.clone(),
        echo: plan.echo,
    };
    let mut output = OutputBuilder::new(new_id);
    if plan.stream {
        let keep = store.then(|| (Arc::clone(&app.responses), plan.added));
        let stream = ResponseStream::new(rx, meta, output, app.format.clone(), keep);
        let mut response = Sse::new(stream).keep_alive(KeepAlive::new().interval(KEEP_ALIVE)).into_response();
        response.extensions_mut().insert(StreamNote);
        return Ok(response);
    }
    let mut steps = Vec::new();
    let finished = loop {
        match rx.recv().await {
            Some(WorkerMsg::Done(result)) => break result.map_err(failure_error)?,
            Some(WorkerMsg::Logprobs(entries)) => output.push_logprobs(entries),
            Some(WorkerMsg::Piece(piece)) => {
                output.push(piece, &mut steps);
                steps.clear();
            }
            Some(WorkerMsg::Started) => {}
            None => return Err(ApiError::unavailable(ENGINE_GONE)),
        }
    };
    let last = responses_api::last_item_status(finished.stop);
    output.close(last, &mut steps);
    let usage = responses_api::usage(&app.format, &finished);
    let object = meta.object(output.output(last), Ending::Finished(&finished, usage));
    if store {
        let entry = responses_api::stored(&object, plan.added, &output);
        if let Ok(mut responses) = app.responses.lock() {
            responses.insert(object.id.clone(), entry);
        }
    }
    let mut response = axum::Json(object).into_response();
    response.extensions_mut().insert(TokenNote(Usage::new(
        usage.input_tokens,
        usage.input_tokens_details.cached_tokens,
        usage.output_tokens,
    )));
    Ok(response)
}

/// `POST /tokenize`: the token IDs of a text or a conversation.
async fn tokenize(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let answer = async {
        let capacity = app.engine()?.capacity;
        let bytes = read_body_in_time(&headers, body, app.max_body_bytes, app.body_timeout).await?;
        let format = app.format.clone();
        let tokens = tokio::task::spawn_blocking(move || super::tokens::tokenize(&format, &bytes))
            .await
            .map_err(|e| ApiError::server(format!("tokenizing failed: {e}")))??;
        Ok::<_, ApiError>(axum::Json(super::tokens::TokenizeResponse {
            count: tokens.len(),
            max_model_len: capacity,
            tokens,
        }))
    };
    answer.await.map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}

/// `POST /detokenize`: the text of token IDs.
async fn detokenize(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let answer = async {
        app.engine()?;
        let bytes = read_body_in_time(&headers, body, app.max_body_bytes, app.body_timeout).await?;
        let format = app.format.clone();
        let prompt = tokio::task::spawn_blocking(move || super::tokens::detokenize(&format, &bytes))
            .await
            .map_err(|e| ApiError::server(format!("detokenizing failed: {e}")))??;
        Ok::<_, ApiError>(axum::Json(super::tokens::DetokenizeResponse { prompt }))
    };
    answer.await.map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}

/// `GET /metrics`: the counters in the Prometheus text format.
async fn metrics(State(app): State<Arc<App>>) -> Response {
    let stored = app.responses.lock().map_or(0, |s| s.len());
    let text = super::metrics::render(&app.counters, stored);
    ([(header::CONTENT_TYPE, super::metrics::CONTENT_TYPE)], text).into_response()
}

/// The 404 for a response ID that is not stored.
fn response_not_found(id: &str) -> ApiError {
    let mut e = ApiError::not_found(format!(
        "no stored response has the ID {id:?} (it was not stored, was deleted, or was dropped)"
    ));
    e.param = Some("response_id".into());
    e
}

/// `GET /v1/responses/{id}`: a stored response object.
async fn get_response(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    let found = app.responses.lock().ok().and_then(|store| store.get(&id).cloned());
    match found {
        Some(object) => axum::Json(object).into_response(),
        None => response_not_found(&id).into_response(),
    }
}

/// `GET /v1/responses/{id}/input_items`: a page of a stored response's input items.
async fn list_input_items(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    let answer = || {
        let query = super::input_items::parse_query(query.as_deref())?;
        let store = app.responses.lock().map_err(|_| ApiError::server("the response store is poisoned"))?;
        let items = store.input_items(&id).ok_or_else(|| response_not_found(&id))?;
        super::input_items::page(items, &query)
    };
    answer().map_or_else(IntoResponse::into_response, |page| axum::Json(page).into_response())
}

/// `DELETE /v1/responses/{id}`: forgets a stored response.
async fn delete_response(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    let removed = app.responses.lock().is_ok_and(|mut store| store.remove(&id));
    if removed {
        axum::Json(serde_json::json!({"id": id, "object": "response.deleted", "deleted": true}))
            .into_response()
    } else {
        response_not_found(&id).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_compare_exactly() {
        assert!(same_key(b"secret", b"secret"));
        assert!(!same_key(b"secret", b"secreT"));
        assert!(!same_key(b"secret", b"secret2"));
        assert!(!same_key(b"", b"x"));
    }

    #[test]
    fn ids_are_random() {
        let a = new_id("chatcmpl-");
        assert!(a.starts_with("chatcmpl-") && a.len() == 9 + 24);
        assert_ne!(a, new_id("chatcmpl-"));
    }
}
