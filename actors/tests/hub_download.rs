//! The Hub download path against a fake Hub on loopback.
//!
//! A tiny HTTP/1.1 server (std only, one background thread, stops when told or after a deadline)
//! serves a random tiny V4.1 checkpoint the way huggingface.co does for hf-hub 0.4.3: the repo
//! listing `/api/models/{repo}/revision/{rev}` (`sha`, `siblings`), and
//! `/{repo}/resolve/{rev}/{file}` answering `Range` requests with `x-repo-commit`, `etag` and
//! `content-range`; safetensors files answer with a 302 to a "CDN" path and `x-linked-etag`,
//! like LFS files on the Hub. Environment variables are process-global, so every check that
//! sets them lives in the one test function `hub_download_path_end_to_end`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use deepinfer_actors::hub::{HubError, HubOptions, resolve_hub_checkpoint};
use deepinfer_model::checkpoint::{Checkpoint, write_random_checkpoint};
use deepinfer_model::config::ModelConfig;

/// The fake Hub stops by itself after this long, whatever the test does.
const SERVER_DEADLINE: Duration = Duration::from_secs(120);
const TINY_REPO: &str = "deepinfer-test/tiny-v41";
const TINY_SHA: &str = "0123456789abcdef0123456789abcdef01234567";
const BROKEN_REPO: &str = "deepinfer-test/broken-v41";
const BROKEN_SHA: &str = "fedcba9876543210fedcba9876543210fedcba98";

/// One repository on the fake Hub.
struct FakeRepo {
    id: String,
    sha: String,
    files: BTreeMap<String, Vec<u8>>,
    /// Listed in `siblings` but answered with 404 (a broken upload), while in this set.
    unavailable: Mutex<BTreeSet<String>>,
}

/// The fake Hub's state, shared with its thread.
struct HubState {
    addr: SocketAddr,
    repos: Vec<FakeRepo>,
    /// `GET` paths received, in order.
    requests: Mutex<Vec<String>>,
}

struct FakeHub {
    state: Arc<HubState>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl FakeHub {
    fn start(repos: Vec<FakeRepo>) -> FakeHub {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        listener
            .set_nonblocking(true)
            .expect("nonblocking listener");
        let state = Arc::new(HubState {
            addr: listener.local_addr().expect("local addr"),
            repos,
            requests: Mutex::new(Vec::new()),
        });
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let state = Arc::clone(&state);
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || serve(&listener, &state, &stop))
        };
        FakeHub {
            state,
            stop,
            thread: Some(thread),
        }
    }

    fn endpoint(&self) -> String {
        format!("http://{}", self.state.addr)
    }

    fn requests(&self) -> Vec<String> {
        self.state.requests.lock().unwrap().clone()
    }

    fn repo(&self, id: &str) -> &FakeRepo {
        self.state.repos.iter().find(|r| r.id == id).unwrap()
    }

    /// Stops the thread and closes the listening socket.
    fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            thread.join().expect("fake hub thread");
        }
    }
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        self.stop();
    }
}

fn serve(listener: &TcpListener, state: &HubState, stop: &AtomicBool) {
    let deadline = Instant::now() + SERVER_DEADLINE;
    while !stop.load(Ordering::SeqCst) && Instant::now() < deadline {
        match listener.accept() {
            Ok((stream, _)) => {
                // A failed exchange only fails the client's request; the test sees that.
                let _ = handle_connection(stream, state);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(_) => break,
        }
    }
}

/// A response before it is written.
struct Reply {
    status: &'static str,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Reply {
    fn not_found(what: &str) -> Reply {
        Reply {
            status: "404 Not Found",
            headers: vec![("x-error-code".into(), "EntryNotFound".into())],
            body: format!("{what} not found").into_bytes(),
        }
    }
}

fn handle_connection(stream: TcpStream, state: &HubState) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    let mut range = None;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
        if let Some((name, value)) = line.split_once(':')
            && name.trim().eq_ignore_ascii_case("range")
        {
            range = Some(value.trim().to_string());
        }
    }
    let mut parts = request_line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    state.requests.lock().unwrap().push(path.to_string());
    let reply = if method == "GET" {
        route(state, path, range.as_deref())
    } else {
        Reply {
            status: "405 Method Not Allowed",
            headers: Vec::new(),
            body: Vec::new(),
        }
    };
    let mut out = stream;
    write!(out, "HTTP/1.1 {}\r\n", reply.status)?;
    for (name, value) in &reply.headers {
        write!(out, "{name}: {value}\r\n")?;
    }
    write!(
        out,
        "content-length: {}\r\nconnection: close\r\n\r\n",
        reply.body.len()
    )?;
    out.write_all(&reply.body)?;
    out.flush()
}

fn route(state: &HubState, path: &str, range: Option<&str>) -> Reply {
    if let Some(rest) = path.strip_prefix("/api/models/") {
        for repo in &state.repos {
            let Some(revision) = rest
                .strip_prefix(repo.id.as_str())
                .and_then(|r| r.strip_prefix("/revision/"))
            else {
                continue;
            };
            if revision != "main" && revision != repo.sha {
                return Reply::not_found("revision");
            }
            let siblings: Vec<serde_json::Value> = repo
                .files
                .keys()
                .map(|name| serde_json::json!({ "rfilename": name }))
                .collect();
            let body = serde_json::json!({ "id": repo.id, "sha": repo.sha, "siblings": siblings });
            return Reply {
                status: "200 OK",
                headers: vec![("content-type".into(), "application/json".into())],
                body: body.to_string().into_bytes(),
            };
        }
        return Reply::not_found("repository");
    }
    if let Some(etag) = path.strip_prefix("/cdn/") {
        for repo in &state.repos {
            for bytes in repo.files.values() {
                if etag_of(bytes) == etag {
                    return ranged(bytes, range, Vec::new());
                }
            }
        }
        return Reply::not_found("blob");
    }
    for repo in &state.repos {
        let Some(rest) = path
            .strip_prefix('/')
            .and_then(|p| p.strip_prefix(repo.id.as_str()))
            .and_then(|p| p.strip_prefix("/resolve/"))
        else {
            continue;
        };
        let Some((revision, file)) = rest.split_once('/') else {
            return Reply::not_found("file");
        };
        if revision != "main" && revision != repo.sha {
            return Reply::not_found("revision");
        }
        if repo.unavailable.lock().unwrap().contains(file) {
            return Reply::not_found(file);
        }
        let Some(bytes) = repo.files.get(file) else {
            return Reply::not_found(file);
        };
        let etag = etag_of(bytes);
        if file.ends_with(".safetensors") {
            // LFS files: the Hub redirects to its CDN and gives the blob's etag in x-linked-etag.
            return Reply {
                status: "302 Found",
                headers: vec![
                    ("x-repo-commit".into(), repo.sha.clone()),
                    ("x-linked-etag".into(), format!("\"{etag}\"")),
                    ("x-linked-size".into(), bytes.len().to_string()),
                    (
                        "location".into(),
                        format!("http://{}/cdn/{etag}", state.addr),
                    ),
                ],
                body: Vec::new(),
            };
        }
        let headers = vec![
            ("x-repo-commit".into(), repo.sha.clone()),
            ("etag".into(), format!("\"{etag}\"")),
        ];
        return ranged(bytes, range, headers);
    }
    Reply::not_found("path")
}

/// `bytes`, or the part a `Range: bytes=a-[b]` header asks for (206 with `content-range`).
fn ranged(bytes: &[u8], range: Option<&str>, mut headers: Vec<(String, String)>) -> Reply {
    let total = bytes.len();
    let Some(spec) = range.and_then(|r| r.strip_prefix("bytes=")) else {
        return Reply {
            status: "200 OK",
            headers,
            body: bytes.to_vec(),
        };
    };
    let (start, end) = spec.split_once('-').unwrap_or((spec, ""));
    let start: usize = start.parse().unwrap_or(0);
    let end: usize = end
        .parse()
        .map_or(total.saturating_sub(1), |e: usize| e.min(total - 1));
    if start >= total || end < start {
        headers.push(("content-range".into(), format!("bytes */{total}")));
        return Reply {
            status: "416 Range Not Satisfiable",
            headers,
            body: Vec::new(),
        };
    }
    headers.push((
        "content-range".into(),
        format!("bytes {start}-{end}/{total}"),
    ));
    Reply {
        status: "206 Partial Content",
        headers,
        body: bytes[start..=end].to_vec(),
    }
}

/// A content hash used as the blob name (FNV-1a 64 plus the length, hex).
fn etag_of(bytes: &[u8]) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{hash:016x}{:08x}", bytes.len())
}

/// Writes the tiny random checkpoint plus a small tokenizer into `dir`; returns every file by
/// name and the shard names.
fn tiny_checkpoint(dir: &Path) -> (BTreeMap<String, Vec<u8>>, Vec<String>) {
    let shards = write_random_checkpoint(&ModelConfig::tiny_v41(), 17, dir, 2).unwrap();
    std::fs::write(
        dir.join("tokenizer.json"),
        br#"{"version":"1.0","model":{}}"#,
    )
    .unwrap();
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        files.insert(name, std::fs::read(&path).unwrap());
    }
    let shard_names = shards
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    (files, shard_names)
}

fn set_env(name: &str, value: impl AsRef<std::ffi::OsStr>) {
    // SAFETY: only this test function of this test binary reads or writes the environment.
    unsafe { std::env::set_var(name, value) }
}

fn remove_env(name: &str) {
    // SAFETY: as in `set_env`.
    unsafe { std::env::remove_var(name) }
}

fn snapshot_dir(cache: &Path, repo: &str, sha: &str) -> PathBuf {
    cache
        .join(format!("models--{}", repo.replace('/', "--")))
        .join("snapshots")
        .join(sha)
}

#[test]
fn hub_download_path_end_to_end() {
    let tmp = tempfile::tempdir().unwrap();
    let source = tmp.path().join("source");
    let (files, shards) = tiny_checkpoint(&source);
    assert_eq!(shards.len(), 2);
    assert!(files.contains_key("model.safetensors.index.json"));
    let broken_shard = shards[1].clone();
    let mut hub = FakeHub::start(vec![
        FakeRepo {
            id: TINY_REPO.into(),
            sha: TINY_SHA.into(),
            files: files.clone(),
            unavailable: Mutex::new(BTreeSet::new()),
        },
        FakeRepo {
            id: BROKEN_REPO.into(),
            sha: BROKEN_SHA.into(),
            files: files.clone(),
            unavailable: Mutex::new(BTreeSet::from([broken_shard.clone()])),
        },
    ]);

    for proxy in [
        "HTTP_PROXY",
        "http_proxy",
        "HTTPS_PROXY",
        "https_proxy",
        "ALL_PROXY",
        "all_proxy",
    ] {
        remove_env(proxy);
    }
    remove_env("HF_HUB_CACHE");
    remove_env("HF_HUB_OFFLINE");
    let hf_home = tmp.path().join("hf-home");
    set_env("HF_HOME", &hf_home);
    set_env("HF_ENDPOINT", hub.endpoint());
    let options = HubOptions::from_env().unwrap();
    let cache = hf_home.join("hub");
    assert_eq!(options.cache_dir, cache);
    assert_eq!(options.endpoint, hub.endpoint());
    assert!(!options.offline);

    // 1. Download: every file lands in the cache layout, byte-identical.
    let snapshot = resolve_hub_checkpoint(TINY_REPO, "main", &options).unwrap();
    assert_eq!(snapshot, snapshot_dir(&cache, TINY_REPO, TINY_SHA));
    for (name, bytes) in &files {
        let got = std::fs::read(snapshot.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(got == *bytes, "{name} differs after download");
    }
    let refs = cache.join("models--deepinfer-test--tiny-v41/refs/main");
    assert_eq!(std::fs::read_to_string(refs).unwrap(), TINY_SHA);
    let requests = hub.requests();
    assert!(
        requests
            .iter()
            .any(|r| r == &format!("/api/models/{TINY_REPO}/revision/main")),
        "{requests:?}"
    );
    for shard in &shards {
        assert!(
            requests
                .iter()
                .any(|r| r.ends_with(&format!("/resolve/{TINY_SHA}/{shard}"))),
            "{shard} never requested: {requests:?}"
        );
    }
    assert!(
        requests.iter().any(|r| r.starts_with("/cdn/")),
        "no redirect followed"
    );

    // 2. A complete cache answers without the network.
    let before = hub.requests().len();
    assert_eq!(
        resolve_hub_checkpoint(TINY_REPO, "main", &options).unwrap(),
        snapshot
    );
    assert_eq!(
        hub.requests().len(),
        before,
        "a cache hit contacted the Hub"
    );

    // 3. A shard the Hub answers 404 for is named in the error.
    let err = resolve_hub_checkpoint(BROKEN_REPO, "main", &options).unwrap_err();
    match &err {
        HubError::Download { file, repo, .. } => {
            assert_eq!(file, &broken_shard);
            assert_eq!(repo, BROKEN_REPO);
        }
        other => panic!("expected a download error, got {other:?}"),
    }
    let message = err.to_string();
    assert!(message.contains(&broken_shard), "{message}");
    assert!(message.contains(&hub.endpoint()), "{message}");
    assert!(message.contains("main"), "{message}");

    // 4. Once the shard is there, only what is missing is fetched.
    hub.repo(BROKEN_REPO).unavailable.lock().unwrap().clear();
    let before = hub.requests().len();
    let broken_snapshot = resolve_hub_checkpoint(BROKEN_REPO, "main", &options).unwrap();
    assert_eq!(
        broken_snapshot,
        snapshot_dir(&cache, BROKEN_REPO, BROKEN_SHA)
    );
    let resumed: Vec<String> = hub.requests()[before..].to_vec();
    assert!(
        resumed.iter().all(|r| !r.ends_with("/config.json")),
        "config.json fetched again: {resumed:?}"
    );
    assert!(
        resumed.iter().any(|r| r.ends_with(&broken_shard)),
        "{resumed:?}"
    );

    // 5. With the server stopped: a cache hit still resolves, online or offline.
    hub.stop();
    assert_eq!(
        resolve_hub_checkpoint(TINY_REPO, "main", &options).unwrap(),
        snapshot
    );
    set_env("HF_HUB_OFFLINE", "1");
    let offline = HubOptions::from_env().unwrap();
    assert!(offline.offline);
    assert_eq!(
        resolve_hub_checkpoint(TINY_REPO, "main", &offline).unwrap(),
        snapshot
    );

    // 6. Offline with an empty cache (HF_HUB_CACHE wins over HF_HOME): a clear error.
    let empty = tmp.path().join("empty-cache");
    set_env("HF_HUB_CACHE", &empty);
    let offline_empty = HubOptions::from_env().unwrap();
    assert_eq!(offline_empty.cache_dir, empty);
    let err = resolve_hub_checkpoint(TINY_REPO, "main", &offline_empty).unwrap_err();
    assert!(matches!(err, HubError::OfflineNotCached { .. }), "{err:?}");
    let message = err.to_string();
    for needle in [
        TINY_REPO,
        "HF_HUB_OFFLINE",
        "DEEPINFER_HF_MODEL_DIR",
        "config.json",
    ] {
        assert!(
            message.contains(needle),
            "{needle:?} missing from: {message}"
        );
    }

    // 7. Online with an empty cache and the Hub unreachable: the error says what to do.
    remove_env("HF_HUB_OFFLINE");
    let online_empty = HubOptions::from_env().unwrap();
    let err = resolve_hub_checkpoint(TINY_REPO, "main", &online_empty).unwrap_err();
    assert!(matches!(err, HubError::RepoInfo { .. }), "{err:?}");
    let message = err.to_string();
    for needle in [TINY_REPO, "DEEPINFER_HF_MODEL_DIR", hub.endpoint().as_str()] {
        assert!(
            message.contains(needle),
            "{needle:?} missing from: {message}"
        );
    }

    // 8. The downloaded snapshot is a loadable checkpoint with the source's tensors.
    let loaded = Checkpoint::open(&snapshot).unwrap();
    let original = Checkpoint::open(&source).unwrap();
    assert_eq!(loaded.len(), original.len());
    assert!(!loaded.is_empty());
    for name in original.names() {
        let (a, b) = (loaded.tensor(name).unwrap(), original.tensor(name).unwrap());
        assert_eq!(a.shape, b.shape, "{name}");
        assert!(a.bytes == b.bytes, "{name} differs");
    }
}

#[test]
fn fake_hub_answers_ranges_like_the_hub() {
    let bytes: Vec<u8> = (0u8..10).collect();
    let part = ranged(&bytes, Some("bytes=0-0"), Vec::new());
    assert_eq!(part.status, "206 Partial Content");
    assert_eq!(part.body, [0]);
    assert!(
        part.headers
            .contains(&("content-range".to_string(), "bytes 0-0/10".to_string()))
    );
    let tail = ranged(&bytes, Some("bytes=7-"), Vec::new());
    assert_eq!(tail.body, [7, 8, 9]);
    assert_eq!(
        ranged(&bytes, Some("bytes=10-"), Vec::new()).status,
        "416 Range Not Satisfiable"
    );
    assert_eq!(ranged(&bytes, None, Vec::new()).body, bytes);
}
