//! Helpers shared by the CLI tests that pipe JSON lines through a `nucleus` subcommand.
#![allow(dead_code)] // each test binary uses its own subset

use std::io::Write;
use std::process::{Command, Output, Stdio};

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
