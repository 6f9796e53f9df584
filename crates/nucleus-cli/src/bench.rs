//! `nucleus bench`: the flags of each benchmark and the Markdown tables it prints. What is
//! measured, and how, is nucleus-bench's ([`nucleus_bench`]): these modules turn flags into
//! its parameter structs and its result structs into tables.

pub mod generate;
pub mod moe;
pub mod npu_sample;
pub mod sampling;
pub mod serve;

use nucleus_bench::sampling::{AUTO_BUDGET, AUTO_MIN_RUNS};

/// µs for a table cell: 3 significant figures down to 2 decimals.
pub(crate) fn fmt_us(us: f64) -> String {
    if us >= 100.0 {
        format!("{us:.0}")
    } else if us >= 10.0 {
        format!("{us:.1}")
    } else {
        format!("{us:.2}")
    }
}

/// A ratio for a table cell: `12x`, `1.23x`.
pub(crate) fn fmt_ratio(r: f64) -> String {
    if r >= 10.0 {
        format!("{r:.0}x")
    } else {
        format!("{r:.2}x")
    }
}

/// How many timed runs each measurement took, for a table's first line.
pub(crate) fn iters_text(iters: Option<usize>) -> String {
    match iters {
        Some(n) => format!("{n} timed runs"),
        None => format!(
            "at least {AUTO_MIN_RUNS} timed runs, more within {} ms per measurement",
            AUTO_BUDGET.as_millis()
        ),
    }
}
