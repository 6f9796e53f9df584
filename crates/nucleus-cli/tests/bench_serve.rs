//! `nucleus bench serve` on stories260K: its table counts every request, refusals are counted
//! as 503s, and bad flags are usage errors. (The figures themselves: tests/load/run.sh.)

use std::path::PathBuf;
use std::process::{Command, Output};

fn stories() -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/models/stories260K.gguf")
        .display()
        .to_string()
}

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nucleus"))
        .args(["bench", "serve", "--model", &stories(), "--threads", "1"])
        .args(args)
        .output()
        .expect("nucleus runs")
}

/// The table's rows as (phase, streams, counts: requests 200 4xx 503 5xx lost hung-up).
fn rows(stdout: &str) -> Vec<(String, usize, Vec<usize>)> {
    stdout
        .lines()
        .filter(|l| l.starts_with("| load") || l.starts_with("| faults") || l.starts_with("| soak"))
        .map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split('|').map(str::trim).collect();
            let counts = cells[2..9]
                .iter()
                .map(|c| c.parse().expect("a count"))
                .collect();
            (
                cells[0].to_string(),
                cells[1].parse().expect("streams"),
                counts,
            )
        })
        .collect()
}

#[test]
fn every_request_is_counted_and_hang_ups_are_aborted() {
    let out = bench(&[
        "--concurrency",
        "1,4",
        "--requests",
        "12",
        "--max-tokens",
        "8",
        "--fault-requests",
        "10",
        "--fault-concurrency",
        "5",
        "--disconnect-fraction",
        "0.2",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        rows(&stdout),
        vec![
            ("load".into(), 1, vec![12, 12, 0, 0, 0, 0, 0]),
            ("load".into(), 4, vec![12, 12, 0, 0, 0, 0, 0]),
            // Requests 4 and 9 hang up (every fifth), the other 8 complete.
            ("faults".into(), 5, vec![10, 8, 0, 0, 0, 0, 2]),
        ],
        "{stdout}"
    );
    assert!(
        stdout.contains("the server aborted 2 and was back at 0 running and 0 waiting"),
        "{stdout}"
    );
    assert!(stdout.ends_with("all checks passed\n"), "{stdout}");
}

#[test]
fn a_full_queue_is_counted_as_503s_not_as_lost() {
    // One running, none waiting, four clients: some requests are refused, none is lost.
    let out = bench(&[
        "--concurrency",
        "4",
        "--requests",
        "20",
        "--max-tokens",
        "16",
        "--fault-requests",
        "0",
        "--max-num-seqs",
        "1",
        "--max-queue",
        "0",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = rows(&stdout);
    assert_eq!(rows.len(), 1, "{stdout}");
    let c = &rows[0].2;
    let (sent, ok, c4xx, c503, c5xx, lost) = (c[0], c[1], c[2], c[3], c[4], c[5]);
    assert_eq!(sent, 20, "{stdout}");
    assert_eq!(ok + c503, 20, "{stdout}");
    assert!(c503 > 0 && ok > 0, "{stdout}");
    assert_eq!((c4xx, c5xx, lost), (0, 0, 0), "{stdout}");
}

#[test]
fn bad_flags_are_usage_errors() {
    for (args, message) in [
        (
            &["--max-tokens", "0"][..],
            "--max-tokens must be at least 1",
        ),
        (
            &["--concurrency", "0"][..],
            "--concurrency needs values of at least 1",
        ),
        (
            &["--disconnect-fraction", "1.5"][..],
            "--disconnect-fraction must be in [0, 1]",
        ),
        (
            &["--requests", "0", "--fault-requests", "0"][..],
            "nothing to run",
        ),
        (
            &["--fault-requests", "5", "--max-tokens", "4"][..],
            "the fault phase needs --max-tokens 8 or more",
        ),
        (
            &["--soak-seconds", "3", "--rss-interval", "2"][..],
            "--soak-seconds 3 must be at least twice --rss-interval 2",
        ),
        (&["--soak-seconds", "604801"][..], "604801"),
        (&["--max-num-seqs", "0"][..], "--max-num-seqs"),
    ] {
        let out = bench(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn the_server_ends_with_the_bench() {
    use std::io::{BufRead, BufReader};
    use std::net::TcpStream;
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    // A run far longer than the test, killed with SIGKILL once its server listens: nothing
    // of the bench runs after that, and its server must go too (it would serve forever).
    let mut bench = Command::new(env!("CARGO_BIN_EXE_nucleus"))
        .args(["bench", "serve", "--model", &stories(), "--threads", "1"])
        .args([
            "--requests",
            "100000",
            "--concurrency",
            "2",
            "--fault-requests",
            "0",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("nucleus runs");
    let mut first = String::new();
    BufReader::new(bench.stdout.take().expect("stdout"))
        .read_line(&mut first)
        .expect("the first line");
    // "nucleus bench serve: MODEL over /v1/completions at http://127.0.0.1:PORT: ..."
    let addr = first
        .split(" at http://")
        .nth(1)
        .and_then(|rest| rest.split(": ").next())
        .expect("the server's address")
        .to_string();
    assert!(TcpStream::connect(&addr).is_ok(), "{first}");
    bench.kill().expect("kill");
    bench.wait().expect("wait");
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(&addr).is_ok() {
        assert!(
            Instant::now() < deadline,
            "the server at {addr} still answers 30 s after its bench was killed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
