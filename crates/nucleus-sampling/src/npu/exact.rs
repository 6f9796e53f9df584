//! Exact sums of non-negative f32 values, for the top-p decisions of
//! [`top_k_top_p_sample`](super::top_k_top_p_sample) that f64 cannot certify.
//!
//! Every finite f32 is an integer multiple of `2^-149` (the smallest subnormal) below `2^128`,
//! so a sum of up to `2^32` of them is an integer below `2^309` in units of `2^-149`: [`Exact`]
//! holds it in six 64-bit limbs (384 bits, room for the product by a 24-bit mantissa that
//! [`Exact::scale_floor`] forms). Sums are order-independent, so a quickselect and a sorted
//! walk reach the same decisions.

use std::cmp::Ordering;

const LIMBS: usize = 6;

/// A non-negative integer in units of `2^-149`, little-endian 64-bit limbs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Exact([u64; LIMBS]);

impl Exact {
    /// Adds `w` (finite, `>= 0`; `-0.0` counts as 0) exactly.
    #[inline]
    pub(crate) fn add_f32(&mut self, w: f32) {
        debug_assert!(w.is_finite() && w >= 0.0, "{w}");
        let bits = w.to_bits() & 0x7fff_ffff;
        let exp = bits >> 23;
        let (mant, shift) = if exp == 0 {
            (bits & 0x7f_ffff, 0)
        } else {
            ((bits & 0x7f_ffff) | 0x80_0000, exp - 1)
        };
        if mant == 0 {
            return;
        }
        // `mant * 2^shift` units: at most 88 bits starting in limb `shift / 64`.
        let v = u128::from(mant) << (shift % 64);
        let at = (shift / 64) as usize;
        self.add_at(at, v as u64);
        self.add_at(at + 1, (v >> 64) as u64);
    }

    /// Adds `v` at limb `i`, carrying upwards.
    #[inline]
    fn add_at(&mut self, mut i: usize, v: u64) {
        let mut carry = v;
        while carry != 0 && i < LIMBS {
            let (s, c) = self.0[i].overflowing_add(carry);
            self.0[i] = s;
            carry = u64::from(c);
            i += 1;
        }
        debug_assert_eq!(carry, 0, "exact sum overflow");
    }

    /// `floor(p * self)` for `p` in `[0, 1)` (an f32, so `p = m * 2^-s` with `m < 2^24`).
    pub(crate) fn scale_floor(&self, p: f32) -> Exact {
        debug_assert!((0.0..1.0).contains(&p), "{p}");
        let bits = p.to_bits() & 0x7fff_ffff;
        let exp = bits >> 23;
        // p = mant * 2^-shift.
        let (mant, shift) = if exp == 0 {
            (bits & 0x7f_ffff, 149u32)
        } else {
            ((bits & 0x7f_ffff) | 0x80_0000, 150 - exp)
        };
        // self * mant: self < 2^320 (sums of at most 2^32 terms), mant < 2^24.
        let mut prod = [0u64; LIMBS];
        let mut carry = 0u128;
        for (o, &l) in prod.iter_mut().zip(&self.0) {
            let t = u128::from(l) * u128::from(mant) + carry;
            *o = t as u64;
            carry = t >> 64;
        }
        debug_assert_eq!(carry, 0, "exact product overflow");
        // >> shift.
        let (limbs, bits) = ((shift / 64) as usize, shift % 64);
        let mut out = [0u64; LIMBS];
        for (i, o) in out.iter_mut().enumerate() {
            let lo = prod.get(i + limbs).copied().unwrap_or(0);
            let hi = prod.get(i + limbs + 1).copied().unwrap_or(0);
            *o = if bits == 0 {
                lo
            } else {
                (lo >> bits) | (hi << (64 - bits))
            };
        }
        Exact(out)
    }

    /// The exact sum of `values`.
    pub(crate) fn sum(values: impl Iterator<Item = f32>) -> Exact {
        let mut e = Exact::default();
        for v in values {
            e.add_f32(v);
        }
        e
    }
}

impl PartialOrd for Exact {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Exact {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.iter().rev().cmp(other.0.iter().rev())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value as f64 when it is small enough to be exact there (tests only).
    fn to_f64(e: &Exact) -> f64 {
        let mut v = 0.0f64;
        for (i, &l) in e.0.iter().enumerate() {
            v += l as f64 * 2f64.powi(64 * i as i32 - 149);
        }
        v
    }

    #[test]
    fn sums_are_exact_and_order_independent() {
        let vals = [
            1.0f32,
            0.5,
            0.25,
            1e-45,
            f32::MIN_POSITIVE,
            3.0e38,
            0.1,
            0.0,
            -0.0,
        ];
        let a = Exact::sum(vals.iter().copied());
        let b = Exact::sum(vals.iter().rev().copied());
        assert_eq!(a, b);
        // Small dyadic values: the f64 sum is exact.
        let d = Exact::sum([0.25f32, 0.125, 0.125, 0.5].into_iter());
        assert_eq!(to_f64(&d), 1.0);
        // 1e-45 is the smallest subnormal: one unit.
        let u = Exact::sum([1e-45f32].into_iter());
        assert_eq!(u.0, [1, 0, 0, 0, 0, 0]);
        // A value that f64 would lose next to 1.
        let mut x = Exact::sum([1.0f32].into_iter());
        let one = x;
        x.add_f32(1e-45);
        assert!(x > one);
        // Carries across limbs: 2^64 units twice.
        let big = f32::from_bits(42 << 23); // 2^(42 - 127) = 2^-85 = 2^64 units
        let c = Exact::sum([big, big].into_iter());
        assert_eq!(c.0, [0, 2, 0, 0, 0, 0]);
        let max = Exact::sum(std::iter::repeat_n(f32::MAX, 1000));
        assert!(max > Exact::sum(std::iter::repeat_n(f32::MAX, 999)));
    }

    #[test]
    fn scale_floor_is_the_floor_of_the_exact_product() {
        // 0.75 * 1 = 0.75 exactly; floor in units is exact.
        let one = Exact::sum([1.0f32].into_iter());
        let t = one.scale_floor(0.75);
        assert_eq!(to_f64(&t), 0.75);
        // p * Z with bits below the unit: floor drops them. Z = 1 unit, p = 0.5 -> 0.
        let unit = Exact::sum([1e-45f32].into_iter());
        assert_eq!(unit.scale_floor(0.5), Exact::default());
        // 3 units * 0.5 = 1.5 -> 1 unit.
        let three = Exact::sum([1e-45f32, 1e-45, 1e-45].into_iter());
        assert_eq!(three.scale_floor(0.5).0, [1, 0, 0, 0, 0, 0]);
        // A subnormal p: p = 2^-149, Z = 2^149 units * 2^-149... Z = 1.0 -> 1 unit.
        assert_eq!(one.scale_floor(1e-45).0, [1, 0, 0, 0, 0, 0]);
        // Against f64 where f64 is exact.
        for (z, p) in [(0.375f32, 0.5f32), (12.0, 0.25), (1.0, 0.999_999_94)] {
            let e = Exact::sum([z].into_iter()).scale_floor(p);
            assert_eq!(to_f64(&e), f64::from(z) * f64::from(p), "{z} {p}");
        }
        assert_eq!(one.scale_floor(0.0), Exact::default());
    }
}
