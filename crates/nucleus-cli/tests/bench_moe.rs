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

#[test]
fn bench_moe_rejects_more_experts_per_token_than_experts() {
    let out = bench_moe(&["--rows", "1", "--hidden", "8", "--k", "9", "--experts", "8"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.starts_with("error: N 1, H 8: --k 9"), "{stderr}");
}
