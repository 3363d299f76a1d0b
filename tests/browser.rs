//! The live seat map, `GET /ui/shows/{show}`, in a real browser: headless
//! Chromium driven by chromedriver over the W3C WebDriver HTTP protocol.
//! Two pages of one show follow each other's holds, releases, sales and
//! expiries through the event stream, each within its bound; a screenshot
//! of one page is left in `target/seatmap.png` for a human. And `seathold
//! dev` prints the page's URL unless `--ui off`.
//!
//! Needs `chromium` and `chromedriver` on PATH (Debian/Ubuntu: `apt-get
//! install chromium chromium-driver`); without them the tests fail saying
//! so, they never skip.

mod common;

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use serde_json::{json, Value};

const INSTALL: &str = "the browser tests need Chromium and chromedriver on PATH: \
     `sudo apt-get install chromium chromium-driver` on Debian/Ubuntu";

/// The key of an element reference in WebDriver answers.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A chromedriver on a free loopback port, in a process group of its own:
/// dropping it kills that group, so no browser outlives the test.
struct ChromeDriver {
    child: Child,
    addr: SocketAddr,
    browser: PathBuf,
    http: reqwest::Client,
}

impl ChromeDriver {
    async fn start() -> Self {
        let driver = common::on_path(&["chromedriver"])
            .unwrap_or_else(|| panic!("no chromedriver on PATH; {INSTALL}"));
        let browser = common::on_path(&["chromium", "chromium-browser"])
            .unwrap_or_else(|| panic!("no chromium on PATH; {INSTALL}"));
        let addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let child = Command::new(driver)
            .arg(format!("--port={}", addr.port()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start chromedriver: {e}; {INSTALL}"));
        let driver = Self {
            child,
            addr,
            browser,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(60))
                .build()
                .expect("http client"),
        };
        let status = format!("http://{addr}/status");
        common::eventually(Duration::from_secs(20), "chromedriver ready", || async {
            match driver.http.get(&status).send().await {
                Ok(r) => r
                    .json::<Value>()
                    .await
                    .is_ok_and(|v| v["value"]["ready"] == true),
                Err(_) => false,
            }
        })
        .await;
        driver
    }

    /// A new browser with a profile of its own: pages of two sessions share
    /// no storage, as two customers would not.
    async fn session(&self) -> Browser {
        let profile = tempfile::tempdir().expect("profile dir");
        let args = [
            "--headless=new".to_owned(),
            "--no-sandbox".to_owned(),
            "--disable-gpu".to_owned(),
            "--disable-dev-shm-usage".to_owned(),
            "--disable-background-networking".to_owned(),
            "--disable-component-update".to_owned(),
            "--disable-sync".to_owned(),
            "--no-first-run".to_owned(),
            "--window-size=1100,720".to_owned(),
            format!("--user-data-dir={}", profile.path().display()),
        ];
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": self.browser, "args": args},
            "goog:loggingPrefs": {"browser": "ALL"},
        }}});
        let resp = self
            .http
            .post(format!("http://{}/session", self.addr))
            .json(&caps)
            .send()
            .await
            .expect("new session");
        let status = resp.status();
        let body: Value = resp.json().await.expect("new session answer");
        let id = body["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| {
                panic!("chromedriver started no browser ({status}): {body}; {INSTALL}")
            })
            .to_owned();
        Browser {
            http: self.http.clone(),
            addr: self.addr,
            url: format!("http://{}/session/{id}", self.addr),
            id,
            open: true,
            _profile: profile,
        }
    }
}

impl Drop for ChromeDriver {
    fn drop(&mut self) {
        // The group: chromedriver and every browser process it started.
        let _ = Command::new("/bin/sh")
            .args(["-c", &format!("kill -9 -{}", self.child.id())])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One WebDriver session: a browser with one page.
struct Browser {
    http: reqwest::Client,
    addr: SocketAddr,
    url: String,
    id: String,
    open: bool,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// A WebDriver command; answers its `value`, panics on an error.
    async fn command(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let url = if path.is_empty() {
            self.url.clone()
        } else {
            format!("{}/{path}", self.url)
        };
        let mut req = self.http.request(method.clone(), &url);
        if let Some(body) = body {
            req = req.json(&body);
        }
        let resp = req
            .send()
            .await
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let status = resp.status();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        assert!(status.is_success(), "{method} {path}: {status} {body}");
        body["value"].clone()
    }

    async fn post(&self, path: &str, body: Value) -> Value {
        self.command(reqwest::Method::POST, path, Some(body)).await
    }

    async fn goto(&self, url: &str) {
        self.post("url", json!({ "url": url })).await;
    }

    /// The element reference of the first match of `css`.
    async fn find(&self, css: &str) -> String {
        let found = self
            .post("element", json!({"using": "css selector", "value": css}))
            .await;
        found[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("no element {css}: {found}"))
            .to_owned()
    }

    async fn click(&self, css: &str) {
        let element = self.find(css).await;
        self.post(&format!("element/{element}/click"), json!({}))
            .await;
    }

    /// Runs `script` (a function body; `arguments` are `args`) in the page.
    async fn run(&self, script: &str, args: Value) -> Value {
        self.post("execute/sync", json!({"script": script, "args": args}))
            .await
    }

    /// Like [`Browser::run`], for a script that ends by calling its last
    /// argument with the result.
    async fn run_async(&self, script: &str, args: Value) -> Value {
        self.post("execute/async", json!({"script": script, "args": args}))
            .await
    }

    /// The console's error lines since the last call (CSP violations,
    /// exceptions, failed loads); chromedriver's log extension.
    async fn console_errors(&self) -> Vec<String> {
        let entries = self.post("se/log", json!({"type": "browser"})).await;
        entries
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["level"] == "SEVERE")
            .map(|e| e["message"].as_str().unwrap_or_default().to_owned())
            .collect()
    }

    async fn screenshot(&self) -> Vec<u8> {
        let png = self.command(reqwest::Method::GET, "screenshot", None).await;
        base64::engine::general_purpose::STANDARD
            .decode(png.as_str().expect("base64 PNG"))
            .expect("a PNG")
    }

    /// Ends the session; the browser quits.
    async fn quit(mut self) {
        self.command(reqwest::Method::DELETE, "", None).await;
        self.open = false;
    }
}

impl Drop for Browser {
    /// A test that failed midway still quits its browser: a plain blocking
    /// `DELETE /session/{id}`, as async code cannot run here.
    fn drop(&mut self) {
        if !self.open {
            return;
        }
        if let Ok(mut s) = std::net::TcpStream::connect_timeout(&self.addr, Duration::from_secs(2))
        {
            let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
            let _ = write!(
                s,
                "DELETE /session/{} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
                self.id, self.addr
            );
            let _ = s.read_to_end(&mut Vec::new());
        }
    }
}

/// The seat map as one page shows it.
struct Page {
    name: &'static str,
    browser: Browser,
}

impl Page {
    /// Opens `url` and waits until the page follows the show's events.
    async fn open(&self, url: &str) {
        self.browser.goto(url).await;
        self.wait_status("live", Duration::from_secs(10)).await;
    }

    async fn wait_status(&self, want: &str, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let status = self.status().await;
            if status == want {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "page {}: status {status}, not {want}, after {limit:?}; {}",
                self.name,
                self.describe().await
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    async fn wait_status_not(&self, left: &str, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.status().await == left {
            assert!(
                Instant::now() < deadline,
                "page {}: still {left} after {limit:?}",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    async fn status(&self) -> Value {
        self.browser
            .run(
                "return document.getElementById('status').dataset.state;",
                json!([]),
            )
            .await
    }

    /// Every seat's `data-state`.
    async fn states(&self) -> Value {
        self.browser
            .run(
                "return Object.fromEntries([...document.querySelectorAll('#seats .seat')]
                    .map((b) => [b.dataset.seat, b.dataset.state]));",
                json!([]),
            )
            .await
    }

    async fn state(&self, seat: &str) -> Value {
        self.browser
            .run(
                "const b = document.querySelector(`#seats [data-seat=\"${arguments[0]}\"]`);
                 return b ? b.dataset.state : null;",
                json!([seat]),
            )
            .await
    }

    /// Waits until the page's message contains `part`, at most `limit`
    /// after `since`; answers the message.
    async fn wait_message(&self, part: &str, since: Instant, limit: Duration) -> Value {
        loop {
            let message = self
                .browser
                .run(
                    "return document.getElementById('message').textContent;",
                    json!([]),
                )
                .await;
            if message.as_str().is_some_and(|m| m.contains(part)) {
                return message;
            }
            assert!(
                since.elapsed() < limit,
                "page {}: no message with {part:?} within {limit:?}; {}",
                self.name,
                self.describe().await
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Opens the seat map of `show` (with `query`) through `proxy`.
    async fn open_via(&self, proxy: &Flaky, show: &str, query: &str) {
        self.open(&format!("http://{}/ui/shows/{show}?{query}", proxy.addr))
            .await;
    }

    /// Waits until the element with id `id` has the keyboard focus.
    async fn wait_focus(&self, id: &str, limit: Duration) {
        let since = Instant::now();
        loop {
            let focused = self
                .browser
                .run(
                    "return document.activeElement && document.activeElement.id;",
                    json!([]),
                )
                .await;
            if focused == id {
                return;
            }
            assert!(
                since.elapsed() < limit,
                "page {}: focus on {focused}, not #{id}, after {limit:?}",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// What a failure message should show of the page.
    async fn describe(&self) -> String {
        let text = self
            .browser
            .run(
                "return document.getElementById('status').textContent + ' | message: '
                    + document.getElementById('message').textContent;",
                json!([]),
            )
            .await;
        format!("{text}; seats {}", self.states().await)
    }

    /// Waits until `seat` shows `want`, at most `limit` after `since`;
    /// answers the time from `since`.
    async fn wait_seat(&self, seat: &str, want: &str, since: Instant, limit: Duration) -> Duration {
        loop {
            if self.state(seat).await == want {
                return since.elapsed();
            }
            assert!(
                since.elapsed() < limit,
                "page {}: seat {seat} not {want} within {limit:?}; {}",
                self.name,
                self.describe().await
            );
            tokio::time::sleep(Duration::from_millis(15)).await;
        }
    }

    async fn click_seat(&self, seat: &str) {
        self.browser
            .click(&format!("#seats [data-seat=\"{seat}\"]"))
            .await;
    }

    /// This page's holds as it keeps them: seat -> {token, ref, expiresAt}.
    async fn kept_holds(&self, show: &str) -> Value {
        self.kept("holds", show).await
    }

    /// The keys of unanswered holds this tab keeps: key -> {id, path, …}.
    async fn kept_undos(&self, show: &str) -> Value {
        self.kept("undos", show).await
    }

    /// What the page keeps in the tab's sessionStorage under
    /// `seathold:<what>:<show>`, `{}` when nothing.
    async fn kept(&self, what: &str, show: &str) -> Value {
        let raw = self
            .browser
            .run(
                "return sessionStorage.getItem('seathold:' + arguments[0] + ':' + arguments[1]);",
                json!([what, show]),
            )
            .await;
        serde_json::from_str(raw.as_str().unwrap_or("{}")).expect("kept in sessionStorage")
    }
}

const SECOND: Duration = Duration::from_secs(1);

/// One browser test at a time: each runs a browser or two on this
/// machine's two cores, and their bounds (a seat seen within 1 s) are for a
/// browser that has them to itself.
static BROWSERS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A TCP proxy in front of the daemon that passes everything through
/// (event streams included) except the answers to the first `drops`
/// requests whose request line starts with `prefix` and ends its path with
/// `suffix`: it lets such a request reach the daemon, then closes the
/// browser's connection instead of answering, as a network that breaks at
/// the wrong moment would. The browser sees a failed fetch and cannot know
/// whether the request took effect.
struct Flaky {
    addr: SocketAddr,
    dropped: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// Set by [`Flaky::heal`]: from then on every answer goes through.
    healed: std::sync::Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

/// What [`Flaky`] does to a request it picked.
#[derive(Clone, Copy, PartialEq)]
enum Loss {
    /// Passes it on, then closes the connection instead of answering.
    Answer,
    /// Closes the connection without passing it on.
    Request,
    /// Passes it on, then answers 502 as a proxy whose upstream broke.
    BadGateway,
    /// Passes it on, and its answer this late.
    Late(Duration),
}

impl Flaky {
    async fn start(
        upstream: SocketAddr,
        (prefix, suffix): (&'static str, &'static str),
        (loss, drops): (Loss, usize),
        stream_lag: Duration,
    ) -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let addr = listener.local_addr().expect("proxy address");
        let dropped = Arc::new(AtomicUsize::new(0));
        let healed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (count, well) = (Arc::clone(&dropped), Arc::clone(&healed));
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let (count, well) = (Arc::clone(&count), Arc::clone(&well));
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (from_client, to_client) = client.into_split();
                    let (from_server, to_server) = server.into_split();
                    // Set when the request just sent is one to leave unanswered.
                    let cut = std::sync::atomic::AtomicBool::new(false);
                    // Set when this connection carries an event stream.
                    let stream = std::sync::atomic::AtomicBool::new(false);
                    let up = pump(from_client, to_server, |bytes| {
                        // Without pipelining (browsers do not pipeline), a
                        // read after an answer starts with a request line.
                        let head = String::from_utf8_lossy(&bytes[..bytes.len().min(512)]);
                        let line = head.lines().next().unwrap_or("");
                        let path = line.split(' ').nth(1).unwrap_or("");
                        if line.starts_with("GET ") && path.ends_with("/events") {
                            stream.store(true, Ordering::SeqCst);
                        }
                        if line.starts_with(prefix)
                            && path.ends_with(suffix)
                            && !well.load(Ordering::SeqCst)
                            && count
                                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |d| {
                                    (d < drops).then_some(d + 1)
                                })
                                .is_ok()
                        {
                            if loss == Loss::Request {
                                return Step::Stop;
                            }
                            cut.store(true, Ordering::SeqCst);
                        }
                        Step::Pass(Duration::ZERO)
                    });
                    // Once the daemon answers a cut request, the browser
                    // never hears it; an event stream comes `stream_lag`
                    // late.
                    let down = pump(from_server, to_client, |_| {
                        if cut.load(Ordering::SeqCst) {
                            match loss {
                                Loss::BadGateway => Step::Instead(BAD_GATEWAY),
                                Loss::Late(by) => Step::Pass(by),
                                _ => Step::Stop,
                            }
                        } else if stream.load(Ordering::SeqCst) {
                            Step::Pass(stream_lag)
                        } else {
                            Step::Pass(Duration::ZERO)
                        }
                    });
                    // Whichever side ends first closes both connections.
                    tokio::select! {
                        () = up => {}
                        () = down => {}
                    }
                });
            }
        });
        Self {
            addr,
            dropped,
            healed,
            task,
        }
    }

    fn dropped(&self) -> usize {
        self.dropped.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The network works again: no answer is lost from now on.
    fn heal(&self) {
        self.healed.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// What [`pump`] does with what it read.
enum Step {
    /// Passes it on after this delay.
    Pass(Duration),
    /// Sends this instead, and ends.
    Instead(&'static [u8]),
    /// Ends.
    Stop,
}

/// What a proxy answers when its upstream broke.
const BAD_GATEWAY: &[u8] =
    b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";

/// Copies what `from` reads to `to` as `pass` says, until either side ends
/// or `pass` ends it.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut pass: impl FnMut(&[u8]) -> Step,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        match pass(&buf[..n]) {
            Step::Pass(delay) => tokio::time::sleep(delay).await,
            Step::Instead(bytes) => {
                let _ = to.write_all(bytes).await;
                return;
            }
            Step::Stop => return,
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

impl Drop for Flaky {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pages_follow_one_show_live() {
    let _alone = BROWSERS.lock().await;
    let started = Instant::now();
    // The test cluster starts on a thread while the browsers start.
    let cluster = tokio::task::spawn_blocking(|| {
        common::cluster();
    });
    let driver = ChromeDriver::start().await;
    let (a, b) = tokio::join!(driver.session(), driver.session());
    eprintln!("two browsers after {:?}", started.elapsed());
    cluster.await.expect("the test cluster");
    let server = common::server_with(common::options()).await;
    let show = common::show("ui");
    let map = format!("{}/ui/shows/{show}?rows=3&cols=6", server.base);
    let a = Page {
        name: "A",
        browser: a,
    };
    let b = Page {
        name: "B",
        browser: b,
    };
    tokio::join!(a.open(&map), b.open(&map));
    let seats: Vec<String> = "ABC"
        .chars()
        .flat_map(|r| (1..=6).map(move |c| format!("{r}{c}")))
        .collect();
    let all_free: serde_json::Map<String, Value> =
        seats.iter().map(|s| (s.clone(), json!("free"))).collect();
    assert_eq!(a.states().await, Value::Object(all_free.clone()));
    assert_eq!(b.states().await, Value::Object(all_free));
    eprintln!("two pages live after {:?}", started.elapsed());

    // A click in A holds the seat: held by me in A, held in B. Each time is
    // taken once the WebDriver made the click (its round trips are not the
    // page's).
    a.click_seat("A1").await;
    let click = Instant::now();
    let in_a = a.wait_seat("A1", "mine", click, SECOND).await;
    let in_b = b.wait_seat("A1", "held", click, SECOND).await;
    eprintln!("hold: mine in A after {in_a:?}, held in B after {in_b:?}");
    // The token A keeps is the daemon's, and A's ref of it is the one events
    // carry, from crypto.subtle and from the page's own SHA-256 alike.
    let kept = a.kept_holds(&show).await;
    let token = kept["A1"]["token"].as_str().expect("A keeps the token");
    let (status, hold) = server.get(&format!("/v1/shows/{show}/holds/{token}")).await;
    assert_eq!((status, &hold["seats"]), (200, &json!(["A1"])), "{hold}");
    let daemon_ref = seathold::ids::HoldToken::parse(token)
        .expect("a token")
        .hold_ref();
    assert_eq!(kept["A1"]["ref"], daemon_ref.as_str(), "{kept}");
    let js_ref = a
        .browser
        .run(
            "return window.seatmap.sha256Hex(arguments[0]).slice(0, 16);",
            json!([token]),
        )
        .await;
    assert_eq!(js_ref, daemon_ref.as_str());
    let subtle_ref = a
        .browser
        .run_async(
            "const done = arguments[arguments.length - 1];
             window.seatmap.holdRef(arguments[0]).then(done);",
            json!([token]),
        )
        .await;
    assert_eq!(subtle_ref, daemon_ref.as_str());
    // A's seat counts down from the hold's expiresInMs (300 s by default):
    // "5:00" until its first tick (a page's timers may run only once a
    // second, when the browser deems it in the background), then "4:59".
    let timer = || async {
        let t = a
            .browser
            .run(
                "return document.querySelector('#seats [data-seat=\"A1\"] .timer').textContent;",
                json!([]),
            )
            .await;
        t.as_str().unwrap_or_default().to_owned()
    };
    let first = timer().await;
    assert!(
        first == "5:00" || first.starts_with("4:5"),
        "countdown {first}"
    );
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let later = timer().await;
    assert!(
        later.starts_with("4:5"),
        "countdown {first}, 1.5 s later {later}"
    );

    // Release in A frees it in both.
    a.click_seat("A1").await;
    a.browser.click("#release").await;
    let click = Instant::now();
    let in_a = a.wait_seat("A1", "free", click, SECOND).await;
    let in_b = b.wait_seat("A1", "free", click, SECOND).await;
    eprintln!("release: free in A after {in_a:?}, in B after {in_b:?}");
    assert_eq!(a.kept_holds(&show).await, json!({}));

    // Bought in A: sold in both.
    a.click_seat("A2").await;
    let click = Instant::now();
    a.wait_seat("A2", "mine", click, SECOND).await;
    b.wait_seat("A2", "held", click, SECOND).await;
    a.browser.click("#confirm").await;
    let click = Instant::now();
    let in_a = a.wait_seat("A2", "sold", click, SECOND).await;
    let in_b = b.wait_seat("A2", "sold", click, SECOND).await;
    eprintln!("confirm: sold in A after {in_a:?}, in B after {in_b:?}");

    // B's holds show as held in A; a hold of A's own as held by me.
    b.click_seat("B3").await;
    let click = Instant::now();
    b.wait_seat("B3", "mine", click, SECOND).await;
    a.wait_seat("B3", "held", click, SECOND).await;
    a.click_seat("B5").await;
    let click = Instant::now();
    a.wait_seat("B5", "mine", click, SECOND).await;
    b.wait_seat("B5", "held", click, SECOND).await;
    // Colours change with a short transition: let them settle.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let png = a.browser.screenshot().await;
    let target = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"));
    let shot = target.join("seatmap.png");
    std::fs::write(&shot, png).expect("write the screenshot");
    eprintln!("screenshot of page A: {}", shot.display());

    // A reload of A with ?ttlMs=1000: the states come back from the batch
    // route, and A's hold of B5 from its kept token.
    a.open(&format!("{map}&ttlMs=1000")).await;
    for (seat, want) in [
        ("A1", "free"),
        ("A2", "sold"),
        ("B3", "held"),
        ("B5", "mine"),
    ] {
        assert_eq!(a.state(seat).await, want, "{seat} after the reload");
    }

    // A 1 s hold turns free in both by itself: the expiry sweeper writes
    // `expired` within 1 s of the TTL.
    a.click_seat("C1").await;
    let click = Instant::now();
    a.wait_seat("C1", "mine", click, SECOND).await;
    b.wait_seat("C1", "held", click, SECOND).await;
    let limit = Duration::from_millis(2500);
    let in_a = a.wait_seat("C1", "free", click, limit).await;
    let in_b = b.wait_seat("C1", "free", click, limit).await;
    eprintln!("1 s TTL: free in A after {in_a:?}, in B after {in_b:?}");
    assert!(
        in_a >= Duration::from_millis(950) && in_b >= Duration::from_millis(950),
        "freed before its TTL ran out: A {in_a:?}, B {in_b:?}"
    );
    let message = a
        .browser
        .run(
            "return document.getElementById('message').textContent;",
            json!([]),
        )
        .await;
    assert_eq!(message, "Your hold on seat C1 expired.");
    let (_, state) = server.get(&format!("/v1/shows/{show}/seats/C1")).await;
    assert_eq!(state["state"], "free");

    // Nothing so far broke a rule of the page's CSP or threw.
    for page in [&a, &b] {
        let errors = page.browser.console_errors().await;
        assert!(errors.is_empty(), "page {}: {errors:#?}", page.name);
    }

    // The daemon restarts on its address: the pages notice, their browsers
    // reconnect by themselves with Last-Event-ID, and what happened
    // meanwhile (a hold through another instance) arrives.
    let addr = server.addr;
    server.stop().await;
    for page in [&a, &b] {
        page.wait_status_not("live", Duration::from_secs(5)).await;
    }
    let other = common::server().await;
    other.hold(&show, &["C6"]).await;
    let restarted = Instant::now();
    let server = common::server_with(seathold::config::Options {
        listen: addr,
        ..common::options()
    })
    .await;
    let in_a = a
        .wait_seat("C6", "held", restarted, Duration::from_secs(10))
        .await;
    let in_b = b
        .wait_seat("C6", "held", restarted, Duration::from_secs(10))
        .await;
    eprintln!("restart: the missed hold in A after {in_a:?}, in B after {in_b:?}");
    for page in [&a, &b] {
        page.wait_status("live", SECOND).await;
    }

    // A PATCH through the API (a booking system changing a hold): the seat
    // it gives back turns free, the one it adds held. A names the hold's
    // seats from its events; after a reload it only knows them as held
    // (the seat states do not say whose), and asks.
    let (status, made) = server
        .call(
            "POST",
            &format!("/v1/shows/{show}/holds"),
            Some(json!({"seats": ["B1", "B2"]})),
        )
        .await;
    assert_eq!(status, 201, "{made}");
    let patch = format!(
        "/v1/shows/{show}/holds/{}",
        made["holdToken"].as_str().expect("token")
    );
    let since = Instant::now();
    for seat in ["B1", "B2"] {
        a.wait_seat(seat, "held", since, SECOND).await;
    }
    // The page reloaded before the second change knows B4 held but not by
    // which hold: the event that frees it makes it read B4 again, after the
    // 150-400 ms the page waits before such a read (spreading a storm of
    // them), so that one gets as much longer.
    for (change, freed, added, free_within) in [
        (json!({"add": ["B4"], "remove": ["B2"]}), "B2", "B4", SECOND),
        (
            json!({"add": ["B6"], "remove": ["B4"]}),
            "B4",
            "B6",
            SECOND + Duration::from_millis(400),
        ),
    ] {
        let since = Instant::now();
        let (status, body) = server.call("PATCH", &patch, Some(change)).await;
        assert_eq!(status, 200, "{body}");
        let gone = a.wait_seat(freed, "free", since, free_within).await;
        let new = a.wait_seat(added, "held", since, SECOND).await;
        eprintln!("PATCH: {freed} free in A after {gone:?}, {added} held after {new:?}");
        assert_eq!(a.state("B1").await, "held");
        // The second change is seen by a page that reloaded meanwhile.
        a.open(&map).await;
    }

    // A page on a quiet show, whose stream drops before its first event:
    // its browser reconnects without Last-Event-ID (from the newest event),
    // and the hold made meanwhile is read again.
    let quiet = common::show("ui-quiet");
    b.open(&format!("{}/ui/shows/{quiet}?seats=Q1,Q2", server.base))
        .await;
    let addr = server.addr;
    server.stop().await;
    b.wait_status_not("live", Duration::from_secs(5)).await;
    other.hold(&quiet, &["Q1"]).await;
    let restarted = Instant::now();
    let server = common::server_with(seathold::config::Options {
        listen: addr,
        ..common::options()
    })
    .await;
    let in_b = b
        .wait_seat("Q1", "held", restarted, Duration::from_secs(10))
        .await;
    eprintln!("quiet show: the hold made while the stream was down in B after {in_b:?}");
    assert_eq!(b.state("Q2").await, "free");

    // ?seats= chooses the seats, grouped in rows by their letters; an
    // invalid id is left out and said so.
    b.open(&format!(
        "{}/ui/shows/{show}?seats=A2,C6,C1,VIP.1,bad%7B",
        server.base
    ))
    .await;
    assert_eq!(
        b.states().await,
        json!({"A2": "sold", "C6": "held", "C1": "free", "VIP.1": "free"})
    );
    let rows = b
        .browser
        .run(
            "return [...document.querySelectorAll('#seats .row')].map((r) => r.getAttribute('aria-label'));",
            json!([]),
        )
        .await;
    assert_eq!(rows, json!(["Row A", "Row C", "Row VIP"]));
    let message = b
        .browser
        .run(
            "return document.getElementById('message').textContent;",
            json!([]),
        )
        .await;
    assert_eq!(message, "\"bad{\" is not a seat id; left out.");

    // Holds A knows only from the seat states (made before it opened, so
    // their refs are unknown) end in a burst: A reads the seats again in a
    // batch or two, not once per seat, and shows them all free.
    let burst = common::show("ui-burst");
    let mut tokens = Vec::new();
    for c in 1..=12 {
        let hold = server.hold(&burst, &[&format!("A{c}")]).await;
        tokens.push(hold["holdToken"].as_str().expect("token").to_owned());
    }
    a.open(&format!("{}/ui/shows/{burst}?rows=1&cols=12", server.base))
        .await;
    // The page's own second look at held seats of unknown holds, 1 s after
    // it went live, comes and goes first.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(a.state("A7").await, "held");
    a.browser
        .run(
            "window.seatReads = 0;
             const fetch = window.fetch;
             window.fetch = (url, init) => {
               if (String(url).includes('/seats?ids=')) window.seatReads += 1;
               return fetch(url, init);
             };",
            json!([]),
        )
        .await;
    // The 12 at once, as a burst comes: one after another, on a busy
    // machine, they spread over more of the page's 150-400 ms batching.
    let since = Instant::now();
    let paths: Vec<String> = tokens
        .iter()
        .map(|token| format!("/v1/shows/{burst}/holds/{token}"))
        .collect();
    for (status, body) in
        futures_util::future::join_all(paths.iter().map(|p| server.call("DELETE", p, None))).await
    {
        assert_eq!(status, 204, "{body}");
    }
    for c in 1..=12 {
        a.wait_seat(&format!("A{c}"), "free", since, 3 * SECOND)
            .await;
    }
    let reads = a.browser.run("return window.seatReads;", json!([])).await;
    eprintln!(
        "burst: 12 releases seen as free in A after {:?}, with {reads} seat reads",
        since.elapsed()
    );
    assert!(
        reads.as_u64().is_some_and(|n| (1..=3).contains(&n)),
        "12 releases of unknown holds took {reads} seat reads"
    );

    a.browser.quit().await;
    b.browser.quit().await;
    server.stop().await;
    other.stop().await;
    eprintln!("done after {:?}", started.elapsed());
}

/// Every event of `show` kept in its stream (the polling form): status and
/// body.
async fn show_events(server: &common::TestServer, show: &str) -> (u16, Value) {
    server
        .get(&format!("/v1/shows/{show}/events?after=0-0"))
        .await
}

/// The state of `seat` of `show` as the API reads it: status and body.
async fn seat_of(server: &common::TestServer, show: &str, seat: &str) -> (u16, Value) {
    server.get(&format!("/v1/shows/{show}/seats/{seat}")).await
}

/// The types of `show`'s events, oldest first.
async fn event_types(server: &common::TestServer, show: &str) -> Vec<String> {
    let (status, events) = show_events(server, show).await;
    assert_eq!(status, 200, "{events}");
    events["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter_map(|e| e["type"].as_str().map(str::to_owned))
        .collect()
}

/// Waits until the API reads seat A1 of the show `g` gave up on free, for
/// at most `limit` after `since` (`why` says what should have freed it);
/// answers how long after `since` it was.
async fn wait_free(g: &GivenUp, since: Instant, limit: Duration, why: &str) -> Duration {
    loop {
        let (status, seat) = seat_of(&g.server, &g.show, "A1").await;
        assert_eq!(status, 200, "{seat}");
        if seat["state"] == "free" {
            return since.elapsed();
        }
        assert!(
            since.elapsed() < limit,
            "seat A1 still {seat} {limit:?} after {why}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A browser with one page (not opened yet) and a server on the shared
/// test cluster, started side by side; the driver must outlive the page.
async fn one_page() -> (ChromeDriver, Page, common::TestServer) {
    let cluster = tokio::task::spawn_blocking(|| {
        common::cluster();
    });
    let driver = ChromeDriver::start().await;
    let browser = driver.session().await;
    cluster.await.expect("the test cluster");
    let server = common::server_with(common::options()).await;
    (driver, Page { name: "A", browser }, server)
}

/// A click whose answer the network loses: the page tries again under the
/// same `Idempotency-Key`, so the seat is held once, by this page, not left
/// held by nobody it knows of until its TTL runs out. The same for a buy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_whose_answer_is_lost_is_recovered_not_orphaned() {
    let _alone = BROWSERS.lock().await;
    let (_driver, page, server) = one_page().await;
    let show = common::show("ui-lost");
    // Two: Chromium itself sends a request again, once, when a connection
    // it reused closes without an answer; the second loss is the page's to
    // handle.
    let holds = Flaky::start(
        server.addr,
        ("POST ", "/hold"),
        (Loss::Answer, 2),
        Duration::ZERO,
    )
    .await;
    page.open_via(&holds, &show, "rows=1&cols=4").await;
    let replays = server.metric("seathold_idempotent_replays_total").await;

    let click = Instant::now();
    page.click_seat("A2").await;
    let took = page.wait_seat("A2", "mine", click, 5 * SECOND).await;
    // The panel opened with the hold: the keyboard is on its Buy button.
    page.wait_focus("confirm", 2 * SECOND).await;
    eprintln!("held by this page {took:?} after a click whose first two answers were lost");
    assert_eq!(holds.dropped(), 2, "the proxy lost fewer answers");

    // One hold in Redis, the page's: one `held` event, and the page's token
    // reads back with this seat.
    let (status, events) = show_events(&server, &show).await;
    assert_eq!(status, 200, "{events}");
    let held: Vec<&Value> = events["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e["type"] == "held")
        .collect();
    assert_eq!(held.len(), 1, "one click, holds: {events}");
    let kept = page.kept_holds(&show).await;
    let token = kept["A2"]["token"]
        .as_str()
        .unwrap_or_else(|| panic!("the page keeps no hold of A2: {kept}"));
    assert_eq!(held[0]["holdRef"], kept["A2"]["ref"], "{events} / {kept}");
    let (status, hold) = server.get(&format!("/v1/shows/{show}/holds/{token}")).await;
    assert_eq!((status, &hold["seats"]), (200, &json!(["A2"])), "{hold}");
    assert_eq!(
        server.metric("seathold_idempotent_replays_total").await - replays,
        2.0,
        "both retries were answered from the first attempt's record"
    );
    drop(holds);

    // A buy answered 502 twice, as by a proxy whose upstream broke after
    // passing it on: the page asks again and shows it sold.
    let confirms = Flaky::start(
        server.addr,
        ("POST ", "/confirm"),
        (Loss::BadGateway, 2),
        Duration::ZERO,
    )
    .await;
    page.open_via(&confirms, &show, "rows=1&cols=4").await;
    let click = Instant::now();
    page.click_seat("A3").await;
    page.wait_seat("A3", "mine", click, 2 * SECOND).await;
    page.browser.click("#confirm").await;
    page.wait_seat("A3", "sold", click, 5 * SECOND).await;
    // The `confirmed` event may show the seat sold before the retry's
    // answer comes: the page then says so.
    page.wait_message("is yours: sold", Instant::now(), 5 * SECOND)
        .await;
    assert_eq!(confirms.dropped(), 2, "the proxy spoilt fewer answers");
    // The panel closed with the sale: the keyboard is back on the seat.
    page.wait_focus("seat-A3", 2 * SECOND).await;
    let (status, seat) = seat_of(&server, &show, "A3").await;
    assert_eq!((status, &seat["state"]), (200, &json!("sold")), "{seat}");
    page.browser.quit().await;
    server.stop().await;
}

/// What [`give_up_on_a_hold`] leaves: a page of a new show behind two
/// proxies (the page talks to `holds`, which talks to `releases`, which
/// talks to the server), the click's time and the page's message.
/// Kept whole for the test: a driver or proxy dropped early ends the page
/// or cuts the network.
struct GivenUp {
    _driver: ChromeDriver,
    page: Page,
    server: common::TestServer,
    holds: Flaky,
    releases: Flaky,
    show: String,
    click: Instant,
    message: Value,
}

/// A page of a new show (tagged `tag`, seats A1 and A2, holds of `ttl_ms`)
/// behind a proxy that does `loss` to every hold, and one that drops the
/// first `lost_releases` releases before they reach the daemon; and a click
/// on seat A1 that the page gave up on after 20 s.
async fn give_up_on_a_hold(tag: &str, loss: Loss, ttl_ms: u64, lost_releases: usize) -> GivenUp {
    let (driver, page, server) = one_page().await;
    let show = common::show(tag);
    let releases = Flaky::start(
        server.addr,
        ("DELETE ", ""),
        (Loss::Request, lost_releases),
        Duration::ZERO,
    )
    .await;
    let holds = Flaky::start(
        releases.addr,
        ("POST ", "/hold"),
        (loss, usize::MAX),
        Duration::ZERO,
    )
    .await;
    page.open_via(&holds, &show, &format!("rows=1&cols=2&ttlMs={ttl_ms}"))
        .await;
    let click = Instant::now();
    page.click_seat("A1").await;
    let message = page
        .wait_message("could not be held", click, 30 * SECOND)
        .await;
    GivenUp {
        _driver: driver,
        page,
        server,
        holds,
        releases,
        show,
        click,
        message,
    }
}

/// A hold whose every answer is lost for longer than the page asks again
/// (20 s): the page says it could not be held, and once the network is back
/// it learns, under the same key, that the hold was made after all, and
/// releases it. The seat comes back long before its TTL would free it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_the_page_gave_up_on_is_released_once_its_answer_comes() {
    let _alone = BROWSERS.lock().await;
    let g = give_up_on_a_hold("ui-given-up", Loss::Answer, 120_000, 0).await;
    let gave_up = g.click.elapsed();
    eprintln!(
        "the page gave up after {gave_up:?} and {} lost answers: {}",
        g.holds.dropped(),
        g.message
    );
    let (status, seat) = seat_of(&g.server, &g.show, "A1").await;
    assert_eq!((status, &seat["state"]), (200, &json!("held")), "{seat}");

    g.holds.heal();
    let healed = Instant::now();
    let took = wait_free(&g, healed, 15 * SECOND, "the network came back").await;
    eprintln!("released {took:?} after the network came back");
    g.page.wait_seat("A1", "free", healed, 15 * SECOND).await;
    assert_eq!(event_types(&g.server, &g.show).await, ["held", "released"]);
    assert_eq!(g.page.kept_holds(&g.show).await, json!({}));
    g.page.browser.quit().await;
    g.server.stop().await;
}

/// A hold given up on, then the page reloaded (or navigated back) while the
/// network still loses the answers: the reloaded page goes on asking under
/// the click's key, which it kept in the tab's sessionStorage, and releases
/// the hold once the network is back. The hold's TTL is 10 min, so only a
/// release can free the seat within the test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_given_up_on_is_released_after_a_reload() {
    let _alone = BROWSERS.lock().await;
    let g = give_up_on_a_hold("ui-reloaded", Loss::Answer, 600_000, 0).await;
    eprintln!(
        "the page gave up after {:?} and {} lost answers: {}",
        g.click.elapsed(),
        g.holds.dropped(),
        g.message
    );
    let (status, seat) = seat_of(&g.server, &g.show, "A1").await;
    assert_eq!((status, &seat["state"]), (200, &json!("held")), "{seat}");

    // The same address in the same tab: a new page, the tab's storage kept.
    g.page
        .open_via(&g.holds, &g.show, "rows=1&cols=2&ttlMs=600000")
        .await;
    let reloaded = g.holds.dropped();
    // The reloaded page asks every 3-5 s; its answers are lost a while yet.
    common::eventually(
        Duration::from_secs(10),
        "the reloaded page to ask before the network comes back",
        || async { g.holds.dropped() > reloaded },
    )
    .await;
    let lost = g.holds.dropped() - reloaded;

    g.holds.heal();
    let healed = Instant::now();
    let took = wait_free(
        &g,
        healed,
        15 * SECOND,
        "the network came back (the page was reloaded)",
    )
    .await;
    eprintln!(
        "released {took:?} after the network came back, {lost} answers lost after the reload"
    );
    assert!(
        lost > 0,
        "the reloaded page asked nothing before the network came back"
    );
    g.page.wait_seat("A1", "free", healed, 15 * SECOND).await;
    assert_eq!(event_types(&g.server, &g.show).await, ["held", "released"]);
    // The undo is over: nothing is left for a later load to take up.
    let kept = g.page.kept_undos(&g.show).await;
    assert_eq!(kept, json!({}), "undos kept after the release");
    g.page.browser.quit().await;
    g.server.stop().await;
}

/// A click whose hold is made but whose answers are lost, and the page
/// reloaded while it still asks (the customer pressed reload at a spinning
/// seat): the reloaded page asks under the click's key, which the page kept
/// in the tab's sessionStorage when it was left, and the seat is the
/// customer's, as the click meant; there is one hold. Before, the key went
/// with the page, and the seat stayed held by nobody's tab for its TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_interrupted_by_a_reload_is_the_customers() {
    let _alone = BROWSERS.lock().await;
    let (_driver, page, server) = one_page().await;
    let show = common::show("ui-interrupted");
    let holds = Flaky::start(
        server.addr,
        ("POST ", "/hold"),
        (Loss::Answer, usize::MAX),
        Duration::ZERO,
    )
    .await;
    let query = "rows=1&cols=2&ttlMs=600000";
    page.open_via(&holds, &show, query).await;
    page.click_seat("A1").await;
    // A few of the page's 20 s of asks, all made and unanswered.
    tokio::time::sleep(3 * SECOND).await;
    let (status, seat) = seat_of(&server, &show, "A1").await;
    assert_eq!((status, &seat["state"]), (200, &json!("held")), "{seat}");
    assert!(holds.dropped() > 1, "{} answers lost", holds.dropped());

    page.open_via(&holds, &show, query).await;
    tokio::time::sleep(2 * SECOND).await;
    holds.heal();
    let healed = Instant::now();
    page.wait_seat("A1", "mine", healed, 15 * SECOND).await;
    eprintln!(
        "the reloaded page had the hold {:?} after the network came back",
        healed.elapsed()
    );
    assert_eq!(event_types(&server, &show).await, ["held"]);
    let kept = page.kept_holds(&show).await;
    assert!(kept.get("A1").is_some(), "the page keeps the hold: {kept}");
    // Taken up: no later load asks under the key again.
    let undos = page.kept_undos(&show).await;
    assert_eq!(undos, json!({}), "undos kept after the hold was taken");
    page.browser.quit().await;
    server.stop().await;
}

/// A hold given up on whose release, once the page learns of the hold, is
/// lost on the way for longer than the page asks again (20 s): the page
/// does not stop there, since the hold may still be in place; it asks again
/// under the click's key and releases the hold once a release is answered.
/// Before, the undo ended with the release it gave up on, and the seat
/// stayed held for the hold's whole TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_given_up_on_is_sent_again() {
    let _alone = BROWSERS.lock().await;
    // At most 9 releases in one 20 s round (0.25, 0.5, 1, 2, 4, 4, 4, 4 s
    // apart): the tenth is in a round of its own.
    const LOST: usize = 10;
    let g = give_up_on_a_hold("ui-release-lost", Loss::Answer, 600_000, LOST).await;
    g.holds.heal();
    let healed = Instant::now();
    let took = wait_free(
        &g,
        healed,
        50 * SECOND,
        "the holds' answers came back (releases lost 20 s and more)",
    )
    .await;
    eprintln!(
        "released {took:?} after the holds' answers came back, {} releases lost",
        g.releases.dropped()
    );
    assert_eq!(g.releases.dropped(), LOST, "releases lost");
    g.page.wait_seat("A1", "free", healed, 50 * SECOND).await;
    assert_eq!(event_types(&g.server, &g.show).await, ["held", "released"]);
    g.page.browser.quit().await;
    g.server.stop().await;
}

/// A hold that never reached the daemon (the connection broke before
/// the request was passed on), given up on after 20 s: once the network is
/// back, the page finds the seat free and leaves it so, rather than making
/// the hold then to release it (which showed the seat held to everyone for
/// a moment, and left it held should the release fail).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_that_never_arrived_is_not_made_when_the_network_returns() {
    let _alone = BROWSERS.lock().await;
    let g = give_up_on_a_hold("ui-never", Loss::Request, 120_000, 0).await;
    g.holds.heal();
    // The page asks about it every 3-5 s: two rounds at least.
    tokio::time::sleep(12 * SECOND).await;
    let (_, events) = show_events(&g.server, &g.show).await;
    assert_eq!(events["events"], json!([]), "{events}");
    assert_eq!(
        g.page.state("A1").await,
        "free",
        "{}",
        g.page.describe().await
    );
    g.page.browser.quit().await;
    g.server.stop().await;
}

/// Events that come after the page's own hold's answer but tell of what
/// happened before it (another customer held the seat and let it go just
/// before this click; the stream is a second behind) are old news for that
/// seat: the page keeps the hold it made, and does not forget its token at
/// the other customer's `held`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_older_than_the_pages_own_hold_leave_it_mine() {
    let _alone = BROWSERS.lock().await;
    let (_driver, page, server) = one_page().await;
    let show = common::show("ui-lag");
    // The stream two seconds behind: time for the click's answer to come
    // first even on a busy machine.
    let lag = 2 * SECOND;
    let lagging = Flaky::start(server.addr, ("POST ", "/hold"), (Loss::Answer, 0), lag).await;
    page.open_via(&lagging, &show, "rows=1&cols=2").await;

    // Another customer holds A1 and lets it go; the page hears of neither
    // for two seconds, and its customer clicks the seat meanwhile.
    let other = server.hold(&show, &["A1"]).await;
    let token = other["holdToken"].as_str().expect("token");
    let (status, _) = server
        .call("DELETE", &format!("/v1/shows/{show}/holds/{token}"), None)
        .await;
    assert_eq!(status, 204);
    let click = Instant::now();
    page.click_seat("A1").await;
    page.wait_seat("A1", "mine", click, 2 * SECOND).await;
    assert!(
        click.elapsed() < lag,
        "the click was answered after the lagging events came"
    );

    // The other customer's events, then the page's own, arrive.
    common::eventually(
        Duration::from_secs(10),
        "the page's own held event",
        || async {
            let (_, events) = show_events(&server, &show).await;
            events["events"].as_array().is_some_and(|e| e.len() == 3)
        },
    )
    .await;
    // The proxy holds each of the (up to 3) chunks back by the lag.
    tokio::time::sleep(3 * lag + SECOND).await;
    assert_eq!(page.state("A1").await, "mine", "{}", page.describe().await);
    let kept = page.kept_holds(&show).await;
    assert!(
        kept["A1"]["token"].is_string(),
        "the page forgot its hold: {kept}"
    );
    page.browser.quit().await;
    server.stop().await;
}

/// A release whose answer comes after the events that followed it (the
/// release, then another customer's hold of the seat): the page shows the
/// seat held by that customer, not free as the late 204 would have it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_release_answer_does_not_free_a_seat_held_again() {
    let _alone = BROWSERS.lock().await;
    let (_driver, page, server) = one_page().await;
    let show = common::show("ui-late-release");
    let slow = Flaky::start(
        server.addr,
        ("DELETE ", ""),
        (Loss::Late(2 * SECOND), 1),
        Duration::ZERO,
    )
    .await;
    page.open_via(&slow, &show, "rows=1&cols=2").await;
    let click = Instant::now();
    page.click_seat("A1").await;
    page.wait_seat("A1", "mine", click, 2 * SECOND).await;
    page.wait_focus("confirm", 2 * SECOND).await;
    page.browser.click("#release").await;
    // The release is done in Redis at once; its answer is 2 s away.
    common::eventually(Duration::from_secs(2), "the release", || async {
        let (_, seat) = seat_of(&server, &show, "A1").await;
        seat["state"] == "free"
    })
    .await;
    server.hold(&show, &["A1"]).await;
    let since = Instant::now();
    page.wait_seat("A1", "held", since, SECOND).await;
    page.wait_message("released", since, 4 * SECOND).await;
    assert_eq!(slow.dropped(), 1, "the proxy delayed no answer");
    assert_eq!(page.state("A1").await, "held", "{}", page.describe().await);
    page.browser.quit().await;
    server.stop().await;
}

/// A `seathold dev` run, stopped with Ctrl-C when dropped.
struct Dev(Child);

impl Drop for Dev {
    fn drop(&mut self) {
        let _ = Command::new("/bin/sh")
            .args(["-c", &format!("kill -INT {}", self.0.id())])
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `seathold dev` on `port` (a one-master cluster: quick) with
/// `extra` flags; answers it and its banner's lines.
fn start_dev(port: u16, extra: &[&str]) -> (Dev, Vec<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_seathold"))
        .args(["dev", "--masters", "1", "--replicas", "0"])
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(extra)
        .env("SEATHOLD_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn seathold dev");
    let lines = common::read_banner(&mut child);
    (Dev(child), lines)
}

#[tokio::test]
async fn dev_prints_the_seat_map_url_unless_ui_off() {
    let http = reqwest::Client::new();

    let port = free_port();
    let (dev, banner) = start_dev(port, &[]);
    let want = format!("http://127.0.0.1:{port}/ui/shows/42");
    let url = banner
        .iter()
        .filter(|l| l.contains("/ui/shows/"))
        .flat_map(|l| l.split_whitespace())
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no seat map URL in the banner:\n{}", banner.join("\n")));
    assert_eq!(url, want, "{}", banner.join("\n"));
    let page = http.get(url).send().await.expect("the page");
    assert_eq!(page.status(), 200);
    assert_eq!(
        page.headers()["content-type"],
        "text/html; charset=utf-8",
        "{:?}",
        page.headers()
    );
    // Its buttons hold and buy: no other site may frame it.
    let csp = page.headers()["content-security-policy"]
        .to_str()
        .expect("CSP");
    assert!(csp.contains("frame-ancestors 'none'"), "{csp}");
    assert_eq!(page.headers()["x-frame-options"], "DENY");
    assert_eq!(page.headers()["x-content-type-options"], "nosniff");
    assert!(page.text().await.expect("html").contains("id=\"seats\""));
    drop(dev);

    let port = free_port();
    let (_dev, banner) = start_dev(port, &["--ui", "off"]);
    assert!(
        !banner.iter().any(|l| l.contains("/ui/")),
        "--ui off, yet the banner names the page:\n{}",
        banner.join("\n")
    );
    common::wait_readyz(
        &http,
        &format!("http://127.0.0.1:{port}"),
        200,
        Duration::from_secs(30),
    )
    .await;
    let page = http
        .get(format!("http://127.0.0.1:{port}/ui/shows/42"))
        .send()
        .await
        .expect("the page");
    assert_eq!(page.status(), 404);
    // Not there at all: no 405 naming the page's methods.
    let post = http
        .post(format!("http://127.0.0.1:{port}/ui/shows/42"))
        .send()
        .await
        .expect("a POST");
    assert_eq!(post.status(), 404);
    assert!(post.headers().get("allow").is_none());
}
