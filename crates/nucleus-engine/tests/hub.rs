//! Model resolution against hub caches built in temporary folders (huggingface_hub's layout:
//! `models--OWNER--NAME/{refs,snapshots,blobs}`) and a hub endpoint served on loopback: no
//! test touches the network or the process environment.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nucleus_engine::hub::{gguf_matches_tag, resolve, resolve_spec, HubEnv, DEFAULT_ENDPOINT};
use nucleus_engine::EngineError;

const COMMIT_A: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
const COMMIT_B: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";

/// An offline [`HubEnv`] on the cache `cache`.
fn offline(cache: &Path) -> HubEnv {
    HubEnv {
        home: cache.join("home"),
        cache: cache.to_path_buf(),
        endpoint: DEFAULT_ENDPOINT.to_string(),
        offline: true,
        token: None,
    }
}

/// Writes `files` (path in the repo, bytes) into the snapshot `commit` of `repo` in `cache`,
/// as huggingface_hub does: each file's bytes in `blobs/`, the snapshot entry a relative
/// symbolic link to it; `refs` lists (ref name, commit).
fn put_snapshot(cache: &Path, repo: &str, commit: &str, refs: &[&str], files: &[(&str, &[u8])]) {
    let folder = cache.join(format!("models--{}", repo.replace('/', "--")));
    std::fs::create_dir_all(folder.join("blobs")).unwrap();
    for name in refs {
        let r = folder.join("refs").join(name);
        std::fs::create_dir_all(r.parent().unwrap()).unwrap();
        std::fs::write(r, commit).unwrap();
    }
    let snapshot = folder.join("snapshots").join(commit);
    for (i, (path, bytes)) in files.iter().enumerate() {
        let blob = format!("{commit}{i:04}");
        std::fs::write(folder.join("blobs").join(&blob), bytes).unwrap();
        let entry = snapshot.join(path);
        std::fs::create_dir_all(entry.parent().unwrap()).unwrap();
        let depth = path.split('/').count() + 1;
        let target = format!("{}blobs/{blob}", "../".repeat(depth));
        std::os::unix::fs::symlink(target, &entry).unwrap();
    }
}

fn snapshot(cache: &Path, repo: &str, commit: &str) -> PathBuf {
    cache
        .join(format!("models--{}", repo.replace('/', "--")))
        .join("snapshots")
        .join(commit)
}

fn not_found(r: nucleus_engine::Result<PathBuf>) -> String {
    match r {
        Err(EngineError::ModelNotFound(m)) => m,
        other => panic!("expected ModelNotFound, got {other:?}"),
    }
}

/// A transformers checkpoint with sharded weights, as a repository of the cache.
fn put_transformers(cache: &Path, repo: &str, commit: &str, refs: &[&str], shards: usize) {
    let index = br#"{"metadata": {}, "weight_map": {
        "a.weight": "model-00001-of-00002.safetensors",
        "b.weight": "model-00002-of-00002.safetensors",
        "c.weight": "model-00001-of-00002.safetensors"}}"#;
    let mut files: Vec<(&str, &[u8])> = vec![
        ("config.json", b"{}"),
        ("generation_config.json", b"{}"),
        ("tokenizer.json", b"{}"),
        ("tokenizer_config.json", b"{}"),
        ("special_tokens_map.json", b"{}"),
        ("model.safetensors.index.json", index),
        ("model-00001-of-00002.safetensors", b"1"),
        ("model-00002-of-00002.safetensors", b"2"),
    ];
    files.truncate(6 + shards);
    put_snapshot(cache, repo, commit, refs, &files);
}

#[test]
fn a_transformers_repo_id_resolves_to_its_snapshot_folder() {
    let dir = tempfile::tempdir().unwrap();
    put_transformers(dir.path(), "Org/Tiny", COMMIT_A, &["main"], 2);
    let env = offline(dir.path());
    let got = resolve_spec("Org/Tiny", &env, false).unwrap();
    assert_eq!(got, snapshot(dir.path(), "Org/Tiny", COMMIT_A));
    assert!(got.join("model-00002-of-00002.safetensors").is_file());
    // Through the CLI's entry too.
    assert_eq!(resolve(Some("Org/Tiny"), &env, false).unwrap(), got);

    // A shard the index names is missing: not usable from the cache.
    put_transformers(dir.path(), "Org/Half", COMMIT_A, &["main"], 1);
    let m = not_found(resolve_spec("Org/Half", &env, false));
    assert!(m.contains("model-00002-of-00002.safetensors"), "{m}");
    assert!(m.contains("--model PATH"), "{m}");
}

#[test]
fn a_revision_is_a_branch_in_refs_or_a_raw_commit() {
    let dir = tempfile::tempdir().unwrap();
    put_transformers(dir.path(), "Org/Tiny", COMMIT_A, &["main"], 2);
    put_transformers(dir.path(), "Org/Tiny", COMMIT_B, &["v1", "refs/pr/1"], 2);
    let env = offline(dir.path());
    let b = snapshot(dir.path(), "Org/Tiny", COMMIT_B);
    assert_eq!(resolve_spec("Org/Tiny@v1", &env, false).unwrap(), b);
    assert_eq!(resolve_spec("Org/Tiny@refs/pr/1", &env, false).unwrap(), b);
    let a = snapshot(dir.path(), "Org/Tiny", COMMIT_A);
    let raw = format!("Org/Tiny@{COMMIT_A}");
    assert_eq!(resolve_spec(&raw, &env, false).unwrap(), a);
    // A commit with no snapshot, a branch with no ref.
    let m = not_found(resolve_spec("Org/Tiny@v2", &env, false));
    assert!(m.contains("`Org/Tiny@v2`") && m.contains("refs/v2"), "{m}");
}

/// A GGUF repository: quantisations, a file in a folder, a projector.
fn put_gguf_repo(cache: &Path, repo: &str) {
    put_snapshot(
        cache,
        repo,
        COMMIT_A,
        &["main"],
        &[
            ("README.md", b"#"),
            ("Tiny-Q4_K_S.gguf", b"q4ks"),
            ("Tiny-Q4_K_M.gguf", b"q4km"),
            ("Tiny-Q8_0.gguf", b"q80"),
            ("mmproj-Tiny-Q4_K_M.gguf", b"proj"),
            ("BF16/Tiny-BF16.gguf", b"bf16"),
        ],
    );
}

#[test]
fn repo_colon_file_gguf_is_that_file() {
    let dir = tempfile::tempdir().unwrap();
    put_gguf_repo(dir.path(), "Org/Tiny-GGUF");
    let env = offline(dir.path());
    let got = resolve_spec("Org/Tiny-GGUF:BF16/Tiny-BF16.gguf", &env, false).unwrap();
    assert_eq!(std::fs::read(&got).unwrap(), b"bf16");
    let m = not_found(resolve_spec("Org/Tiny-GGUF:Nope.gguf", &env, false));
    assert!(m.contains("Nope.gguf") && m.contains("--model PATH"), "{m}");
}

#[test]
fn repo_colon_tag_picks_the_file_carrying_the_tag() {
    let dir = tempfile::tempdir().unwrap();
    put_gguf_repo(dir.path(), "Org/Tiny-GGUF");
    let env = offline(dir.path());
    let read = |spec: &str| std::fs::read(resolve_spec(spec, &env, false).unwrap()).unwrap();
    assert_eq!(read("Org/Tiny-GGUF:Q4_K_M"), b"q4km");
    assert_eq!(read("Org/Tiny-GGUF:q8_0"), b"q80");
    assert_eq!(read("Org/Tiny-GGUF:bf16"), b"bf16");
    // A whole token: Q4_K is in neither Q4_K_S nor Q4_K_M; the message lists the files.
    let m = not_found(resolve_spec("Org/Tiny-GGUF:Q4_K", &env, false));
    assert!(
        m.contains("`Q4_K`") && m.contains("`Tiny-Q4_K_S.gguf`"),
        "{m}"
    );
    assert!(m.contains("`BF16/Tiny-BF16.gguf`"), "{m}");

    assert!(gguf_matches_tag(
        "x/Model.Q4_K_M-00001-of-00002.gguf",
        "q4_k_m"
    ));
    assert!(!gguf_matches_tag("Model-Q4_K_M.bin", "Q4_K_M"));
    assert!(!gguf_matches_tag("mmproj-Model-Q4_K_M.gguf", "Q4_K_M"));
    assert!(!gguf_matches_tag("Model-IQ4_NL.gguf", "Q4_NL"));
}

#[test]
fn a_bare_gguf_repo_id_defaults_to_q4_k_m() {
    let dir = tempfile::tempdir().unwrap();
    put_gguf_repo(dir.path(), "Org/Tiny-GGUF");
    put_snapshot(
        dir.path(),
        "Org/One",
        COMMIT_B,
        &["main"],
        &[("one-f16.gguf", b"one")],
    );
    put_snapshot(
        dir.path(),
        "Org/Two",
        COMMIT_B,
        &["main"],
        &[("a-f16.gguf", b""), ("b-Q8_0.gguf", b"")],
    );
    let env = offline(dir.path());
    let got = resolve_spec("Org/Tiny-GGUF", &env, false).unwrap();
    assert_eq!(
        got,
        snapshot(dir.path(), "Org/Tiny-GGUF", COMMIT_A).join("Tiny-Q4_K_M.gguf")
    );
    // No Q4_K_M: the only GGUF file; several: an error listing them.
    assert_eq!(
        std::fs::read(resolve_spec("Org/One", &env, false).unwrap()).unwrap(),
        b"one"
    );
    let m = not_found(resolve_spec("Org/Two", &env, false));
    assert!(
        m.contains("`Q4_K_M`") && m.contains("`a-f16.gguf`, `b-Q8_0.gguf`"),
        "{m}"
    );
}

#[test]
fn several_files_matching_a_tag_are_an_error_listing_them() {
    let dir = tempfile::tempdir().unwrap();
    put_snapshot(
        dir.path(),
        "Org/Many",
        COMMIT_A,
        &["main"],
        &[
            ("a-Q4_K_M.gguf", b""),
            ("b/b-q4_k_m.gguf", b""),
            ("c-Q8_0.gguf", b""),
        ],
    );
    let m = not_found(resolve_spec("Org/Many:Q4_K_M", &offline(dir.path()), false));
    assert!(
        m.starts_with(
            "2 .gguf files of `Org/Many@main` carry the tag `Q4_K_M` (pass OWNER/NAME:FILE.gguf): "
        ),
        "{m}"
    );
    assert!(m.contains("`a-Q4_K_M.gguf`, `b/b-q4_k_m.gguf`"), "{m}");
}

#[test]
fn offline_and_not_cached_names_the_id_the_cache_and_model_path() {
    let dir = tempfile::tempdir().unwrap();
    let env = offline(dir.path());
    let m = not_found(resolve_spec("Org/Absent:Q4_K_M", &env, false));
    assert!(m.contains("`Org/Absent@main`"), "{m}");
    assert!(m.contains(&dir.path().display().to_string()), "{m}");
    assert!(
        m.contains("HF_HUB_OFFLINE") && m.contains("--model PATH"),
        "{m}"
    );
    // Never the token.
    let secret = HubEnv {
        token: Some("hf_secret123".into()),
        ..env
    };
    let m = not_found(resolve_spec("Org/Absent", &secret, false));
    assert!(!m.contains("hf_secret123"), "{m}");
    assert!(!format!("{secret:?}").contains("hf_secret123"));
}

#[test]
fn specs_that_are_neither_paths_nor_hub_ids_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let env = offline(dir.path());
    let m = not_found(resolve_spec("not an id", &env, false));
    assert!(
        m.contains("neither an existing path nor a Hugging Face hub id"),
        "{m}"
    );
    for bad in [
        "a/b/c",
        "a--b/c",
        "Org/Tiny:bad tag",
        "Org/Tiny:../x.gguf",
        "Org/Tiny@",
    ] {
        let m = not_found(resolve_spec(bad, &env, false));
        assert!(m.contains("neither an existing path"), "{bad}: {m}");
    }
    // Path-like and missing: "does not exist", never looked up on the hub.
    let m = not_found(resolve_spec("models/missing.gguf", &env, false));
    assert_eq!(m, "models/missing.gguf: does not exist");
    // An existing path is used as it is, also one that looks like a hub id.
    let file = dir.path().join("tokenizer.json");
    std::fs::write(&file, b"{}").unwrap();
    let spec = file.to_str().unwrap();
    assert_eq!(resolve_spec(spec, &env, false).unwrap(), file);
    let m = not_found(resolve_spec("/dev/zero", &env, false));
    assert!(m.contains("a character device"), "{m}");
}

#[test]
fn from_lookup_maps_the_variables_as_huggingface_hub_does() {
    let env = |vars: &[(&str, &str)]| {
        let vars: Vec<(String, OsString)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        HubEnv::from_lookup(move |k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
    };
    let e = env(&[("HOME", "/h")]);
    assert_eq!(e.home, Path::new("/h/.cache/huggingface"));
    assert_eq!(e.cache, Path::new("/h/.cache/huggingface/hub"));
    assert_eq!(e.endpoint, "https://huggingface.co");
    assert!(!e.offline);
    assert_eq!(e.token, None);
    let e = env(&[("HOME", "/h"), ("XDG_CACHE_HOME", "/x")]);
    assert_eq!(e.cache, Path::new("/x/huggingface/hub"));
    let e = env(&[("HF_HOME", "/hf"), ("XDG_CACHE_HOME", "/x")]);
    assert_eq!(
        (e.home.as_path(), e.cache.as_path()),
        (Path::new("/hf"), Path::new("/hf/hub"))
    );
    // HF_HUB_CACHE wins over HF_HOME (which still holds the token file).
    let e = env(&[("HF_HOME", "/hf"), ("HF_HUB_CACHE", "/c")]);
    assert_eq!(
        (e.home.as_path(), e.cache.as_path()),
        (Path::new("/hf"), Path::new("/c"))
    );
    let e = env(&[
        ("HF_ENDPOINT", "http://mirror.local/"),
        ("HF_HUB_OFFLINE", "1"),
        ("HF_TOKEN", "hf_x"),
    ]);
    assert_eq!(e.endpoint, "http://mirror.local");
    assert!(e.offline);
    assert_eq!(e.token.as_deref(), Some("hf_x"));
    for (v, on) in [
        ("true", true),
        ("YES", true),
        ("on", true),
        ("0", false),
        ("no", false),
        ("", false),
    ] {
        assert_eq!(env(&[("HF_HUB_OFFLINE", v)]).offline, on, "{v:?}");
    }
    assert_eq!(env(&[("HF_TOKEN", "")]).token, None);
}

/// What the loopback hub saw of one request: its request line and whether it carried the
/// expected bearer token.
type Seen = Vec<(String, bool)>;

/// Serves `connections` requests on 127.0.0.1 in a thread, as the hub does for hf-hub 0.4's
/// sync API: `GET /api/models/Org/Tiny-GGUF/revision/main` answers the listing (`siblings`,
/// `sha`); `GET /Org/Tiny-GGUF/resolve/main/FILE` answers a `Range: bytes=S-[E]` request
/// with 206, `x-repo-commit`, `etag`, `content-range` and `content-length` (hf-hub first asks
/// for `bytes=0-0` for the metadata, then `bytes=0-` for the file). Every connection is read
/// with a timeout and the server stops after `connections` or 10 s, so a test cannot hang.
fn serve(
    repo: &'static str,
    connections: usize,
    files: Vec<(&'static str, Vec<u8>)>,
) -> (String, std::thread::JoinHandle<Seen>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let handle = std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut seen = Seen::new();
        while seen.len() < connections && Instant::now() < deadline {
            let stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
            };
            stream.set_nonblocking(false).unwrap();
            stream
                .set_read_timeout(Some(Duration::from_secs(5)))
                .unwrap();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut line = String::new();
            if reader.read_line(&mut line).is_err() {
                continue;
            }
            let (mut auth, mut range) = (false, None);
            loop {
                let mut h = String::new();
                if reader.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
                    break;
                }
                let (name, value) = h.split_once(':').unwrap_or((&h, ""));
                let value = value.trim().to_string();
                match name.to_ascii_lowercase().as_str() {
                    "authorization" => auth = value == "Bearer hf_test_token",
                    "range" => range = Some(value),
                    _ => {}
                }
            }
            let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
            let mut out = stream;
            let response = if path == format!("/api/models/{repo}/revision/main") {
                let siblings: Vec<String> = files
                    .iter()
                    .map(|(f, _)| format!("{{\"rfilename\":\"{f}\"}}"))
                    .collect();
                let body = format!(
                    "{{\"sha\":\"{COMMIT_A}\",\"siblings\":[{}]}}",
                    siblings.join(",")
                );
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                [head.into_bytes(), body.into_bytes()].concat()
            } else if let Some((_, bytes)) = path
                .strip_prefix(&format!("/{repo}/resolve/main/"))
                .and_then(|f| files.iter().find(|(n, _)| *n == f))
            {
                let (start, end) = range
                    .as_deref()
                    .and_then(|r| r.strip_prefix("bytes="))
                    .and_then(|r| r.split_once('-'))
                    .map(|(s, e)| (s.parse().unwrap_or(0), e.parse().unwrap_or(bytes.len() - 1)))
                    .unwrap_or((0, bytes.len() - 1));
                let body = &bytes[start..=end.min(bytes.len() - 1)];
                let head = format!(
                    "HTTP/1.1 206 Partial Content\r\nx-repo-commit: {COMMIT_A}\r\netag: \"0123abcd\"\r\n\
                     content-range: bytes {start}-{}/{}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    start + body.len() - 1,
                    bytes.len(),
                    body.len()
                );
                [head.into_bytes(), body.to_vec()].concat()
            } else {
                b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".to_vec()
            };
            let _ = out.write_all(&response);
            let _ = out.flush();
            seen.push((line.trim().to_string(), auth));
        }
        seen
    });
    (endpoint, handle)
}

#[test]
fn hf_endpoint_and_token_reach_a_mirror_and_the_file_lands_in_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let weights: Vec<u8> = (0..=255u8).cycle().take(3000).collect();
    let (endpoint, server) = serve(
        "Org/Tiny-GGUF",
        3,
        vec![
            ("Tiny-Q8_0.gguf", b"q8".to_vec()),
            ("Tiny-Q4_K_M.gguf", weights.clone()),
        ],
    );
    let env = HubEnv {
        endpoint,
        offline: false,
        token: Some("hf_test_token".to_string()),
        ..offline(dir.path())
    };
    let got = resolve(Some("Org/Tiny-GGUF:Q4_K_M"), &env, false).unwrap();
    let seen = server.join().unwrap();
    assert_eq!(std::fs::read(&got).unwrap(), weights);
    assert_eq!(
        got,
        snapshot(dir.path(), "Org/Tiny-GGUF", COMMIT_A).join("Tiny-Q4_K_M.gguf")
    );
    let lines: Vec<&str> = seen.iter().map(|(l, _)| l.as_str()).collect();
    assert_eq!(
        lines,
        [
            "GET /api/models/Org/Tiny-GGUF/revision/main HTTP/1.1",
            "GET /Org/Tiny-GGUF/resolve/main/Tiny-Q4_K_M.gguf HTTP/1.1",
            "GET /Org/Tiny-GGUF/resolve/main/Tiny-Q4_K_M.gguf HTTP/1.1",
        ]
    );
    assert!(seen.iter().all(|(_, auth)| *auth), "{seen:?}");
    // Now cached: offline finds it.
    let cached = resolve_spec(
        "Org/Tiny-GGUF:Q4_K_M",
        &HubEnv {
            offline: true,
            ..env.clone()
        },
        false,
    );
    assert_eq!(cached.unwrap(), got);
}

#[test]
fn online_a_transformers_repo_downloads_its_folder() {
    let dir = tempfile::tempdir().unwrap();
    let files = vec![
        ("README.md", b"#".to_vec()),
        ("config.json", b"{\"model_type\":\"llama\"}".to_vec()),
        ("tokenizer.json", b"{}".to_vec()),
        ("model.safetensors", vec![7u8; 1000]),
        ("pytorch_model.bin", b"never fetched".to_vec()),
    ];
    // The listing, then two requests (metadata, body) for each of the three files needed.
    let (endpoint, server) = serve("Org/Tiny", 7, files);
    let env = HubEnv {
        endpoint,
        offline: false,
        ..offline(dir.path())
    };
    let got = resolve(Some("Org/Tiny"), &env, false).unwrap();
    let seen = server.join().unwrap();
    assert_eq!(got, snapshot(dir.path(), "Org/Tiny", COMMIT_A));
    assert_eq!(
        std::fs::read(got.join("model.safetensors")).unwrap(),
        vec![7u8; 1000]
    );
    assert!(got.join("tokenizer.json").is_file() && !got.join("pytorch_model.bin").exists());
    assert_eq!(seen.len(), 7, "{seen:?}");
    // No token given: none sent.
    assert!(seen.iter().all(|(_, auth)| !auth), "{seen:?}");
}

#[test]
fn a_failing_network_falls_back_to_the_cache_and_else_says_so() {
    let dir = tempfile::tempdir().unwrap();
    // A port with no server: bind, then drop.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let env = HubEnv {
        endpoint: format!("http://127.0.0.1:{port}"),
        offline: false,
        ..offline(dir.path())
    };
    let m = not_found(resolve_spec("Org/Tiny-GGUF", &env, false));
    assert!(
        m.contains("`Org/Tiny-GGUF@main`") && m.contains("fetching from http://127.0.0.1"),
        "{m}"
    );
    assert!(
        m.ends_with("pass --model PATH to a GGUF file or a Hugging Face model folder"),
        "{m}"
    );
    put_gguf_repo(dir.path(), "Org/Tiny-GGUF");
    let got = resolve_spec("Org/Tiny-GGUF", &env, false).unwrap();
    assert_eq!(std::fs::read(got).unwrap(), b"q4km");
}
