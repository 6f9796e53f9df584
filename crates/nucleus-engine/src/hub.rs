//! Where the model comes from: a local path (a GGUF file, a Hugging Face model folder, a
//! `tokenizer.json`), `NUCLEUS_MODEL`, or the Hugging Face hub, resolved as the Hugging Face
//! tools do it.
//!
//! # Model specs
//!
//! [`resolve`] takes the CLI's `--model` string:
//!
//! - a path that exists is used as it is (it must be a regular file or a directory);
//! - `OWNER/NAME[@REVISION]`: a hub repository, at `REVISION` (a branch, a tag or a 40-hex
//!   commit; default `main`). A repository with a `config.json` (a transformers checkpoint)
//!   resolves to its snapshot folder, holding `config.json`, `tokenizer.json`, the safetensors
//!   weights (`model.safetensors`, or `model.safetensors.index.json` and every shard it names)
//!   and, where the repository has them, `generation_config.json`, `tokenizer_config.json`,
//!   `special_tokens_map.json`, `chat_template.jinja` and `chat_template.json`. A repository
//!   without `config.json` is a GGUF repository: the id resolves as `OWNER/NAME:Q4_K_M`, the
//!   default of llama.cpp's `-hf` (`common_get_hf_file` in `common/arg.cpp`, later
//!   `common/download.cpp`: the tag defaults to "latest", "Q4_K_M first, then Q4, then the
//!   first GGUF file"); where no file carries Q4_K_M and the repository has exactly one GGUF
//!   file, that one (we do not guess among several: the error lists them).
//! - `OWNER/NAME[@REVISION]:FILE.gguf`: that file (a path inside the repository);
//! - `OWNER/NAME[@REVISION]:TAG`: the one `.gguf` file whose name carries the quantisation
//!   tag, llama.cpp's `-hf REPO:TAG` (the spec split at `:`, as `common_get_hf_file` splits
//!   it). llama.cpp lets the hub pick the file (its Ollama-compatible
//!   `/v2/OWNER/NAME/manifests/TAG` answer); we match the repository's listing locally, the
//!   same way for the cache and for a mirror: the tag case-insensitively against the file's
//!   name (its last path component), as a whole token, bounded by the name's start or end or
//!   a character other than an ASCII letter, digit or `_` (so `Q4_K` does not pick
//!   `...-Q4_K_M.gguf`, and `q4` does not pick it either, where the hub's manifest would).
//!   Multimodal projector files (`mmproj*`) are never picked. Several matches (split GGUF
//!   shards included) are an error listing them; none is an error listing the repository's
//!   GGUF files.
//!
//! Online, the repository's files are its listing on the hub (`api.repo(..).info()` siblings);
//! offline (`HF_HUB_OFFLINE`, or when the hub cannot be reached), the files of the cached
//! snapshot (`refs/REVISION` -> `snapshots/COMMIT/`), so a tag or a bare id matches among the
//! files already downloaded.
//!
//! A spec that does not exist as a path and is not of these forms is an error
//! ([`EngineError::ModelNotFound`]); so is one that looks like a path (starts with `/`, `.`
//! or `~`, or its name ends in `.gguf`) and does not exist, which is never looked up on the
//! hub. Hub ids are checked as huggingface_hub's `validate_repo_id` does: letters, digits,
//! `-`, `_`, `.`; no `--` or `..`; at most 96 characters.
//!
//! # Environment
//!
//! [`HubEnv`] holds what huggingface_hub reads from the environment (its `constants.py`):
//! `HF_HOME`, `HF_HUB_CACHE`, `HF_ENDPOINT`, `HF_HUB_OFFLINE`, `HF_TOKEN`. Every resolution
//! function takes a `&HubEnv`, so that a caller (or a test) can pass values without touching
//! the process environment.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::error::{bounded, quote, shown_path, EngineError, Result};

/// The hub repository of the default model (llama.cpp's CI models).
pub const DEFAULT_REPO: &str = "ggml-org/models";
/// The default model's file in [`DEFAULT_REPO`]: Karpathy's 260K-parameter TinyStories Llama.
pub const DEFAULT_FILE: &str = "tinyllamas/stories260K.gguf";
/// The environment variable naming a model file.
pub const MODEL_ENV: &str = "NUCLEUS_MODEL";
/// The hub endpoint when `HF_ENDPOINT` is not set (huggingface_hub's `ENDPOINT`).
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
/// The quantisation tag a GGUF repository's bare id resolves to (llama.cpp's default).
pub const DEFAULT_TAG: &str = "Q4_K_M";
/// The most files of a snapshot folder that an offline listing reads (a bound on a cache
/// folder that is not one).
const MAX_LISTED_FILES: usize = 10_000;
/// The most file names an error message lists.
const MAX_NAMES_SHOWN: usize = 8;

/// The Hugging Face hub settings of a process, as huggingface_hub reads them from the
/// environment (`huggingface_hub/constants.py`).
///
/// Build one with [`HubEnv::from_env`] (the process environment) or [`HubEnv::from_lookup`]
/// (any lookup, e.g. a test's table). `Debug` never shows the token.
#[derive(Clone, PartialEq, Eq)]
pub struct HubEnv {
    /// `HF_HOME`: default `$XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface`. The
    /// token file is `HOME/token`.
    pub home: PathBuf,
    /// The hub cache: `HF_HUB_CACHE` when set, else `HOME/hub`.
    pub cache: PathBuf,
    /// `HF_ENDPOINT` without trailing `/`; default [`DEFAULT_ENDPOINT`].
    pub endpoint: String,
    /// `HF_HUB_OFFLINE` is true (`1`, `ON`, `YES` or `TRUE`, any case): resolve from the cache
    /// only, never touching the network.
    pub offline: bool,
    /// `HF_TOKEN` (when set and not empty; [`HubEnv::from_env`] also reads `HOME/token`):
    /// sent as `Authorization: Bearer ...` (gated and private models).
    pub token: Option<String>,
}

impl std::fmt::Debug for HubEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubEnv")
            .field("home", &self.home)
            .field("cache", &self.cache)
            .field("endpoint", &self.endpoint)
            .field("offline", &self.offline)
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .finish()
    }
}

impl HubEnv {
    /// The settings of this process's environment ([`HubEnv::from_lookup`] over
    /// `std::env::var_os`), and when `HF_TOKEN` is not set, the token saved by
    /// `huggingface-cli login` in `HF_HOME/token` (huggingface_hub's `HF_TOKEN_PATH`).
    pub fn from_env() -> Self {
        let mut env = Self::from_lookup(|k| std::env::var_os(k));
        if env.token.is_none() {
            env.token = std::fs::read_to_string(env.home.join("token"))
                .ok()
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty());
        }
        env
    }

    /// The settings that `get` (an environment lookup: variable name to value) gives, as
    /// huggingface_hub's `constants.py` computes them:
    ///
    /// - `HF_HOME`, else `$XDG_CACHE_HOME/huggingface`, else `$HOME/.cache/huggingface`;
    /// - `HF_HUB_CACHE` (the cache itself, winning over `HF_HOME`), else `HF_HOME/hub`;
    /// - `HF_ENDPOINT` with trailing `/` removed, else [`DEFAULT_ENDPOINT`];
    /// - `HF_HUB_OFFLINE`: true for `1`, `ON`, `YES`, `TRUE` (any case, as `_is_true`);
    /// - `HF_TOKEN`, when not empty (leading and trailing white space removed).
    ///
    /// Empty values count as unset. Reads nothing but `get`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<OsString>) -> Self {
        let var = |k: &str| get(k).filter(|v| !v.is_empty());
        let home = match var("HF_HOME") {
            Some(h) => PathBuf::from(h),
            None => match var("XDG_CACHE_HOME") {
                Some(x) => PathBuf::from(x).join("huggingface"),
                None => var("HOME")
                    .map(PathBuf::from)
                    .unwrap_or_default()
                    .join(".cache")
                    .join("huggingface"),
            },
        };
        let cache = var("HF_HUB_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| home.join("hub"));
        let endpoint = var("HF_ENDPOINT")
            .map(|e| e.to_string_lossy().trim_end_matches('/').to_string())
            .filter(|e| !e.is_empty())
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
        let offline = var("HF_HUB_OFFLINE").is_some_and(|v| {
            matches!(
                v.to_string_lossy().trim().to_ascii_uppercase().as_str(),
                "1" | "ON" | "YES" | "TRUE"
            )
        });
        let token = var("HF_TOKEN")
            .map(|t| t.to_string_lossy().trim().to_string())
            .filter(|t| !t.is_empty());
        Self {
            home,
            cache,
            endpoint,
            offline,
            token,
        }
    }

    /// The hf-hub client for these settings: cache, endpoint, token; a progress bar on
    /// downloads when `progress`.
    fn api(&self, progress: bool) -> Result<hf_hub::api::sync::Api, hf_hub::api::sync::ApiError> {
        // `from_cache`, not `new`: `new` looks for a home folder and panics without one.
        hf_hub::api::sync::ApiBuilder::from_cache(hf_hub::Cache::new(self.cache.clone()))
            .with_endpoint(self.endpoint.clone())
            .with_token(self.token.clone())
            .with_progress(progress)
            .build()
    }
}

/// A parsed hub spec: `OWNER/NAME[@REVISION][:FILE.gguf|:TAG]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubSpec {
    /// `OWNER/NAME`.
    pub repo: String,
    /// The revision: a branch, tag or commit; `main` when not given.
    pub revision: String,
    /// What was after `:`.
    pub select: Option<Select>,
}

/// The part of a [`HubSpec`] after `:`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Select {
    /// A file path inside the repository (it ends in `.gguf`, any case).
    File(String),
    /// A quantisation tag such as `Q4_K_M`, matched as the module docs say.
    Tag(String),
}

impl HubSpec {
    /// Parses `spec` as `OWNER/NAME[@REVISION][:FILE.gguf|:TAG]`; `None` when it is not one.
    pub fn parse(spec: &str) -> Option<Self> {
        let (repo_rev, select) = match spec.split_once(':') {
            Some((a, b)) => (a, Some(b)),
            None => (spec, None),
        };
        let (repo, revision) = match repo_rev.split_once('@') {
            Some((r, rev)) => (r, Some(rev)),
            None => (repo_rev, None),
        };
        let (owner, name) = repo.split_once('/')?;
        if !valid_id_part(owner) || !valid_id_part(name) || repo.len() > 96 {
            return None;
        }
        if name.to_ascii_lowercase().ends_with(".gguf") {
            return None;
        }
        let revision = match revision {
            None => "main".to_string(),
            Some(r)
                if !r.is_empty()
                    && r.len() <= 255
                    && !r.contains("..")
                    && !r.starts_with('/')
                    && r.chars().all(|c| c.is_ascii_graphic() && c != '\\') =>
            {
                r.to_string()
            }
            Some(_) => return None,
        };
        let select = match select {
            None => None,
            Some(s) if s.to_ascii_lowercase().ends_with(".gguf") => {
                if s.starts_with('/')
                    || s.split('/').any(|c| c.is_empty() || c == "." || c == "..")
                    || s.chars().any(|c| c.is_control() || c == '\\')
                {
                    return None;
                }
                Some(Select::File(s.to_string()))
            }
            Some(s)
                if !s.is_empty()
                    && s.len() <= 64
                    && s.chars()
                        .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c)) =>
            {
                Some(Select::Tag(s.to_string()))
            }
            Some(_) => return None,
        };
        Some(Self {
            repo: repo.to_string(),
            revision,
            select,
        })
    }
}

/// One side of a repo id, as huggingface_hub's `validate_repo_id` accepts it.
fn valid_id_part(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !s.contains("--")
        && !s.contains("..")
        && !s.starts_with(['-', '.'])
        && !s.ends_with(['-', '.'])
}

/// Resolves the model for the CLI: `spec` if given, else `$NUCLEUS_MODEL` (when set and not
/// empty), else [`DEFAULT_FILE`] from [`DEFAULT_REPO`] (from the cache, else downloaded once
/// unless `env` is offline). A spec (either way) is resolved by [`resolve_spec`]. Downloads
/// show hf-hub's progress bar only when `progress`.
///
/// # Errors
/// [`EngineError::ModelNotFound`], as [`resolve_spec`] says; a message about
/// `$NUCLEUS_MODEL` starts with `NUCLEUS_MODEL=`. For the default model, when it is not cached
/// and cannot be fetched: the message names the repository, the cache searched and says to
/// pass `--model PATH`.
pub fn resolve(spec: Option<&str>, env: &HubEnv, progress: bool) -> Result<PathBuf> {
    if let Some(spec) = spec {
        return resolve_spec(spec, env, progress);
    }
    if let Some(value) = std::env::var_os(MODEL_ENV).filter(|v| !v.is_empty()) {
        let from_spec = match value.to_str() {
            Some(s) => resolve_spec(s, env, progress),
            None => check_path(Path::new(&value)),
        };
        return from_spec.map_err(|e| match e {
            EngineError::ModelNotFound(m) => EngineError::ModelNotFound(format!("{MODEL_ENV}={m}")),
            other => other,
        });
    }
    resolve_default(env, progress)
}

/// Resolves one model spec (see the module docs): an existing path as it is, else a hub id.
///
/// # Errors
/// [`EngineError::ModelNotFound`] when the path exists but is not a regular file or directory
/// (a device, a FIFO), cannot be inspected; when it neither exists nor is a hub id; when the
/// hub repository has no file matching the tag (or several), no `config.json` and no GGUF
/// file, or misses a file a transformers folder needs; and when the files are not cached and
/// cannot be fetched (offline, or the network failed): the message names the id, the cache
/// folder searched, and says to pass `--model PATH`.
pub fn resolve_spec(spec: &str, env: &HubEnv, progress: bool) -> Result<PathBuf> {
    let path = Path::new(spec);
    match std::fs::symlink_metadata(path) {
        Ok(_) => return check_path(path),
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return check_path(path),
        Err(_) => {}
    }
    let looks_like_path = spec.starts_with(['/', '.', '~'])
        || spec.contains('\\')
        || (!spec.contains(':') && spec.to_ascii_lowercase().ends_with(".gguf"));
    match HubSpec::parse(spec) {
        Some(hub) if !looks_like_path => resolve_hub(&hub, env, progress),
        _ if looks_like_path => Err(EngineError::ModelNotFound(format!(
            "{}: does not exist",
            shown_path(path)
        ))),
        _ => Err(EngineError::ModelNotFound(format!(
            "{}: is neither an existing path nor a Hugging Face hub id \
             (OWNER/NAME[@REVISION][:FILE.gguf|:QUANT])",
            quote(spec.as_bytes())
        ))),
    }
}

/// Resolves the model: `explicit` if given, else `$NUCLEUS_MODEL` (when set and not empty),
/// else [`DEFAULT_FILE`] from [`DEFAULT_REPO`] through the hub cache of [`HubEnv::from_env`]
/// (downloading it once, without a progress bar). Paths only: hub ids are [`resolve`]'s.
///
/// A given path (either way, symbolic links followed) must be a regular file (a GGUF file) or a
/// directory (a Hugging Face model folder, for [`crate::load_model`]): not a device
/// (`/dev/zero`), a FIFO or a socket, which a loader could block on or read forever.
///
/// # Errors
/// [`EngineError::ModelNotFound`] when the given path does not exist, cannot be inspected
/// (e.g. permission denied), or is neither a regular file nor a directory; the message starts
/// with the path, as `NUCLEUS_MODEL=PATH` when it came from the environment. Also when no path
/// was given and the hub cannot be reached (offline); the message then says to pass
/// `--model`.
pub fn resolve_model(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(path) = explicit {
        return check_path(path);
    }
    if let Some(value) = std::env::var_os(MODEL_ENV).filter(|v| !v.is_empty()) {
        return check_path(Path::new(&value)).map_err(|e| match e {
            EngineError::ModelNotFound(m) => EngineError::ModelNotFound(format!("{MODEL_ENV}={m}")),
            other => other,
        });
    }
    resolve_default(&HubEnv::from_env(), false)
}

/// `path` when it is a regular file or a directory (symbolic links followed).
fn check_path(path: &Path) -> Result<PathBuf> {
    let what = match std::fs::metadata(path) {
        Ok(m) if m.is_file() || m.is_dir() => return Ok(path.to_path_buf()),
        Ok(m) => format!(
            "is not a regular file or directory ({}); pass a GGUF file or a Hugging Face \
             model folder",
            file_kind(&m.file_type())
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => "does not exist".to_string(),
        Err(e) => format!("cannot be inspected: {e}"),
    };
    Err(EngineError::ModelNotFound(format!(
        "{}: {what}",
        shown_path(path)
    )))
}

/// [`DEFAULT_FILE`] of [`DEFAULT_REPO`], cached or fetched.
fn resolve_default(env: &HubEnv, progress: bool) -> Result<PathBuf> {
    let spec = HubSpec {
        repo: DEFAULT_REPO.to_string(),
        revision: "main".to_string(),
        select: Some(Select::File(DEFAULT_FILE.to_string())),
    };
    resolve_hub(&spec, env, progress).map_err(|e| match e {
        EngineError::ModelNotFound(m) => {
            EngineError::ModelNotFound(format!("no --model given and {MODEL_ENV} is not set: {m}"))
        }
        other => other,
    })
}

/// Resolves a parsed hub spec: from the cache only when `env.offline`; else online, and from
/// the cache when the network fails.
///
/// # Errors
/// As [`resolve_spec`].
pub fn resolve_hub(spec: &HubSpec, env: &HubEnv, progress: bool) -> Result<PathBuf> {
    if env.offline {
        return resolve_cached(spec, env)
            .map_err(|e| e.into_error(spec, env, "HF_HUB_OFFLINE is set"));
    }
    match resolve_online(spec, env, progress) {
        Ok(path) => Ok(path),
        Err(Online::Refused(e)) => Err(e),
        Err(Online::Network(net)) => resolve_cached(spec, env).map_err(|e| {
            let why = cut(
                &format!("fetching from {} failed: {net}", env.endpoint),
                200,
            );
            e.into_error(spec, env, &why)
        }),
    }
}

/// Why an online resolution failed.
enum Online {
    /// The hub answered, and the answer cannot be used (no matching file): final.
    Refused(EngineError),
    /// The hub could not be reached or failed: try the cache.
    Network(String),
}

/// Why a cache lookup failed.
enum Cached {
    /// The repository (revision) or a file is not in the cache.
    Missing(String),
    /// It is cached, and the files there cannot be used (no matching file): final.
    Refused(EngineError),
}

impl Cached {
    fn into_error(self, spec: &HubSpec, env: &HubEnv, why: &str) -> EngineError {
        match self {
            Cached::Refused(e) => e,
            // Each part is bounded (a quoted id, shown paths, `why` cut), the hint at the end
            // always shown.
            Cached::Missing(what) => EngineError::ModelNotFound(format!(
                "{} is not (or not wholly) in the Hugging Face cache at {} ({}) and {why}; pass --model PATH \
                 to a GGUF file or a Hugging Face model folder",
                spec_name(spec),
                shown_path(&env.cache),
                cut(&what, 300),
            )),
        }
    }
}

/// `text` escaped as [`bounded`] does and cut to at most `max` bytes (ending in `…` when cut).
fn cut(text: &str, max: usize) -> String {
    let mut out = bounded(text);
    if out.len() > max {
        let mut at = max - '…'.len_utf8();
        while !out.is_char_boundary(at) {
            at -= 1;
        }
        out.truncate(at);
        out.push('…');
    }
    out
}

/// `OWNER/NAME@REVISION`, for messages.
fn spec_name(spec: &HubSpec) -> String {
    quote(format!("{}@{}", spec.repo, spec.revision).as_bytes())
}

/// The folder of `repo` in the cache (`models--OWNER--NAME`, huggingface_hub's layout).
fn repo_folder(env: &HubEnv, repo: &str) -> PathBuf {
    env.cache
        .join(format!("models--{}", repo.replace('/', "--")))
}

/// Whether `s` is a full commit hash (40 hex digits).
fn is_commit(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The snapshot folder of `spec` in the cache: `refs/REVISION` names the commit, a revision
/// that is a commit is used directly.
fn cached_snapshot(spec: &HubSpec, env: &HubEnv) -> Result<PathBuf, Cached> {
    let folder = repo_folder(env, &spec.repo);
    let commit = if is_commit(&spec.revision) {
        spec.revision.to_ascii_lowercase()
    } else {
        let refs = folder.join("refs").join(&spec.revision);
        match std::fs::read_to_string(&refs) {
            Ok(c) if is_commit(c.trim()) => c.trim().to_string(),
            Ok(_) => {
                return Err(Cached::Missing(format!(
                    "{} holds no commit",
                    shown_path(&refs)
                )))
            }
            Err(_) => return Err(Cached::Missing(format!("no {}", shown_path(&refs)))),
        }
    };
    let snapshot = folder.join("snapshots").join(commit);
    if snapshot.is_dir() {
        Ok(snapshot)
    } else {
        Err(Cached::Missing(format!("no {}", shown_path(&snapshot))))
    }
}

/// The files under `dir`, as `/`-separated paths relative to it (links followed), at most
/// [`MAX_LISTED_FILES`].
fn list_files(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![(dir.to_path_buf(), String::new(), 0usize)];
    while let Some((path, prefix, depth)) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&path) else {
            continue;
        };
        for entry in entries.flatten() {
            let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            let rel = if prefix.is_empty() {
                name
            } else {
                format!("{prefix}/{name}")
            };
            match std::fs::metadata(entry.path()) {
                Ok(m) if m.is_file() => out.push(rel),
                Ok(m) if m.is_dir() && depth < 8 => stack.push((entry.path(), rel, depth + 1)),
                _ => {}
            }
            if out.len() >= MAX_LISTED_FILES {
                return out;
            }
        }
    }
    out.sort();
    out
}

/// Resolves `spec` from the cache alone.
fn resolve_cached(spec: &HubSpec, env: &HubEnv) -> Result<PathBuf, Cached> {
    let snapshot = cached_snapshot(spec, env)?;
    let files = list_files(&snapshot);
    let has = |f: &str| files.iter().any(|x| x == f);
    let missing = |f: &str| Cached::Missing(format!("no {f} in {}", shown_path(&snapshot)));
    match &spec.select {
        Some(Select::File(f)) => {
            if has(f) {
                Ok(snapshot.join(f))
            } else {
                Err(missing(f))
            }
        }
        Some(Select::Tag(tag)) => {
            let f = pick_gguf(spec, &files, tag, false).map_err(Cached::Refused)?;
            Ok(snapshot.join(f))
        }
        None if has("config.json") => {
            for f in transformers_files(&files, |index| {
                std::fs::read(snapshot.join(index)).map_err(|e| e.to_string())
            })
            .map_err(|m| {
                Cached::Refused(EngineError::ModelNotFound(bounded(format!(
                    "{}: {m}",
                    spec_name(spec)
                ))))
            })? {
                if !has(&f) {
                    return Err(missing(&f));
                }
            }
            Ok(snapshot)
        }
        None => {
            let f = pick_gguf(spec, &files, DEFAULT_TAG, true).map_err(Cached::Refused)?;
            Ok(snapshot.join(f))
        }
    }
}

/// Resolves `spec` through the hub: the repository's listing (`api.repo(..).info()`
/// siblings), then each needed file from the cache or downloaded.
fn resolve_online(spec: &HubSpec, env: &HubEnv, progress: bool) -> Result<PathBuf, Online> {
    let net = |e: &dyn std::fmt::Display| Online::Network(bounded(e.to_string()));
    let api = env.api(progress).map_err(|e| net(&e))?;
    let repo = api.repo(hf_hub::Repo::with_revision(
        spec.repo.clone(),
        hf_hub::RepoType::Model,
        spec.revision.clone(),
    ));
    let get = |f: &str| {
        repo.get(f)
            .map_err(|e| net(&format!("{}: {e}", quote(f.as_bytes()))))
    };
    if let Some(Select::File(f)) = &spec.select {
        return get(f);
    }
    let info = repo.info().map_err(|e| net(&e))?;
    let files: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();
    match &spec.select {
        Some(Select::Tag(tag)) => {
            get(&pick_gguf(spec, &files, tag, false).map_err(Online::Refused)?)
        }
        _ if files.iter().any(|f| f == "config.json") => {
            let index = "model.safetensors.index.json";
            let sharded =
                !files.iter().any(|f| f == "model.safetensors") && files.iter().any(|f| f == index);
            let index_path = if sharded { Some(get(index)?) } else { None };
            let needed = transformers_files(&files, |index| match &index_path {
                Some(path) => std::fs::read(path).map_err(|e| format!("{index}: {e}")),
                None => Err(format!("{index} was not fetched")),
            })
            .map_err(|m| {
                Online::Refused(EngineError::ModelNotFound(bounded(format!(
                    "{}: {m}",
                    spec_name(spec)
                ))))
            })?;
            let mut folder = None;
            for f in &needed {
                let path = get(f)?;
                if f == "config.json" {
                    folder = path.parent().map(Path::to_path_buf);
                }
            }
            folder.ok_or_else(|| Online::Network("config.json has no folder".to_string()))
        }
        _ => get(&pick_gguf(spec, &files, DEFAULT_TAG, true).map_err(Online::Refused)?),
    }
}

/// The files a transformers folder needs from a repository listing `files`: config.json,
/// tokenizer.json, the weights (`model.safetensors`, else `model.safetensors.index.json` and
/// every shard its `weight_map` names, `read_index` giving the index's bytes), and the
/// optional files that are listed.
fn transformers_files(
    files: &[String],
    read_index: impl FnOnce(&str) -> Result<Vec<u8>, String>,
) -> Result<Vec<String>, String> {
    const OPTIONAL: [&str; 5] = [
        "generation_config.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "chat_template.json",
    ];
    let has = |f: &str| files.iter().any(|x| x == f);
    if !has("tokenizer.json") {
        return Err("the repository has config.json but no tokenizer.json".to_string());
    }
    let mut needed = vec!["config.json".to_string(), "tokenizer.json".to_string()];
    needed.extend(OPTIONAL.iter().filter(|f| has(f)).map(|f| f.to_string()));
    if has("model.safetensors") {
        needed.push("model.safetensors".to_string());
    } else if has("model.safetensors.index.json") {
        let index = "model.safetensors.index.json";
        let bytes = read_index(index)?;
        let json: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| format!("{index}: {e}"))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| format!("{index} has no weight_map object"))?;
        let mut shards: Vec<String> = Vec::new();
        for v in map.values() {
            let shard = v
                .as_str()
                .filter(|s| {
                    !s.is_empty() && !s.starts_with('/') && !s.split('/').any(|c| c == "..")
                })
                .ok_or_else(|| format!("{index}: a weight_map value is not a file name"))?;
            if !shards.iter().any(|s| s == shard) {
                shards.push(shard.to_string());
            }
        }
        shards.sort();
        needed.push(index.to_string());
        needed.extend(shards);
    } else {
        return Err(
            "the repository has config.json but neither model.safetensors nor \
             model.safetensors.index.json"
                .to_string(),
        );
    }
    Ok(needed)
}

/// Whether the GGUF file `path` (a path in a repository) carries the quantisation `tag`, as
/// the module docs say: case-insensitive, a whole token of the file's name; `mmproj*` files
/// never.
pub fn gguf_matches_tag(path: &str, tag: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path).to_ascii_lowercase();
    let Some(stem) = name.strip_suffix(".gguf") else {
        return false;
    };
    let tag = tag.to_ascii_lowercase();
    if tag.is_empty() || name.starts_with("mmproj") {
        return false;
    }
    let word = |b: Option<&u8>| b.is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_');
    let bytes = stem.as_bytes();
    stem.match_indices(&tag).any(|(i, m)| {
        !word(i.checked_sub(1).and_then(|j| bytes.get(j))) && !word(bytes.get(i + m.len()))
    })
}

/// The one GGUF file of `files` carrying `tag`; with `fallback` (a bare id), the only GGUF
/// file when none carries it.
fn pick_gguf(spec: &HubSpec, files: &[String], tag: &str, fallback: bool) -> Result<String> {
    let ggufs: Vec<&String> = files
        .iter()
        .filter(|f| f.to_ascii_lowercase().ends_with(".gguf"))
        .collect();
    let hits: Vec<&String> = ggufs
        .iter()
        .copied()
        .filter(|f| gguf_matches_tag(f, tag))
        .collect();
    let list = |names: &[&String]| {
        let mut s = names
            .iter()
            .take(MAX_NAMES_SHOWN)
            .map(|n| quote(n.as_bytes()))
            .collect::<Vec<_>>()
            .join(", ");
        if names.len() > MAX_NAMES_SHOWN {
            s.push_str(&format!(" and {} more", names.len() - MAX_NAMES_SHOWN));
        }
        s
    };
    match hits.as_slice() {
        [one] => Ok(one.to_string()),
        [] if fallback && ggufs.len() == 1 => Ok(ggufs[0].to_string()),
        [] if ggufs.is_empty() => Err(EngineError::ModelNotFound(bounded(format!(
            "{} has no config.json and no .gguf file",
            spec_name(spec)
        )))),
        [] => Err(EngineError::ModelNotFound(bounded(format!(
            "no .gguf file of {} carries the tag {} (pass OWNER/NAME:FILE.gguf or another \
             tag); its .gguf files: {}",
            spec_name(spec),
            quote(tag.as_bytes()),
            list(&ggufs)
        )))),
        many => Err(EngineError::ModelNotFound(bounded(format!(
            "{} .gguf files of {} carry the tag {} (pass OWNER/NAME:FILE.gguf): {}",
            many.len(),
            spec_name(spec),
            quote(tag.as_bytes()),
            list(many)
        )))),
    }
}

/// What a file that is not a regular file is, for messages.
pub(crate) fn file_kind(t: &std::fs::FileType) -> &'static str {
    if t.is_dir() {
        return "a directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    let _ = t;
    "a special file"
}
