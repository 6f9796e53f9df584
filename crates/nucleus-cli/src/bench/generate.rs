//! `nucleus bench generate`: its flags and tables (nucleus-bench's
//! [`nucleus_bench::generate`] measures: what each figure is, and how it is taken). Each
//! engine's round runs in a child process, this binary again with the hidden flag
//! `--one-round ENGINE`, which prints the round's figures as one JSON line.

use std::io::Write;
use std::process::Command;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use nucleus_bench::generate::{
    spread, Config, EngineKind, FlashAttn, Round, RoundResult, TokenComparison, LLAMA_CPP_BUILT,
    NEAR_TIE_GAP,
};

/// The flags of `nucleus bench generate`.
#[derive(Args, Debug, Clone)]
pub struct BenchGenerateArgs {
    /// The model (as `generate --model`; default $NUCLEUS_MODEL, else stories260K from the
    /// hub cache).
    #[arg(long, value_name = "M")]
    pub model: Option<String>,
    /// Prompt tokens per request (seeded random ids).
    #[arg(long, default_value_t = 256)]
    pub prompt_tokens: usize,
    /// Tokens generated per request (greedy; the first comes from the prefill).
    #[arg(long, default_value_t = 32)]
    pub gen_tokens: usize,
    /// Requests that run together (llama.cpp: sequences of one batch).
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Threads of the forward pass, the sampler and the bandwidth read (of both engines).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Rounds (each engine loads the model and generates once per round, in a process of its
    /// own); figures are their medians.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// The KV cache's element type of both engines: `f16` (the default of both) or `f32`.
    #[arg(long, value_name = "DTYPE", default_value = "f16", value_parser = crate::model::parse_kv_cache_dtype)]
    pub kv_cache_dtype: nucleus_engine::KvCacheDtype,
    /// llama.cpp's flash attention: `auto` (its default: on, on the CPU), `on` or `off` (its
    /// exact attention; on the CPU its flash attention sums values in f16, so greedy tokens are
    /// compared with `off`).
    #[arg(long, value_name = "POLICY", default_value = "auto", value_parser = parse_flash_attn)]
    pub llama_flash_attn: FlashAttn,
    /// Leave llama.cpp out in a build with feature llama-cpp.
    #[arg(long)]
    pub no_llama_cpp: bool,
    /// Internal: run one round of this engine in this process and print it as one JSON line
    /// (the child process of each round).
    #[arg(long, value_enum, hide = true)]
    pub one_round: Option<EngineArg>,
}

/// `--llama-flash-attn`: `auto`, `on` or `off`.
fn parse_flash_attn(s: &str) -> Result<FlashAttn, String> {
    match s {
        "auto" => Ok(FlashAttn::Auto),
        "on" => Ok(FlashAttn::On),
        "off" => Ok(FlashAttn::Off),
        _ => Err(format!("expected auto, on or off, got {s:?}")),
    }
}

/// A figure of one engine's round (`None`: not measured there).
type Figure<'a> = dyn Fn(&RoundResult) -> Option<f64> + 'a;

/// `--one-round`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum EngineArg {
    /// nucleus-engine.
    Nucleus,
    /// llama.cpp.
    #[value(name = "llama.cpp")]
    LlamaCpp,
}

impl From<EngineArg> for EngineKind {
    fn from(e: EngineArg) -> Self {
        match e {
            EngineArg::Nucleus => EngineKind::Nucleus,
            EngineArg::LlamaCpp => EngineKind::LlamaCpp,
        }
    }
}

/// Runs `nucleus bench generate`, writing Markdown tables to `out` (or, with `--one-round`,
/// one round's JSON line).
///
/// # Errors
/// As [`nucleus_bench::generate::run`], a model that cannot be resolved, a failed write.
pub fn run(args: &BenchGenerateArgs, out: &mut dyn Write) -> Result<()> {
    let config = Config {
        model: crate::model::resolve(args.model.as_deref())?,
        prompt_tokens: args.prompt_tokens,
        gen_tokens: args.gen_tokens,
        batch: args.batch,
        threads: args.threads,
        rounds: args.rounds,
        llama_cpp: LLAMA_CPP_BUILT && !args.no_llama_cpp,
        kv_cache_dtype: args.kv_cache_dtype,
        llama_flash_attn: args.llama_flash_attn,
    };
    if let Some(engine) = args.one_round {
        let result = nucleus_bench::generate::one_round(engine.into(), &config)?;
        writeln!(out, "{}", serde_json::to_string(&result)?)?;
        return Ok(());
    }
    let exe = std::env::current_exe().context("finding the nucleus binary")?;
    let child = |engine: EngineKind| {
        let mut cmd = Command::new(&exe);
        cmd.arg("bench")
            .arg("generate")
            .arg("--model")
            .arg(&config.model)
            .args(["--prompt-tokens", &args.prompt_tokens.to_string()])
            .args(["--gen-tokens", &args.gen_tokens.to_string()])
            .args(["--batch", &args.batch.to_string()])
            .args(["--threads", &args.threads.to_string()])
            .args(["--rounds", "1"])
            .args(["--kv-cache-dtype", args.kv_cache_dtype.as_str()])
            .args(["--llama-flash-attn", args.llama_flash_attn.as_str()])
            .args(["--one-round", engine.name()]);
        if args.no_llama_cpp {
            cmd.arg("--no-llama-cpp");
        }
        cmd
    };
    let report = nucleus_bench::generate::run(&config, &child)?;
    let (b, p, g) = (args.batch, args.prompt_tokens, args.gen_tokens);
    writeln!(
        out,
        "model {} ({:.1} MiB of weights as stored), batch {b}, prompt {p} tokens, {g} generated, \
         {} thread(s), {} round(s), {} KV caches{}, each engine's round in a process of its own: \
         median (smallest to largest)",
        config.model.display(),
        report.weight_bytes as f64 / (1024.0 * 1024.0),
        args.threads,
        args.rounds,
        args.kv_cache_dtype.as_str(),
        if config.llama_cpp {
            format!(
                ", llama.cpp's flash attention {}",
                args.llama_flash_attn.as_str()
            )
        } else {
            String::new()
        }
    )?;
    let rounds = &report.rounds;
    let nucleus: Vec<&RoundResult> = rounds.iter().map(|r| &r.nucleus).collect();
    let llama: Vec<&RoundResult> = rounds.iter().filter_map(|r| r.llama_cpp.as_ref()).collect();
    let engines: Vec<(&str, &[&RoundResult])> = if llama.len() == rounds.len() {
        vec![("nucleus", &nucleus), ("llama.cpp", &llama)]
    } else {
        vec![("nucleus", &nucleus)]
    };
    writeln!(out)?;
    write!(out, "| measure |")?;
    for (name, _) in &engines {
        write!(out, " {name} median | {name} spread |")?;
    }
    writeln!(out)?;
    write!(out, "|---|")?;
    for _ in &engines {
        write!(out, "---:|---:|")?;
    }
    writeln!(out)?;
    let rss_mib = |r: &RoundResult| r.rss_bytes.map(|b| b as f64 / (1024.0 * 1024.0));
    let per_engine: [(&str, &Figure<'_>, usize); 5] = [
        (
            "prefill tokens/s",
            &|r| Some(r.prefill_tokens_per_s(b, p)),
            1,
        ),
        ("decode tokens/s", &|r| Some(r.decode_tokens_per_s(b)), 1),
        ("decode ms per step", &|r| Some(r.decode_ms_per_step()), 3),
        ("load s", &|r| Some(r.load_s), 3),
        ("resident MiB after generating", &rss_mib, 1),
    ];
    let mut medians = Vec::new();
    for (name, f, digits) in per_engine {
        let cells: Vec<Option<nucleus_bench::generate::Spread>> = engines
            .iter()
            .map(|(_, rs)| {
                let values: Option<Vec<f64>> = rs.iter().map(|r| f(r)).collect();
                values.and_then(spread)
            })
            .collect();
        if cells.iter().all(Option::is_none) {
            continue;
        }
        write!(out, "| {name} |")?;
        for c in &cells {
            match c {
                Some(s) => write!(
                    out,
                    " {:.digits$} | {:.digits$} to {:.digits$} |",
                    s.median, s.min, s.max
                )?,
                None => write!(out, " - | - |")?,
            }
        }
        writeln!(out)?;
        medians.push((name, cells));
    }
    let w = report.weight_bytes;
    let shared = |out: &mut dyn Write, name: &str, f: &dyn Fn(&Round) -> f64, digits: usize| {
        if let Some(s) = spread(rounds.iter().map(f).collect()) {
            write!(
                out,
                "| {name} | {:.digits$} | {:.digits$} to {:.digits$} |",
                s.median, s.min, s.max
            )?;
            for _ in 1..engines.len() {
                write!(out, " | |")?;
            }
            writeln!(out)?;
        }
        Ok::<(), anyhow::Error>(())
    };
    shared(
        out,
        "decode floor ms per step (weights / bandwidth)",
        &|r| r.floor_ms_per_step(w),
        3,
    )?;
    shared(out, "read bandwidth GB/s", &|r| r.bandwidth / 1e9, 2)?;

    if engines.len() == 2 {
        writeln!(out)?;
        writeln!(out, "| nucleus / llama.cpp (of the medians) | ratio |")?;
        writeln!(out, "|---|---:|")?;
        for (name, cells) in &medians {
            if let (Some(n), Some(l)) = (cells[0], cells[1]) {
                let label = match *name {
                    "prefill tokens/s" => "prefill speed (tokens/s)",
                    "decode tokens/s" => "decode speed (tokens/s)",
                    "decode ms per step" => "decode ms per step",
                    "load s" => "load time",
                    _ => "resident memory",
                };
                writeln!(out, "| {label} | {:.3} |", n.median / l.median)?;
            }
        }
    }
    writeln!(out)?;
    match &report.tokens {
        None if !LLAMA_CPP_BUILT => writeln!(
            out,
            "llama.cpp: not measured, built without feature llama-cpp \
             (scripts/build-llama-cpp-bench.sh)"
        )?,
        None => writeln!(out, "llama.cpp: not measured (--no-llama-cpp)")?,
        Some(TokenComparison::Equal { count }) => {
            writeln!(out, "greedy tokens (row 0): equal ({count} of {g})")?
        }
        Some(TokenComparison::Differ {
            step,
            nucleus,
            llama_cpp,
            gap,
        }) => {
            let gap = match gap {
                Some(gap) => format!(
                    "{gap:.3e} ({} {NEAR_TIE_GAP:e})",
                    if *gap < NEAR_TIE_GAP {
                        "below"
                    } else {
                        "not below"
                    }
                ),
                None => "not reported".to_string(),
            };
            writeln!(
                out,
                "greedy tokens (row 0): first difference at step {step}: nucleus {nucleus}, \
                 llama.cpp {llama_cpp}, llama.cpp's top-2 logit gap there {gap}"
            )?
        }
    }
    Ok(())
}
