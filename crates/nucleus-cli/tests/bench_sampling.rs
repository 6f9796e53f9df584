//! `nucleus bench sampling` as a user runs it: a small run prints the whole table.

use std::process::Command;

#[test]
fn bench_sampling_prints_every_workload_and_baseline() {
    let out = Command::new(env!("CARGO_BIN_EXE_nucleus"))
        .args([
            "bench",
            "sampling",
            "--vocab",
            "2000",
            "--batch",
            "2",
            "--threads",
            "2",
            "--iters",
            "3",
        ])
        .output()
        .expect("run nucleus");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("vocab 2000, batch 2, threads 2; µs per row, median of 3 timed runs, all measurements interleaved"),
        "{stdout}"
    );
    assert!(stdout.contains("floors ("), "{stdout}");
    assert!(stdout.contains("| workload | nucleus µs | sort-ref µs | candle µs |"));
    for label in [
        "| (a) top-k 50 |",
        "| (b) top-p 0.9 |",
        "| (c) T 0.8 + top-k 50 + top-p 0.9 |",
        "| (d) min-p 0.05 |",
        "| (e) greedy |",
        "| (f) rep. penalty 1.1 (256 ids) + (c) |",
    ] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(label))
            .unwrap_or_else(|| panic!("no row {label} in\n{stdout}"));
        // Eight cells, each a number, a ratio or n/a.
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        assert_eq!(cells.len(), 8, "{line}");
        for cell in &cells[1..] {
            let number = cell.trim_end_matches('x');
            assert!(
                *cell == "n/a" || number.parse::<f64>().is_ok_and(|v| v > 0.0),
                "{line}"
            );
        }
    }
}

#[test]
fn bench_sampling_rejects_a_tiny_vocabulary_cleanly() {
    let out = Command::new(env!("CARGO_BIN_EXE_nucleus"))
        .args(["bench", "sampling", "--vocab", "10", "--iters", "1"])
        .output()
        .expect("run nucleus");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.starts_with("error: --vocab 10"), "{stderr}");
}
