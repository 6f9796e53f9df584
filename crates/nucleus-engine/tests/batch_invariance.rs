//! Batch invariance (issue 24, point 2): a sequence's logits are the same bits whether its
//! tokens run alone or among other sequences' in one forward pass, in any order and any number
//! (prefill and decode, fewer or more rows than the decode kernels' 8), for every weight type:
//! stories260K as stored (f32) and rewritten as F16, BF16, Q8_0 and Q4_0 (its down projection,
//! 172 wide, stays f32), and a random Llama
//! of hidden 256 written as Q4_K, Q6_K and Q5_K (super-blocks need rows of 256).

mod common;

use anyhow::Result;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use common::hf::{random_weights, tiny_config, write_gguf};
use common::{temp_path, TempFile};
use nucleus_engine::{load_gguf, CausalLm, KvCache, SeqInput};

/// Sequences as (history already in the cache, new tokens this step): prefills of 1 to 12
/// tokens onto empty and filled caches, and decodes after histories of several lengths.
fn cases(vocab: u32) -> Vec<(Vec<u32>, Vec<u32>)> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut id = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % vocab as u64) as u32
    };
    let mut ids = |n: usize| (0..n).map(|_| id()).collect::<Vec<u32>>();
    vec![
        (vec![], ids(12)),
        (ids(3), ids(1)),
        (ids(2), ids(5)),
        (vec![], ids(1)),
        (ids(9), ids(1)),
        (ids(1), ids(1)),
        (ids(4), ids(2)),
        (ids(6), ids(1)),
        (ids(5), ids(1)),
        (ids(7), ids(1)),
        (ids(2), ids(1)),
        (ids(8), ids(1)),
        (ids(3), ids(1)),
    ]
}

/// The logits' bits of each case's last new token, the cases run in one forward pass in the
/// order `order` (indices into `cases`), returned in the cases' order.
fn batched(
    model: &dyn CausalLm,
    cases: &[(Vec<u32>, Vec<u32>)],
    order: &[usize],
) -> Result<Vec<Vec<u32>>> {
    let mut caches: Vec<KvCache> = Vec::new();
    for &i in order {
        let mut cache = model.new_cache();
        if !cases[i].0.is_empty() {
            model.forward(&mut [SeqInput {
                tokens: &cases[i].0,
                cache: &mut cache,
            }])?;
        }
        caches.push(cache);
    }
    let mut inputs: Vec<SeqInput<'_>> = caches
        .iter_mut()
        .zip(order)
        .map(|(cache, &i)| SeqInput {
            tokens: &cases[i].1,
            cache,
        })
        .collect();
    let logits = model.forward(&mut inputs)?;
    let rows: Vec<Vec<f32>> = logits.to_vec2()?;
    let mut out = vec![Vec::new(); cases.len()];
    for (row, &i) in rows.into_iter().zip(order) {
        out[i] = row.iter().map(|v| v.to_bits()).collect();
    }
    Ok(out)
}

/// Alone, all together, all in reverse order, and the decodes alone together (10 rows, more
/// than the decode kernels' 8): the same bits for every case.
fn check(model: &dyn CausalLm, what: &str) -> Result<()> {
    let cases = cases(model.config().vocab_size as u32);
    let alone: Vec<Vec<u32>> = (0..cases.len())
        .map(|i| Ok(batched(model, &cases, &[i])?.swap_remove(i)))
        .collect::<Result<_>>()?;
    let all: Vec<usize> = (0..cases.len()).collect();
    let reversed: Vec<usize> = all.iter().rev().copied().collect();
    let decodes: Vec<usize> = all
        .iter()
        .copied()
        .filter(|&i| cases[i].1.len() == 1)
        .collect();
    assert!(decodes.len() > 8, "{} decodes", decodes.len());
    for (name, order) in [
        ("all", &all),
        ("reversed", &reversed),
        ("decodes", &decodes),
    ] {
        let got = batched(model, &cases, order)?;
        for &i in order {
            assert!(
                got[i] == alone[i],
                "{what}: case {i} in batch `{name}` differs from alone"
            );
        }
    }
    Ok(())
}

#[test]
fn stories260k_in_every_type_gives_the_same_bits_alone_and_batched() -> Result<()> {
    let src = common::stories260k();
    let model = load_gguf(&src, &Device::Cpu)?.model;
    check(model.as_ref(), "stories260K f32")?;
    for dtype in [
        GgmlDType::F16,
        GgmlDType::BF16,
        GgmlDType::Q8_0,
        GgmlDType::Q4_0,
    ] {
        let dst = TempFile(temp_path("invariance.gguf"));
        common::rewrite_gguf(
            &src,
            &dst.0,
            |_| {},
            |_, t| {
                // Norms stay f32, and so do the matrices whose rows (172 wide: the feed-forward
                // down projection) are not whole blocks.
                let dims = t.shape().dims();
                if dims.len() != 2 || !dims[1].is_multiple_of(32) {
                    return Ok(Some(t));
                }
                let values = t.dequantize(&Device::Cpu)?;
                Ok(Some(QTensor::quantize(&values, dtype)?))
            },
        )?;
        let model = load_gguf(&dst.0, &Device::Cpu)?.model;
        check(model.as_ref(), &format!("stories260K {dtype:?}"))?;
    }
    Ok(())
}

#[test]
fn super_block_types_give_the_same_bits_alone_and_batched() -> Result<()> {
    let mut config = tiny_config("llama");
    config["hidden_size"] = 256.into();
    config["intermediate_size"] = 512.into();
    let weights = random_weights(&config, 2401);
    for dtype in [GgmlDType::Q4K, GgmlDType::Q6K, GgmlDType::Q5K] {
        let path = TempFile(temp_path("invariance-k.gguf"));
        write_gguf(&path.0, &config, &weights, "llama", dtype)?;
        let model = load_gguf(&path.0, &Device::Cpu)?.model;
        check(model.as_ref(), &format!("random Llama {dtype:?}"))?;
    }
    Ok(())
}
