//! Large rows (8,193 to 327,680 ids) against the f64 oracle of spec/sampling.md, in one test
//! binary: the selection steps 6-11 (`selection`) and steps 1-5 with the forms a row comes in
//! (`inputs`).

#[path = "../common/mod.rs"]
mod common;

mod inputs;
mod selection;
