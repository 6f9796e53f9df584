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

/// Flags outside their domain are exit status 2, sizes that cannot be allocated exit status
/// 1; either way one `error:` line and no table. (Before, a bad flag was exit 1, and
/// `--vocab 100000 --batch 1000000` aborted: "memory allocation of 400000000000 bytes
/// failed".)
#[test]
fn bench_sampling_checks_flags_and_sizes_before_the_table() {
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_nucleus"))
            .args(["bench", "sampling"])
            .args(args)
            .output()
            .expect("run nucleus")
    };
    for (args, message) in [
        (
            &["--vocab", "10", "--iters", "1"][..],
            "error: --vocab 10: must be in 64..=4294967295\n",
        ),
        (&["--batch", "0"], "error: --batch must be at least 1\n"),
        (&["--threads", "0"], "error: --threads must be at least 1\n"),
        (&["--iters", "0"], "error: --iters must be at least 1\n"),
    ] {
        let out = run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert_eq!(String::from_utf8_lossy(&out.stderr), message);
        assert!(out.stdout.is_empty());
    }
    let out = run(&["--vocab", "100000", "--batch", "1000000"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("error: --vocab 100000 x --batch 1000000 on 1 thread(s) need ")
            && stderr.ends_with(" GiB) of buffers, which cannot be allocated here\n"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());
    // The largest vocabulary (17 GB of logits), under a 3 GB address space.
    let out = Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 3000000 && exec \"$0\" bench sampling --vocab 4294967295")
        .arg(env!("CARGO_BIN_EXE_nucleus"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("error: --vocab 4294967295 x --batch 1 on 1 thread(s) need "),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1);
    assert!(out.stdout.is_empty());
}
