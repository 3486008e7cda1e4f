//! The Hub download path against a loopback server that serves a tiny checkpoint the way the
//! Hugging Face Hub does (`/{repo}/resolve/{revision}/{file}`, `etag`, `x-repo-commit`,
//! ranged responses); the downloaded snapshot loads through the real loader.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::Path;
use std::sync::Arc;

use deepinfer_actors::model_source::{HubAccess, download_hub};
use deepinfer_model::config::ModelConfig;
use deepinfer_model::engram::CompressedVocab;
use deepinfer_model::{Model, checkpoint};

const REPO: &str = "deepinfer-test/tiny-v41";
const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// Serves `files` under `/{REPO}/resolve/main/`; returns the base URL.
fn serve(files: HashMap<String, Vec<u8>>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let files = Arc::new(files);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let files = files.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut request_line = String::new();
                reader.read_line(&mut request_line).unwrap();
                let mut range: Option<(usize, Option<usize>)> = None;
                loop {
                    let mut header = String::new();
                    if reader.read_line(&mut header).unwrap() == 0 || header == "\r\n" {
                        break;
                    }
                    let lower = header.to_ascii_lowercase();
                    if let Some(v) = lower.strip_prefix("range: bytes=") {
                        let (a, b) = v.trim().split_once('-').unwrap_or((v.trim(), ""));
                        range = a.parse().ok().map(|a| (a, b.parse().ok()));
                    }
                }
                let path = request_line.split_whitespace().nth(1).unwrap_or("");
                let prefix = format!("/{REPO}/resolve/main/");
                let body = path.strip_prefix(&prefix).and_then(|f| files.get(f));
                let response = match body {
                    None => {
                        b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                            .to_vec()
                    }
                    Some(data) => {
                        let (start, last) = range.unwrap_or((0, None));
                        let start = start.min(data.len());
                        let end = last.map_or(data.len(), |l| (l + 1).min(data.len()));
                        let slice = &data[start..end];
                        let mut head = format!(
                            "HTTP/1.1 206 Partial Content\r\netag: \"{:x}\"\r\nx-repo-commit: {COMMIT}\r\n\
                             Content-Range: bytes {start}-{}/{}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                            data.len(),
                            end.saturating_sub(1),
                            data.len(),
                            slice.len()
                        )
                        .into_bytes();
                        head.extend_from_slice(slice);
                        head
                    }
                };
                let _ = stream.write_all(&response);
            });
        }
    });
    format!("http://{addr}")
}

#[test]
fn hub_download_from_a_loopback_server_loads() {
    let source = tempfile::tempdir().unwrap();
    let cfg = ModelConfig::tiny_v41();
    checkpoint::write_random_checkpoint(&cfg, 3, source.path(), 2).unwrap();
    let mut files = HashMap::new();
    for entry in std::fs::read_dir(source.path()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        files.insert(name, std::fs::read(&path).unwrap());
    }
    assert!(
        files.contains_key("model.safetensors.index.json"),
        "{:?}",
        files.keys()
    );
    let endpoint = serve(files.clone());
    let cache = tempfile::tempdir().unwrap();
    let access = HubAccess {
        endpoint: Some(endpoint),
        cache_dir: Some(cache.path().to_path_buf()),
        progress: false,
    };
    let snapshot = download_hub(REPO, "main", &access).unwrap();
    for (name, data) in &files {
        let got = std::fs::read(snapshot.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(&got, data, "{name} differs after download");
    }
    let pad = cfg.engram.as_ref().map_or(2, |e| e.pad_token_id);
    let model = Model::load_with_vocab(
        &snapshot,
        Some(CompressedVocab::halving_stub(cfg.vocab_size, pad).unwrap()),
    )
    .unwrap();
    assert_eq!(model.config().vocab_size, 512);
    // A second resolution comes from the cache (the server is not needed for cached files).
    let again = download_hub(REPO, "main", &access).unwrap();
    assert_eq!(again, snapshot);
    assert!(Path::new(&again).join("config.json").is_file());
    // A repository the server does not have is a clear error naming it.
    let missing = download_hub("deepinfer-test/absent", "main", &access).unwrap_err();
    assert!(
        missing.to_string().contains("deepinfer-test/absent@main"),
        "{missing}"
    );
}
