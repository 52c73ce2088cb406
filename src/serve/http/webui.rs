//! The chat page: `GET /` (the HTML), `GET /webui/app.js` and `GET /webui/style.css`, embedded
//! in the binary. The page speaks the server's own `/v1/chat/completions`, so it needs nothing
//! else; its Content-Security-Policy lets it load and connect to this server only.
//!
//! These three paths need no API key (like `/health`): the page holds no data and must load
//! to ask for the key, which it then sends with every API request.

use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

/// The page's HTML.
const INDEX_HTML: &str = include_str!("webui/index.html");
/// The page's script.
const APP_JS: &str = include_str!("webui/app.js");
/// The page's style sheet.
const STYLE_CSS: &str = include_str!("webui/style.css");

/// The path of the script.
pub(crate) const APP_JS_PATH: &str = "/webui/app.js";
/// The path of the style sheet.
pub(crate) const STYLE_CSS_PATH: &str = "/webui/style.css";

/// Everything from this server, nothing inline, nothing from elsewhere.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self' data:; form-action 'none'; base-uri 'none'; frame-ancestors 'none'";

/// Whether `path` is one of the page's own paths, which need no API key.
pub(crate) fn is_page_path(path: &str) -> bool {
    matches!(path, "/" | APP_JS_PATH | STYLE_CSS_PATH)
}

/// `body` with its content type and the page's security headers. `no-cache`: a browser
/// revalidates, so a new binary's page is used at once.
fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
            (header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff")),
            (header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CONTENT_SECURITY_POLICY)),
            (header::REFERRER_POLICY, HeaderValue::from_static("no-referrer")),
        ],
        body,
    )
        .into_response()
}

/// `GET /`: the chat page.
pub(crate) async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX_HTML)
}

/// `GET /webui/app.js`.
pub(crate) async fn app_js() -> Response {
    asset("text/javascript; charset=utf-8", APP_JS)
}

/// `GET /webui/style.css`.
pub(crate) async fn style_css() -> Response {
    asset("text/css; charset=utf-8", STYLE_CSS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_names_its_assets_and_no_other_host() {
        assert!(INDEX_HTML.contains(&format!("src=\"{APP_JS_PATH}\"")));
        assert!(INDEX_HTML.contains(&format!("href=\"{STYLE_CSS_PATH}\"")));
        for (name, text) in [("index.html", INDEX_HTML), ("app.js", APP_JS), ("style.css", STYLE_CSS)] {
            for scheme in ["http://", "https://", "//cdn", "ws://", "wss://"] {
                assert!(!text.contains(scheme), "{name} names another host ({scheme})");
            }
        }
    }

    #[test]
    fn only_the_page_paths_skip_the_key() {
        assert!(is_page_path("/") && is_page_path("/webui/app.js") && is_page_path("/webui/style.css"));
        assert!(!is_page_path("/webui/") && !is_page_path("/v1/models") && !is_page_path("/index.html"));
    }
}
