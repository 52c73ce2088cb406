//! The chat page of `serve --http`: served at `/` (content type, security headers, nothing
//! from another host, no key needed for the page itself), and driven in headless Chromium
//! against a scripted model: a message sent with Enter, the streamed answer and its
//! reasoning block, a long answer stopped with Esc, a tool call and its result, a server
//! error shown, the export loaded by `picchio chat`, the API key asked for on a 401, and a
//! screenshot.
//!
//! The browser test needs Chromium (Debian: `apt-get install chromium`; or set
//! `PICCHIO_CHROMIUM`). Without one it prints SKIPPED, unless `PICCHIO_REQUIRE_BROWSER=1`
//! (as in CI) makes it fail. `PICCHIO_WEBUI_SCREENSHOT=docs/webui.png` and
//! `PICCHIO_WEBUI_SCREENSHOT_DARK=docs/webui-dark-narrow.png` write its screenshots there
//! (it always writes them under the target directory).

mod common;

use std::time::{Duration, Instant};

use picchio::chat::{Conversation, Role, Tokenizer};
use picchio::serve::http::{HttpOptions, ServerHandle, serve, start};
use picchio::session::Session;
use serde_json::Value;

use common::browser::{Browser, Page, find_chromium};
use common::scripted::{
    AFTER_TOOL_ANSWER, ANSWER, DEFAULT_REPLY, ENDLESS_FILLER, REASONING, Scripted, TOOL_ARGUMENTS,
};

const CAPACITY: usize = 4096;

fn listener() -> std::net::TcpListener {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap()
}

fn scripted_server(delay: Duration, options: HttpOptions) -> ServerHandle {
    serve(listener(), Session::new(Box::new(Scripted::new(CAPACITY, delay))), options).unwrap()
}

/// A CPU session over the model in `dir` with a 512-token context.
fn real_session(dir: &std::path::Path) -> Session {
    use picchio::engine::{self, OpenOptions, RunOptions};
    let model = engine::open(dir, &OpenOptions { ctx: 512, ..Default::default() }).unwrap();
    Session::new(
        engine::cpu_runner(&model, &RunOptions { ctx: 512, max_batch: 64, ..Default::default() }).unwrap(),
    )
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(30)))
        .build()
        .into()
}

/// GETs `path`: the status, the headers that matter here, and the body.
fn get(url: &str, path: &str, key: Option<&str>) -> (u16, String, String, String) {
    let mut req = agent().get(format!("{url}{path}"));
    if let Some(k) = key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let mut resp = req.call().unwrap();
    let header =
        |name: &str| resp.headers().get(name).map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
    let (content_type, csp) = (header("content-type"), header("content-security-policy"));
    let status = resp.status().as_u16();
    (status, content_type, csp, resp.body_mut().read_to_string().unwrap())
}

// ---------------------------------------------------------------------------------------
// The page over HTTP.

#[test]
fn the_page_is_served_at_the_root_with_its_assets() {
    let server = scripted_server(Duration::ZERO, HttpOptions::new("scripted"));
    let url = server.url();
    let (status, content_type, csp, html) = get(&url, "/", None);
    assert_eq!(status, 200);
    assert_eq!(content_type, "text/html; charset=utf-8");
    assert!(html.starts_with("<!doctype html>") && html.contains("<title>Picchio</title>"), "{html}");
    assert!(csp.contains("default-src 'none'") && csp.contains("connect-src 'self'"), "{csp}");
    for (path, kind, marker) in [
        ("/webui/app.js", "text/javascript; charset=utf-8", "/v1/chat/completions"),
        ("/webui/style.css", "text/css; charset=utf-8", "prefers-color-scheme: dark"),
    ] {
        assert!(html.contains(path), "the page does not load {path}");
        let (status, content_type, _, body) = get(&url, path, None);
        assert_eq!((status, content_type.as_str()), (200, kind), "{path}");
        assert!(body.contains(marker), "{path} lacks {marker}");
        // Offline: nothing is fetched from another host.
        for scheme in ["http://", "https://", "ws://", "wss://"] {
            assert!(!body.contains(scheme), "{path} names another host ({scheme})");
        }
    }
    for scheme in ["http://", "https://"] {
        assert!(!html.contains(scheme), "the page names another host ({scheme})");
    }
    // Other paths are still the API's 404.
    assert_eq!(get(&url, "/webui/other.js", None).0, 404);
    assert_eq!(get(&url, "/index.html", None).0, 404);
}

#[test]
fn the_page_needs_no_key_but_the_api_does() {
    let mut options = HttpOptions::new("scripted");
    options.api_key = Some("sesame".into());
    let server = scripted_server(Duration::ZERO, options);
    let url = server.url();
    for path in ["/", "/webui/app.js", "/webui/style.css"] {
        assert_eq!(get(&url, path, None).0, 200, "{path} without a key");
    }
    assert_eq!(get(&url, "/v1/models", None).0, 401);
    assert_eq!(get(&url, "/v1/models", Some("wrong")).0, 401);
    assert_eq!(get(&url, "/v1/models", Some("sesame")).0, 200);
    // Only the page's GETs are open: any other method on its paths needs the key too.
    let resp = agent().post(format!("{url}/")).send("x").unwrap();
    assert_eq!(resp.status().as_u16(), 401);
    assert_eq!(get(&url, "/webui/", None).0, 401);
}

#[test]
fn the_page_loads_while_the_model_does() {
    let server = start(listener(), HttpOptions::new("loading")).unwrap();
    let url = server.url();
    assert_eq!(get(&url, "/", None).0, 200);
    assert_eq!(get(&url, "/v1/models", None).0, 503, "the page polls this until the model is ready");
    server.shutdown();
}

// ---------------------------------------------------------------------------------------
// In a browser.

/// The text of the last element matching `selector`, as a JavaScript expression.
fn last_text(selector: &str) -> String {
    format!("[...document.querySelectorAll({selector:?})].map(e => e.textContent).pop()")
}

fn text_of(page: &mut Page, selector: &str) -> String {
    page.eval(&last_text(selector)).as_str().unwrap_or_default().to_string()
}

fn answer_length(page: &mut Page) -> usize {
    text_of(page, ".msg.assistant .answer").len()
}

#[test]
fn the_page_chats_in_a_real_browser() {
    let Some(chromium) = find_chromium() else {
        assert!(
            std::env::var_os("PICCHIO_REQUIRE_BROWSER").is_none(),
            "PICCHIO_REQUIRE_BROWSER is set but no chromium was found"
        );
        eprintln!(
            "\n*** SKIPPED the_page_chats_in_a_real_browser: no chromium on the PATH (apt-get install chromium, \
             or set PICCHIO_CHROMIUM) ***\n"
        );
        return;
    };
    // 3 ms a token: an answer streams over many chunks, the endless one for over 10 s.
    let server = scripted_server(Duration::from_millis(3), HttpOptions::new("scripted-model"));
    let browser = Browser::launch(&chromium, 1000, 1100);
    let mut page = browser.page();
    page.navigate(&server.url());
    let status = page.wait_for("document.getElementById('status').textContent.startsWith('model ') && document.getElementById('status').textContent", 30);
    assert_eq!(status, format!("model scripted-model · context {CAPACITY} tokens"));

    // Shift+Enter is a new line, not a send.
    page.eval("document.getElementById('input').focus()");
    page.insert_text("first line");
    page.press("Enter", true);
    assert_eq!(page.eval("document.getElementById('input').value"), "first line\n");
    assert_eq!(page.eval("document.querySelectorAll('.msg').length"), 0);
    page.eval("document.getElementById('input').value = ''");

    // Enter sends; the answer and the reasoning arrive, with the usage of the answer.
    page.insert_text("Hello there");
    page.press("Enter", false);
    page.wait_for(&format!("{} === {ANSWER:?}", last_text(".msg.assistant .answer")), 30);
    assert_eq!(text_of(&mut page, ".msg.user .text"), "Hello there");
    assert_eq!(page.eval("document.getElementById('input').value"), "", "the box is emptied on send");
    assert_eq!(text_of(&mut page, ".msg.assistant details.reasoning .text"), REASONING);
    assert_eq!(text_of(&mut page, ".msg.assistant details.reasoning summary"), "Reasoning");
    assert_eq!(page.eval("document.querySelector('.msg.assistant details.reasoning').hidden"), false);
    let generated = Tokenizer::new().encode_with_special(DEFAULT_REPLY).len();
    let stats = page.wait_for(&format!("{} || null", last_text(".msg.assistant .stats")), 10);
    let stats = stats.as_str().unwrap();
    assert!(stats.contains("(0 cached)") && stats.contains(&format!("· {generated} generated ·")), "{stats}");
    assert!(stats.contains("prefill ") && stats.contains("decode "), "{stats}");
    let prompt: usize = stats.split(' ').next().unwrap().parse().unwrap();
    let status = page.wait_for("document.getElementById('status').textContent.includes(' / ') && document.getElementById('status').textContent", 10);
    assert_eq!(status, format!("model scripted-model · context {} / {CAPACITY} tokens", prompt + generated));

    // A long answer streams (it grows while the stop button shows) until Esc stops it.
    page.insert_text("Please go on forever");
    page.press("Enter", false);
    page.wait_for(
        &format!("({} || '').includes('{ENDLESS_FILLER}{ENDLESS_FILLER}')", last_text(".answer")),
        30,
    );
    assert_eq!(page.eval("document.getElementById('stop').hidden"), false);
    assert_eq!(page.eval("document.getElementById('send').hidden"), true);
    let before = answer_length(&mut page);
    std::thread::sleep(Duration::from_millis(300));
    let during = answer_length(&mut page);
    assert!(during > before, "the answer did not grow while streaming ({before} then {during} bytes)");
    page.press("Escape", false);
    page.wait_for(&format!("{} === '(stopped)'", last_text(".msg.assistant .note")), 10);
    assert_eq!(page.eval("document.getElementById('send').hidden"), false);
    let stopped = answer_length(&mut page);
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.stats().cancelled == 0 {
        assert!(Instant::now() < deadline, "the server did not cancel the stopped answer");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(answer_length(&mut page), stopped, "the answer grew after the stop");

    // An earlier answer's reasoning is collapsed; its summary opens it.
    let reasoning = "document.querySelector('.msg.assistant details.reasoning')";
    assert_eq!(page.eval(&format!("{reasoning}.open")), false);
    page.eval(&format!("{reasoning}.querySelector('summary').click()"));
    assert_eq!(page.eval(&format!("{reasoning}.open")), true);
    save_screenshot(&mut page, "webui.png", "PICCHIO_WEBUI_SCREENSHOT");

    // Dark scheme and a phone's width: dark colours, nothing wider than the screen.
    page.call(
        "Emulation.setEmulatedMedia",
        serde_json::json!({"features": [{"name": "prefers-color-scheme", "value": "dark"}]}),
    );
    page.call(
        "Emulation.setDeviceMetricsOverride",
        serde_json::json!({"width": 390, "height": 760, "deviceScaleFactor": 1, "mobile": true}),
    );
    page.wait_for("getComputedStyle(document.body).backgroundColor === 'rgb(23, 24, 26)'", 10);
    assert_eq!(
        page.eval("document.documentElement.scrollWidth <= 390"),
        true,
        "the page is wider than a phone"
    );
    assert_eq!(page.eval("document.getElementById('send').getBoundingClientRect().right <= 390"), true);
    save_screenshot(&mut page, "webui-dark-narrow.png", "PICCHIO_WEBUI_SCREENSHOT_DARK");
    page.call("Emulation.clearDeviceMetricsOverride", serde_json::json!({}));
    page.call("Emulation.setEmulatedMedia", serde_json::json!({"features": []}));

    // Both turns survive a reload (localStorage).
    page.navigate(&server.url());
    page.wait_for(
        &format!("document.querySelectorAll('.msg').length === 4 && {} === '(stopped)'", last_text(".note")),
        10,
    );

    // A new chat with a tool declared: the call is shown as such, and its result answered.
    page.eval("document.getElementById('new-chat').click()");
    assert_eq!(page.eval("document.querySelectorAll('.msg').length"), 0);
    let tools = r#"[{"type": "function", "function": {"name": "get_weather", "description": "Current weather.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]"#;
    page.eval(&format!(
        "document.getElementById('tools').value = {tools:?}; document.getElementById('settings').dispatchEvent(new Event('change'))"
    ));
    page.eval("document.getElementById('input').focus()");
    page.insert_text("What is the weather in Paris?");
    page.press("Enter", false);
    page.wait_for("document.querySelector('.call form input')", 30);
    assert_eq!(text_of(&mut page, ".call strong"), "Tool call: get_weather");
    assert_eq!(text_of(&mut page, ".call code"), TOOL_ARGUMENTS);
    page.eval("document.querySelector('.call form input').value = 'Sunny, 24 C'; document.querySelector('.call form button').click()");
    page.wait_for(&format!("{} === {AFTER_TOOL_ANSWER:?}", last_text(".answer")), 30);
    assert_eq!(text_of(&mut page, ".tool-result"), "get_weather returned: Sunny, 24 C");
    page.wait_for(&format!("{} || null", last_text(".msg.assistant .stats")), 10);

    // The export is what `picchio chat` /save writes: the terminal chat loads it.
    let exported = page.eval("JSON.stringify(window.picchio.exportChat())");
    let exported: Value = serde_json::from_str(exported.as_str().unwrap()).unwrap();
    let model = common::tiny_real_vocab();
    check_export(&exported, model.path());

    // A request the server refuses: the error is shown, and the message given back.
    page.eval("document.getElementById('new-chat').click()");
    page.eval("document.getElementById('input').value = 'word '.repeat(5000); document.getElementById('send').click()");
    let error = page.wait_for(
        "!document.getElementById('error').hidden && document.getElementById('error').textContent",
        30,
    );
    let error = error.as_str().unwrap();
    assert!(error.starts_with("400: ") && error.contains("context holds 4096 tokens"), "{error}");
    assert_eq!(page.eval("document.querySelectorAll('.msg').length"), 0);
    assert_eq!(page.eval("document.getElementById('input').value.length"), 25000);
    drop(page);
    server.shutdown();

    // Behind a key: the page asks for it once, keeps it, and sends it. A real (random) model
    // this time, whose expert cache the status line reports.
    let mut options = HttpOptions::new("keyed");
    options.api_key = Some("sesame".into());
    let server = serve(listener(), real_session(model.path()), options).unwrap();
    let mut page = browser.page();
    page.navigate(&server.url());
    page.wait_for("document.getElementById('key-dialog').open", 30);
    page.eval("document.getElementById('key').focus()");
    page.insert_text("wrong");
    page.press("Enter", false);
    // A refused key is asked for again, saying so.
    page.wait_for("document.getElementById('key-dialog').open && document.querySelector('#key-dialog p').textContent.startsWith('The key was refused')", 30);
    page.eval("document.getElementById('key').focus()");
    page.insert_text("sesame");
    page.press("Enter", false);
    page.wait_for("document.getElementById('status').textContent.startsWith('model keyed')", 30);
    assert_eq!(page.eval("localStorage.getItem('picchio.apiKey')"), "sesame");
    page.eval("document.getElementById('max-tokens').value = '12'; document.getElementById('settings').dispatchEvent(new Event('change'))");
    page.eval("document.getElementById('input').focus()");
    page.insert_text("Hello behind a key");
    page.press("Enter", false);
    let stats = page.wait_for(&format!("{} || null", last_text(".msg.assistant .stats")), 60);
    let stats = stats.as_str().unwrap();
    let generated: usize = stats.split(" · ").nth(1).and_then(|g| g.split(' ').next()?.parse().ok()).unwrap();
    assert!((1..=12).contains(&generated), "max tokens 12 was not applied: {stats}");
    let status = page.wait_for("document.getElementById('status').textContent.includes('expert cache') && document.getElementById('status').textContent", 10);
    assert!(status.as_str().unwrap().ends_with("% hits"), "{status}");
    assert_eq!(page.eval("document.getElementById('key-dialog').open"), false, "the key was asked for again");
    server.shutdown();
}

/// Takes a screenshot into the target directory, and to the path in `$env` when it is set.
fn save_screenshot(page: &mut Page, name: &str, env: &str) {
    let shot = page.screenshot();
    assert!(shot.starts_with(b"\x89PNG"), "the screenshot is not a PNG");
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::write(&out, &shot).unwrap();
    if let Some(path) = std::env::var_os(env) {
        std::fs::write(&path, &shot).unwrap();
    }
    eprintln!("screenshot: {}", out.display());
}

/// Checks the page's export of the tool conversation: its Harmony messages, and that
/// `picchio chat` loads it with `/load`.
fn check_export(exported: &Value, model: &std::path::Path) {
    assert_eq!(exported["format"], "picchio-chat/1");
    assert_eq!(exported["settings"]["reasoning"], "medium");
    let conversation = Conversation::from_json(&exported["conversation"].to_string()).unwrap();
    let shape: Vec<(Role, Option<&str>, Option<&str>, String)> = conversation
        .messages
        .iter()
        .map(|m| (m.role, m.channel.as_deref(), m.recipient.as_deref(), m.text()))
        .collect();
    let tail = &shape[2..];
    assert_eq!(shape[0].0, Role::System);
    assert!(conversation.has_function_tools(), "the developer message lacks the tool");
    assert_eq!(tail[0], (Role::User, None, None, "What is the weather in Paris?".to_string()), "{shape:?}");
    assert_eq!(tail[1].1, Some("analysis"), "{shape:?}");
    assert_eq!(
        tail[2],
        (Role::Assistant, Some("commentary"), Some("functions.get_weather"), TOOL_ARGUMENTS.into())
    );
    assert_eq!(tail[3], (Role::Tool, Some("commentary"), Some("assistant"), "Sunny, 24 C".into()));
    assert_eq!(tail[4], (Role::Assistant, Some("final"), None, AFTER_TOOL_ANSWER.into()));

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("chat.json");
    std::fs::write(&file, serde_json::to_vec_pretty(exported).unwrap()).unwrap();
    let cmd = format!("{} -q chat -m {} --ctx 512", env!("CARGO_BIN_EXE_picchio"), model.display());
    let mut p = expectrl::spawn(cmd).expect("spawn picchio chat in a pty");
    p.set_expect_timeout(Some(Duration::from_secs(60)));
    use expectrl::Expect;
    p.expect(">>> ").expect("first prompt");
    p.send_line(format!("/load {}", file.display())).unwrap();
    p.expect(format!("(loaded {} messages from", conversation.messages.len()).as_str())
        .expect("picchio chat loads the export");
    p.send_line("/exit").unwrap();
    p.expect(expectrl::Eof).expect("exit");
}
