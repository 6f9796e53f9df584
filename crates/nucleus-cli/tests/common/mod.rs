//! Helpers shared by the CLI tests that pipe JSON lines through a `nucleus` subcommand.
#![allow(dead_code)] // each test binary uses its own subset

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use safetensors::Dtype;

use serde_json::Value;

/// The `nucleus` binary under test, with backtraces on (a panic shows where).
pub fn nucleus() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nucleus"));
    cmd.env("RUST_BACKTRACE", "1");
    cmd
}

/// Runs `nucleus SUBCOMMAND ARGS` with `stdin` as its standard input (written from a thread,
/// so a large input cannot dead-lock against a full stdout pipe).
pub fn run_subcommand(subcommand: &str, args: &[&str], stdin: &str) -> Output {
    let mut child = nucleus()
        .arg(subcommand)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run nucleus");
    let mut input = child.stdin.take().unwrap();
    let text = stdin.to_owned();
    let writer = std::thread::spawn(move || input.write_all(text.as_bytes()));
    let out = child.wait_with_output().expect("wait for nucleus");
    writer.join().unwrap().expect("write stdin");
    out
}

/// Bytes as text (lossy).
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The answers of a successful run, one JSON value per output line.
pub fn answers(out: &Output) -> Vec<Value> {
    assert!(
        out.status.success(),
        "exit {:?}: {}",
        out.status,
        text(&out.stderr)
    );
    text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// A fresh directory for this test binary's files (`name` keeps tests apart).
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "nucleus-{}-test-{}-{name}",
        env!("CARGO_CRATE_NAME"),
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A tensor to write: name, dtype, shape, little-endian bytes.
pub type TensorSpec<'a> = (&'a str, Dtype, Vec<usize>, Vec<u8>);

/// Writes `tensors` to a safetensors file at `path`.
pub fn write_tensors(path: &Path, tensors: &[TensorSpec<'_>]) {
    let views: Vec<(&str, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            (
                *name,
                safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes).unwrap(),
            )
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

/// Little-endian bytes of f32 values.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Little-endian bytes of i32 values.
pub fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Little-endian bytes of i64 values.
pub fn i64_bytes(v: &[i64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Little-endian bytes of the values rounded to f16.
pub fn f16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| half::f16::from_f32(x).to_bits().to_le_bytes())
        .collect()
}

/// Little-endian bytes of the values rounded to bf16.
pub fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| half::bf16::from_f32(x).to_bits().to_le_bytes())
        .collect()
}

/// A file of the project's shared folder (`../shared` beside the checkout), as a string.
pub fn shared(path: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared")
        .join(path);
    p.to_str().unwrap().to_string()
}

/// `/dev/full` opened for writing: every write to it fails with "No space left on device".
pub fn dev_full() -> Stdio {
    Stdio::from(
        std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .expect("open /dev/full"),
    )
}

/// The write end of a pipe whose read end is closed: every write to it fails with
/// "Broken pipe" (as `2>&1 | true` once `true` has exited).
pub fn closed_pipe() -> Stdio {
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    Stdio::from(writer)
}

/// Runs `nucleus ARGS` with stdout and stderr as given and stdin empty; the exit status and
/// whatever of stdout and stderr was piped.
pub fn run_with(args: &[&str], stdout: Stdio, stderr: Stdio) -> Output {
    nucleus()
        .args(args)
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(stderr)
        .output()
        .expect("run nucleus")
}

/// Runs `nucleus ARGS` under an address-space limit of `kib` KiB (`ulimit -v`), with the
/// threads that count against it fixed (two rayon threads, two malloc arenas), stdin from
/// `stdin` when given.
pub fn run_under_ulimit(kib: u64, args: &[&str], stdin: Option<&Path>) -> Output {
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(format!("ulimit -v {kib} && exec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_nucleus"))
        .args(args)
        .env("RAYON_NUM_THREADS", "2")
        .env("MALLOC_ARENA_MAX", "2")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    match stdin {
        Some(path) => cmd.stdin(Stdio::from(std::fs::File::open(path).expect("stdin file"))),
        None => cmd.stdin(Stdio::null()),
    };
    cmd.output().expect("run nucleus under bash")
}
