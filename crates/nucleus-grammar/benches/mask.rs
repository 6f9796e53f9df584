//! Mask fill time per token: one request, and a batch of 32 (one row after another on one
//! thread, and filled in parallel with rayon's pool by `fill_bitmasks`), for MiniMind's
//! tokenizer (6,400 ids) and for tiktoken's cl100k_base (100,277 ids).
//!
//! Workload: a JSON Schema with nested objects, an array, an enum and numbers, and a valid
//! instance of it (below). A request walks the instance token by token; each timed iteration
//! fills the mask at the request's next position (commits, rollbacks and new matchers are not
//! timed), so the figure is the mean mask time over every position of the instance. `single`
//! rolls back at the end and walks again (its lexer states are warm after the first pass);
//! `single_new_requests` starts each pass with a new matcher from the cached grammar, as a new
//! request does (lexer states built again). In the batch, the 32 requests start at staggered
//! positions and roll back.
//!
//! `validate/minimind_6400`: the exact final validation of one completion (the `jsonschema`
//! crate's verdict on the instance, [`CompiledGrammar::validate_json`], validator built), next
//! to the masks of that whole completion (a new matcher, then a mask fill and a commit per
//! token): what validating every completion adds to generating it under the schema.
//!
//! `cargo bench -p nucleus-grammar --bench mask`; figures in BENCHMARKS.md.

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use nucleus_grammar::{
    fill_bitmasks, CompiledGrammar, GrammarCompiler, GrammarMatcher, GrammarOptions, GrammarSpec,
    TokenEnv,
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

/// A request walking the instance: `step` commits its next token; at the end it starts over,
/// by rolling back (the matcher keeps the lexer states it has built) or, with `fresh`, as a
/// new request (a new matcher from the cached grammar, whose lexer states are built anew).
struct Walker {
    matcher: GrammarMatcher,
    grammar: Arc<CompiledGrammar>,
    tokens: Vec<u32>,
    fresh: bool,
}

impl Walker {
    fn new(compiler: &GrammarCompiler, tokens: &[u32], start: usize, fresh: bool) -> Self {
        let spec = GrammarSpec::JsonSchema(SCHEMA.to_string());
        let grammar = compiler.compile(&spec, &GrammarOptions::default()).unwrap();
        let mut matcher = grammar.matcher();
        for &t in &tokens[..start] {
            matcher.commit(t).unwrap();
        }
        Walker {
            matcher,
            grammar,
            tokens: tokens.to_vec(),
            fresh,
        }
    }

    fn step(&mut self) {
        let n = self.matcher.committed_len();
        if n < self.tokens.len() {
            self.matcher.commit(self.tokens[n]).unwrap();
        } else if self.fresh {
            self.matcher = self.grammar.matcher();
        } else {
            self.matcher.rollback(n).unwrap();
        }
    }
}

fn bench_env(c: &mut Criterion, name: &str, env: TokenEnv, tokens: Vec<u32>) {
    let words = env.bitmask_words();
    let compiler = GrammarCompiler::new(env).unwrap();
    let mut group = c.benchmark_group(format!("mask/{name}"));

    group.throughput(Throughput::Elements(1));
    for (name, fresh) in [("single", false), ("single_new_requests", true)] {
        group.bench_function(name, |b| {
            let mut walker = Walker::new(&compiler, &tokens, 0, fresh);
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
    }

    group.throughput(Throughput::Elements(BATCH as u64));
    group.bench_function(format!("batch{BATCH}_one_thread"), |b| {
        let mut walkers: Vec<Walker> = (0..BATCH)
            .map(|i| Walker::new(&compiler, &tokens, i * tokens.len() / BATCH, false))
            .collect();
        let mut bitmask = vec![0u32; BATCH * words];
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let t = Instant::now();
                for (w, row) in walkers.iter_mut().zip(bitmask.chunks_mut(words)) {
                    w.matcher.fill_bitmask(row).unwrap();
                }
                total += t.elapsed();
                walkers.iter_mut().for_each(Walker::step);
            }
            total
        });
    });
    group.bench_function(format!("batch{BATCH}"), |b| {
        let mut walkers: Vec<Walker> = (0..BATCH)
            .map(|i| Walker::new(&compiler, &tokens, i * tokens.len() / BATCH, false))
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

/// The exact validation of one completion against the masks of the whole completion.
fn bench_validation(c: &mut Criterion, env: TokenEnv, tokens: &[u32]) {
    let words = env.bitmask_words();
    let compiler = GrammarCompiler::new(env).unwrap();
    let spec = GrammarSpec::JsonSchema(SCHEMA.to_string());
    let grammar = compiler.compile(&spec, &GrammarOptions::default()).unwrap();
    assert!(grammar.validate_json(INSTANCE).unwrap().unwrap().is_valid());
    let mut group = c.benchmark_group("validate/minimind_6400");
    group.throughput(Throughput::Elements(1));
    group.bench_function("exact_validation", |b| {
        b.iter(|| grammar.validate_json(std::hint::black_box(INSTANCE)))
    });
    group.bench_function("masks_of_the_completion", |b| {
        let mut row = vec![0u32; words];
        b.iter(|| {
            let mut m = grammar.matcher();
            for &t in tokens {
                m.fill_bitmask(&mut row).unwrap();
                m.commit(t).unwrap();
            }
            std::hint::black_box(&row);
        })
    });
    group.finish();
}

fn masks(c: &mut Criterion) {
    let (env, tokens) = minimind();
    bench_validation(c, env.clone(), &tokens);
    bench_env(c, "minimind_6400", env, tokens);
    let (env, tokens) = cl100k();
    bench_env(c, "cl100k_100277", env, tokens);
}

criterion_group!(benches, masks);
criterion_main!(benches);
