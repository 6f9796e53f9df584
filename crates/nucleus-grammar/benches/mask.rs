//! Mask fill time per token: one request, and a batch of 32 filled in parallel (rayon), for
//! MiniMind's tokenizer (6,400 ids) and for tiktoken's cl100k_base (100,277 ids).
//!
//! Workload: a JSON Schema with nested objects, an array, an enum and numbers, and a valid
//! instance of it (below). A request walks the instance token by token; each timed iteration
//! fills the mask at the request's next position (commits and rollbacks are not timed), so
//! the figure is the mean mask time over every position of the instance. In the batch, the
//! 32 requests start at staggered positions.
//!
//! `cargo bench -p nucleus-grammar --bench mask`; figures in BENCHMARKS.md.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use nucleus_grammar::{
    fill_bitmasks, GrammarCompiler, GrammarMatcher, GrammarOptions, GrammarSpec, TokenEnv,
};

const SCHEMA: &str = r#"{
  "type": "object",
  "properties": {
    "id": {"type": "integer", "minimum": 0},
    "name": {"type": "string", "maxLength": 64},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
    "address": {
      "type": "object",
      "properties": {
        "street": {"type": "string"},
        "city": {"type": "string"},
        "zip": {"type": "string", "pattern": "^[A-Z0-9 ]{3,10}$"}
      },
      "required": ["street", "city"]
    },
    "active": {"type": "boolean"},
    "score": {"type": "number"},
    "role": {"enum": ["admin", "editor", "viewer"]}
  },
  "required": ["id", "name", "tags", "active", "role"]
}"#;

const INSTANCE: &str = r#"{"id": 12345, "name": "Ada Lovelace", "tags": ["math", "computing", "poetry"], "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"}, "active": true, "score": 97.5, "role": "admin"}"#;

const BATCH: usize = 32;

fn minimind() -> (TokenEnv, Vec<u32>) {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/models/minimind-tokenizer/tokenizer.json"
    );
    let tokenizer = tokenizers::Tokenizer::from_file(path).expect("MiniMind tokenizer.json");
    let env = TokenEnv::from_tokenizer(&tokenizer, &[2, 0], 6400).expect("MiniMind env");
    let tokens = env.encode(INSTANCE).expect("encode");
    (env, tokens)
}

/// cl100k_base from the tiktoken-rs crate: the bytes of each rank, special tokens marked.
fn cl100k() -> (TokenEnv, Vec<u32>) {
    let bpe = tiktoken_rs::cl100k_base().expect("cl100k_base");
    let specials: Vec<(String, u32)> = bpe
        .special_tokens()
        .into_iter()
        .map(|s| (s.to_string(), bpe.encode_with_special_tokens(s)[0]))
        .collect();
    let vocab = specials
        .iter()
        .map(|&(_, id)| id as usize + 1)
        .max()
        .unwrap();
    let mut words = vec![Vec::new(); vocab];
    // Ordinary ranks are 0..100256.
    for (rank, bytes) in bpe
        ._decode_native_and_split((0..100_256).collect())
        .enumerate()
    {
        words[rank] = bytes;
    }
    for (name, id) in &specials {
        words[*id as usize] = [&[nucleus_grammar::SPECIAL_TOKEN_MARKER], name.as_bytes()].concat();
    }
    let eos = specials
        .iter()
        .find(|(n, _)| n == "<|endoftext|>")
        .unwrap()
        .1;
    let env = TokenEnv::from_token_bytes(words, &[eos], vocab).expect("cl100k env");
    let tokens = bpe.encode_ordinary(INSTANCE);
    (env, tokens)
}

/// A request walking the instance: `step` commits its next token, wrapping around.
struct Walker {
    matcher: GrammarMatcher,
    tokens: Vec<u32>,
}

impl Walker {
    fn new(compiler: &GrammarCompiler, tokens: &[u32], start: usize) -> Self {
        let spec = GrammarSpec::JsonSchema(SCHEMA.to_string());
        let mut matcher = compiler.matcher(&spec, &GrammarOptions::default()).unwrap();
        for &t in &tokens[..start] {
            matcher.commit(t).unwrap();
        }
        Walker {
            matcher,
            tokens: tokens.to_vec(),
        }
    }

    fn step(&mut self) {
        let n = self.matcher.committed_len();
        if n == self.tokens.len() {
            self.matcher.rollback(n).unwrap();
        } else {
            self.matcher.commit(self.tokens[n]).unwrap();
        }
    }
}

fn bench_env(c: &mut Criterion, name: &str, env: TokenEnv, tokens: Vec<u32>) {
    let words = env.bitmask_words();
    let compiler = GrammarCompiler::new(env).unwrap();
    let mut group = c.benchmark_group(format!("mask/{name}"));

    group.throughput(Throughput::Elements(1));
    group.bench_function("single", |b| {
        let mut walker = Walker::new(&compiler, &tokens, 0);
        let mut row = vec![0u32; words];
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let t = Instant::now();
                walker.matcher.fill_bitmask(&mut row).unwrap();
                total += t.elapsed();
                walker.step();
            }
            total
        });
    });

    group.throughput(Throughput::Elements(BATCH as u64));
    group.bench_function(format!("batch{BATCH}"), |b| {
        let mut walkers: Vec<Walker> = (0..BATCH)
            .map(|i| Walker::new(&compiler, &tokens, i * tokens.len() / BATCH))
            .collect();
        let mut bitmask = vec![0u32; BATCH * words];
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let mut matchers: Vec<&mut GrammarMatcher> =
                    walkers.iter_mut().map(|w| &mut w.matcher).collect();
                let t = Instant::now();
                let results = fill_bitmasks(&mut matchers, &mut bitmask, words);
                total += t.elapsed();
                assert!(results.iter().all(Result::is_ok));
                walkers.iter_mut().for_each(Walker::step);
            }
            total
        });
    });
    group.finish();
}

fn masks(c: &mut Criterion) {
    let (env, tokens) = minimind();
    bench_env(c, "minimind_6400", env, tokens);
    let (env, tokens) = cl100k();
    bench_env(c, "cl100k_100277", env, tokens);
}

criterion_group!(benches, masks);
criterion_main!(benches);
