//! Cross-origin requests, off by default: with `--cors ORIGIN` (or `*`), a browser page
//! from that origin may call the API. Preflights (`OPTIONS` with
//! `Access-Control-Request-Method`) from the origin are answered 204 before the API key
//! check (a browser sends them without credentials); other requests from it get
//! `Access-Control-Allow-Origin` on their answer. Requests from other origins get no CORS
//! headers, so the browser keeps them from the page.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::routes::App;

/// The methods the API answers.
const METHODS: &str = "GET, POST, DELETE, OPTIONS";

/// The request headers a page may send when its preflight names none.
const HEADERS: &str = "authorization, content-type";

/// How long a browser may cache a preflight answer, in seconds.
const MAX_AGE: &str = "600";

/// Whether a request's `Origin` is the allowed one (`*` allows every origin).
pub(crate) fn allowed(allow: &str, origin: &HeaderValue) -> bool {
    allow == "*" || origin.as_bytes() == allow.as_bytes()
}

/// The CORS middleware: a no-op unless the server has an allowed origin.
pub(crate) async fn cors(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let Some(allow) = app.cors_origin.as_deref() else { return next.run(req).await };
    let Some(origin) = req.headers().get(header::ORIGIN).cloned().filter(|o| allowed(allow, o)) else {
        return next.run(req).await;
    };
    let preflight =
        req.method() == Method::OPTIONS && req.headers().contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    let mut response = if preflight {
        let requested = req.headers().get(header::ACCESS_CONTROL_REQUEST_HEADERS).cloned();
        let mut r = StatusCode::NO_CONTENT.into_response();
        let h = r.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static(METHODS));
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            requested.unwrap_or_else(|| HeaderValue::from_static(HEADERS)),
        );
        h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static(MAX_AGE));
        r
    } else {
        next.run(req).await
    };
    let h = response.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.append(header::VARY, HeaderValue::from_static("origin"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_match_exactly_or_by_star() {
        let o = HeaderValue::from_static("http://localhost:3000");
        assert!(allowed("http://localhost:3000", &o));
        assert!(allowed("*", &o));
        assert!(!allowed("http://localhost:3001", &o));
        assert!(!allowed("http://localhost:3000/", &o));
    }
}
