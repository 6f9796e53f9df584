//! `nucleus bench moe` as a user runs it: a small run prints the whole table.

use std::process::Command;

fn bench_moe(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_nucleus"))
        .args(["bench", "moe"])
        .args(args)
        .output()
        .expect("run nucleus")
}

#[test]
fn bench_moe_prints_every_shape_and_operation() {
    let out = bench_moe(&[
        "--rows",
        "2",
        "40",
        "--hidden",
        "64,96",
        "--experts",
        "16",
        "--threads",
        "2",
        "--iters",
        "3",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("nucleus bench moe: K 8, E 16, bf16, threads 2; µs per call, median of 3 timed runs, the measurements of each shape interleaved"),
        "{stdout}"
    );
    assert!(
        stdout.contains("floors: init = expanded_x's N*K*H bf16 written once"),
        "{stdout}"
    );
    assert!(
        stdout.contains("| N | H | operation | floor µs | nucleus µs | reference µs | nucleus/floor | reference/nucleus |"),
        "{stdout}"
    );
    for (n, h) in [(2, 64), (40, 64), (2, 96), (40, 96)] {
        for op in [
            "init routing, into reused buffers",
            "init routing, allocating",
            "init routing, dynamic int8, into",
            "unpermute",
        ] {
            let label = format!("| {n} | {h} | {op} |");
            let line = stdout
                .lines()
                .find(|l| l.starts_with(&label))
                .unwrap_or_else(|| panic!("no row {label} in\n{stdout}"));
            // Eight cells: N, H, the operation, then numbers and ratios (the allocating row
            // has no reference).
            let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
            assert_eq!(cells.len(), 8, "{line}");
            for (i, cell) in cells[3..].iter().enumerate() {
                if cell.is_empty() && op == "init routing, allocating" && (i == 2 || i == 4) {
                    continue;
                }
                let number = cell.trim_end_matches('x');
                assert!(number.parse::<f64>().is_ok_and(|v| v > 0.0), "{line}");
            }
        }
    }
}

#[test]
fn bench_moe_runs_f32_on_one_thread() {
    let out = bench_moe(&[
        "--rows",
        "3",
        "--hidden",
        "32",
        "--k",
        "2",
        "--experts",
        "4",
        "--dtype",
        "f32",
        "--iters",
        "1",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("K 2, E 4, f32, threads 1;"), "{stdout}");
    assert!(stdout.contains("| 3 | 32 | unpermute |"), "{stdout}");
}

/// Every shape's flags are checked, and the largest shape's memory reserved, before the
/// table's first line: a flag outside its domain is exit status 2, a size that cannot be
/// allocated exit status 1, one `error:` line either way. (Before, the header was printed
/// first, a bad shape was exit 1, and `--rows 1000000 --hidden 100000` aborted.)
#[test]
fn bench_moe_checks_every_shape_before_the_table() {
    for (args, status, message) in [
        (
            &["--rows", "1", "--hidden", "8", "--k", "9", "--experts", "8"][..],
            2,
            "error: --k 9: K distinct experts per token need K <= E = 8\n",
        ),
        (
            &["--rows", "1", "0", "--hidden", "8"],
            2,
            "error: --rows must be at least 1\n",
        ),
        (
            &["--rows", "1", "--hidden", "8", "--experts", "0"],
            2,
            "error: --experts 0: must be in 1..=10240\n",
        ),
        (
            &["--rows", "1", "--hidden", "8", "--threads", "0"],
            2,
            "error: --threads must be at least 1\n",
        ),
        (
            &["--rows", "300000000", "--hidden", "8"],
            2,
            "error: --rows 300000000 x --k 8: N * K must be at most 2^31 - 1 (the row indices are i32)\n",
        ),
        (
            &["--rows", "1", "1000000", "--hidden", "100000"],
            1,
            "error: the largest shape, N 1000000 x H 100000 x K 8, and its outputs need 7400512016384 bytes (6892.3 GiB) of buffers, which cannot be allocated here\n",
        ),
    ] {
        let out = bench_moe(args);
        assert_eq!(out.status.code(), Some(status), "{args:?}");
        assert_eq!(String::from_utf8_lossy(&out.stderr), message, "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}
