//! Exact f32 thresholds: the smallest logit whose weight reaches a level ([`weight_cut`], the
//! exact min-p cut of stage 3 of spec/npu_top_k_top_p_sample.md and the argmax of a row where
//! every token survives), and the f32 rounding of f64 bounds downward and upward.

use super::exp_weight;

/// The smallest f32 logit whose weight `exp_weight(l, max)` is at least `level` (`0 < level <=
/// 1`), by bisection over the f32 values between `-inf` and `max`: the weight is monotone in
/// the logit, so `l >= cut` is exactly `exp_weight(l, max) >= level` (min-p's rule).
pub(super) fn weight_cut(max: f32, level: f32) -> f32 {
    // f32 values in ascending order as u32 keys.
    let key = |v: f32| {
        let b = v.to_bits();
        if b & 0x8000_0000 != 0 {
            !b
        } else {
            b | 0x8000_0000
        }
    };
    let value = |k: u32| {
        if k & 0x8000_0000 != 0 {
            f32::from_bits(k & 0x7fff_ffff)
        } else {
            f32::from_bits(!k)
        }
    };
    // exp_weight(-inf) = 0 < level <= exp_weight(max) = 1.
    let (mut lo, mut hi) = (key(f32::NEG_INFINITY), key(max));
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if exp_weight(value(mid), max) >= level {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    value(hi)
}

/// The largest f32 at or below `v` (`v >= 0`).
pub(super) fn floor_f32(v: f64) -> f32 {
    let f = v as f32;
    if f64::from(f) > v {
        f.next_down()
    } else {
        f
    }
}

/// The smallest f32 at or above `v` (`v >= 0`, within the f32 range).
pub(super) fn ceil_f32(v: f64) -> f32 {
    let f = v as f32;
    if f64::from(f) < v {
        f.next_up()
    } else {
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_weight_cut_is_the_exact_threshold() {
        for (max, m) in [
            (0.0f32, 0.5f32),
            (3.0, 0.05),
            (-7.5, 1e-30),
            (1e30, 0.999_999),
            (-1e30, 0.3),
            (5.0, 1e-45),
            (1e-10, 1.0),
            (7.0, 1.0),
        ] {
            let cut = weight_cut(max, m);
            assert!(exp_weight(cut, max) >= m, "{max} {m}");
            assert!(exp_weight(cut.next_down(), max) < m, "{max} {m}");
        }
    }

    #[test]
    fn float_rounding_helpers_round_the_right_way() {
        for v in [0.1f64, 1.0, 1e-46, 3.0e38, 0.0, 2.5e-40] {
            assert!(f64::from(floor_f32(v)) <= v && f64::from(floor_f32(v).next_up()) > v);
            assert!(f64::from(ceil_f32(v)) >= v && f64::from(ceil_f32(v).next_down()) < v);
        }
    }
}
