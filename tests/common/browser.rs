//! Headless Chromium driven over the DevTools protocol (a WebSocket, through `tungstenite`):
//! enough to load a page, type and press keys, evaluate JavaScript, wait for a condition and
//! take a screenshot.

use std::io::ErrorKind;
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{Value, json};
use tungstenite::{Message, WebSocket};

/// The Chromium to run: `$PICCHIO_CHROMIUM`, else the first of `chromium`,
/// `chromium-browser`, `google-chrome` on the `PATH`; `None` if there is none.
pub fn find_chromium() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("PICCHIO_CHROMIUM") {
        return Some(PathBuf::from(path));
    }
    let dirs = std::env::var_os("PATH")?;
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .flat_map(|name| std::env::split_paths(&dirs).map(move |d| d.join(name)))
        .find(|p| p.is_file())
}

/// A headless Chromium with its own profile; killed when dropped.
pub struct Browser {
    child: Child,
    port: u16,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// Starts `chromium` headless on a free DevTools port, with a `width` x `height` window.
    pub fn launch(chromium: &std::path::Path, width: u32, height: u32) -> Browser {
        let profile = tempfile::tempdir().unwrap();
        let child = Command::new(chromium)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-background-networking",
                "--remote-debugging-port=0",
                &format!("--window-size={width},{height}"),
                &format!("--user-data-dir={}", profile.path().display()),
                "about:blank",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", chromium.display()));
        // Chromium writes the port it chose to DevToolsActivePort in its profile.
        let active = profile.path().join("DevToolsActivePort");
        let deadline = Instant::now() + Duration::from_secs(60);
        let port = loop {
            if let Some(port) = std::fs::read_to_string(&active)
                .ok()
                .and_then(|t| t.lines().next().and_then(|l| l.trim().parse::<u16>().ok()))
            {
                break port;
            }
            assert!(Instant::now() < deadline, "chromium did not open its DevTools port within 60 s");
            std::thread::sleep(Duration::from_millis(50));
        };
        Browser { child, port, _profile: profile }
    }

    /// The first page tab, connected.
    pub fn page(&self) -> Page {
        let agent: ureq::Agent =
            ureq::Agent::config_builder().timeout_global(Some(Duration::from_secs(10))).build().into();
        let deadline = Instant::now() + Duration::from_secs(30);
        let url = loop {
            let text = agent
                .get(format!("http://127.0.0.1:{}/json/list", self.port))
                .call()
                .unwrap()
                .body_mut()
                .read_to_string()
                .unwrap();
            let list: Value = serde_json::from_str(&text).unwrap();
            let page = list.as_array().and_then(|targets| {
                targets.iter().find(|t| t["type"] == "page").and_then(|t| t["webSocketDebuggerUrl"].as_str())
            });
            if let Some(url) = page {
                break url.to_string();
            }
            assert!(Instant::now() < deadline, "chromium has no page target: {list}");
            std::thread::sleep(Duration::from_millis(50));
        };
        Page::connect(&url)
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One tab over its DevTools WebSocket.
pub struct Page {
    ws: WebSocket<TcpStream>,
    next_id: u64,
}

/// How long one DevTools command may take.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

impl Page {
    fn connect(url: &str) -> Page {
        let addr = url.trim_start_matches("ws://").split('/').next().unwrap().to_string();
        let stream = TcpStream::connect(&addr).unwrap();
        stream.set_read_timeout(Some(COMMAND_TIMEOUT)).unwrap();
        let (ws, _) = tungstenite::client(url, stream).unwrap();
        Page { ws, next_id: 1 }
    }

    /// Sends a DevTools command and returns its result (events in between are dropped).
    pub fn call(&mut self, method: &str, params: Value) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        let text = json!({"id": id, "method": method, "params": params}).to_string();
        self.ws.send(Message::text(text)).unwrap();
        loop {
            let message = match self.ws.read() {
                Ok(m) => m,
                Err(tungstenite::Error::Io(e))
                    if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) =>
                {
                    panic!("DevTools command {method} got no answer within {COMMAND_TIMEOUT:?}")
                }
                Err(e) => panic!("DevTools connection failed during {method}: {e}"),
            };
            let Message::Text(text) = message else { continue };
            let reply: Value = serde_json::from_str(text.as_str()).unwrap();
            if reply["id"] == id {
                assert!(reply.get("error").is_none(), "{method} failed: {}", reply["error"]);
                return reply["result"].clone();
            }
        }
    }

    /// Loads `url` and waits until its document has loaded. The old document is marked
    /// first, so that a reload of the same URL is not mistaken for the page before it.
    pub fn navigate(&mut self, url: &str) {
        self.eval("window.__leaving = true");
        self.call("Page.navigate", json!({"url": url}));
        self.wait_for("!window.__leaving && document.readyState === 'complete'", 30);
    }

    /// The value of a JavaScript expression (promises awaited); panics on an exception.
    pub fn eval(&mut self, expression: &str) -> Value {
        let result = self.call(
            "Runtime.evaluate",
            json!({"expression": expression, "awaitPromise": true, "returnByValue": true}),
        );
        if let Some(e) = result.get("exceptionDetails") {
            panic!("{expression} threw: {e}");
        }
        result["result"]["value"].clone()
    }

    /// Evaluates `expression` every 50 ms until it is truthy and returns that value; after
    /// `seconds`, panics showing the page's text.
    pub fn wait_for(&mut self, expression: &str, seconds: u64) -> Value {
        let deadline = Instant::now() + Duration::from_secs(seconds);
        loop {
            let v = self.eval(&format!(
                "(() => {{ try {{ return ({expression}); }} catch (_) {{ return null; }} }})()"
            ));
            let truthy = match &v {
                Value::Null => false,
                Value::Bool(b) => *b,
                Value::String(s) => !s.is_empty(),
                Value::Number(n) => n.as_f64() != Some(0.0),
                _ => true,
            };
            if truthy {
                return v;
            }
            if Instant::now() > deadline {
                let text = self.eval("document.body ? document.body.innerText : ''");
                panic!(
                    "waited {seconds} s for {expression}; the page shows:\n{}",
                    text.as_str().unwrap_or("")
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Types `text` into the focused element.
    pub fn insert_text(&mut self, text: &str) {
        self.call("Input.insertText", json!({"text": text}));
    }

    /// Presses and releases a key: `Enter` or `Escape`, with `shift` held or not.
    pub fn press(&mut self, key: &str, shift: bool) {
        let (code, text) = match key {
            "Enter" => (13, "\r"),
            "Escape" => (27, ""),
            other => panic!("press: no key code for {other}"),
        };
        let modifiers = if shift { 8 } else { 0 };
        let down = json!({"type": "keyDown", "key": key, "code": key, "windowsVirtualKeyCode": code,
            "nativeVirtualKeyCode": code, "text": text, "unmodifiedText": text, "modifiers": modifiers});
        self.call("Input.dispatchKeyEvent", down);
        let up = json!({"type": "keyUp", "key": key, "code": key, "windowsVirtualKeyCode": code,
            "nativeVirtualKeyCode": code, "modifiers": modifiers});
        self.call("Input.dispatchKeyEvent", up);
    }

    /// A PNG of the page as it is shown.
    pub fn screenshot(&mut self) -> Vec<u8> {
        let result = self.call("Page.captureScreenshot", json!({"format": "png"}));
        base64::engine::general_purpose::STANDARD.decode(result["data"].as_str().unwrap()).unwrap()
    }
}
