//! The GGUF integer kernel on every block type and every path this CPU runs:
//! each path equal to the portable one bit for bit, and the portable one within
//! the int8 activations' rounding of dequantize + an f64 dot product.
//!
//! The tolerance: each 16 elements `b` of x are stored as `dx_b · x_q` with
//! `dx_b = max|x_b| / 127` and `x_q` rounded to nearest, so each `x_i` moves by at
//! most `dx_b / 2` and the dot product by at most `Σ_i |w_i| · dx_b / 2`; on top of that, f32
//! rounding of a sum of `k` terms (1e-4 of `Σ |w_i x_i|`, generous).

use super::bf16::{bf16_to_f32, f32_to_bf16};
use super::gguf::{dequantize, GgufType};
use super::gguf_int::{run, run_into, OutRows, QuantIsa};

/// xorshift; the first value depends on the seed.
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

pub(super) const INT_TYPES: [GgufType; 8] = [
    GgufType::Q8_0,
    GgufType::Q4_0,
    GgufType::Q4_1,
    GgufType::Q5_0,
    GgufType::Q5_1,
    GgufType::Q4K,
    GgufType::Q5K,
    GgufType::Q6K,
];

/// Random blocks whose f16 scales are finite (0.001..0.05, either sign for d).
pub(super) fn blocks(t: GgufType, n: usize, k: usize, rng: &mut Rng) -> Vec<u8> {
    let rb = t.row_bytes(k).unwrap();
    let mut w: Vec<u8> = (0..n * rb).map(|_| rng.next() as u8).collect();
    let (_, size) = t.block();
    let halves: &[usize] = match t {
        GgufType::Q8_0 | GgufType::Q4_0 | GgufType::Q5_0 => &[0],
        GgufType::Q6K => &[208],
        _ => &[0, 2],
    };
    for b in w.chunks_exact_mut(size) {
        for &at in halves {
            // 0x1000..0x2a00: 2^-11.. 0.05; the sign bit at random
            let h = (0x1000 + (rng.next() % 0x1a00) as u16) | (rng.next() as u16 & 0x8000);
            b[at..at + 2].copy_from_slice(&h.to_le_bytes());
        }
    }
    w
}

pub(super) fn xs(m: usize, k: usize, rng: &mut Rng) -> Vec<f32> {
    let mut x: Vec<f32> = (0..m * k).map(|_| 3.0 * rng.uniform()).collect();
    x[32..64].fill(0.0); // an all-zero block (scale 0)
    x
}

#[test]
fn every_path_equals_portable_bit_for_bit() {
    let (k, n) = (512, 37);
    let mut rng = Rng(7);
    for t in INT_TYPES {
        let w = blocks(t, n, k, &mut rng);
        for m in [1, 3, 8, 11, 16, 21] {
            let x = xs(m, k, &mut rng);
            let mut want = vec![0.0; m * n];
            run(QuantIsa::Portable, t, (m, k), &x, (&w, false), 1, &mut want).unwrap();
            for isa in QuantIsa::available() {
                for threads in [1, 2] {
                    let mut got = vec![f32::NAN; m * n];
                    run(isa, t, (m, k), &x, (&w, false), threads, &mut got).unwrap();
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{t:?} {isa:?} m={m} threads={threads}");
                }
            }
        }
    }
}

/// A fused step's projections (`decode_proj`) hand the kernel bf16 rows and a
/// part's columns of a wider output: the bits of widening x, the f32 product
/// and rounding each output, and the columns around the part untouched.
#[test]
fn bf16_rows_into_a_parts_columns_equal_widen_then_round() {
    let (k, n, stride, first) = (256, 37, 45, 5);
    let mut rng = Rng(19);
    for t in INT_TYPES {
        let w = blocks(t, n, k, &mut rng);
        for m in [1, 9, 21] {
            let xb: Vec<u16> = xs(m, k, &mut rng).into_iter().map(f32_to_bf16).collect();
            let wide: Vec<f32> = xb.iter().map(|&b| bf16_to_f32(b)).collect();
            let mut want = vec![0.0; m * n];
            run(
                QuantIsa::Portable,
                t,
                (m, k),
                &wide,
                (&w, false),
                1,
                &mut want,
            )
            .unwrap();
            for isa in QuantIsa::available() {
                let mut got = vec![0x1234u16; m * stride];
                let out = OutRows {
                    out: &mut got,
                    stride,
                    first,
                };
                run_into(isa, t, (m, k), &xb, (&w, false), 2, out).unwrap();
                for r in 0..m {
                    let row = &got[r * stride..(r + 1) * stride];
                    let mine: Vec<u16> = want[r * n..(r + 1) * n]
                        .iter()
                        .map(|&v| f32_to_bf16(v))
                        .collect();
                    assert_eq!(
                        &row[first..first + n],
                        &mine[..],
                        "{t:?} {isa:?} m={m} row {r}"
                    );
                    assert!(row[..first]
                        .iter()
                        .chain(&row[first + n..])
                        .all(|&v| v == 0x1234));
                }
            }
        }
    }
    // a part wider than its output's rows is an error, before anything is written
    let w = blocks(GgufType::Q8_0, 4, 32, &mut rng);
    let mut out = vec![0.0f32; 6];
    let o = OutRows {
        out: &mut out,
        stride: 6,
        first: 3,
    };
    let err = run_into(
        QuantIsa::Portable,
        GgufType::Q8_0,
        (1, 32),
        &[1.0; 32],
        (&w, false),
        1,
        o,
    );
    assert!(err.is_err());
    assert!(out.iter().all(|&v| v == 0.0));
}

#[test]
fn portable_path_within_int8_rounding_of_dequantize() {
    let (k, n) = (512, 29);
    let mut rng = Rng(11);
    for t in INT_TYPES {
        let w = blocks(t, n, k, &mut rng);
        let mut dense = vec![0.0; n * k];
        dequantize(t, k, &w, &mut dense).unwrap();
        for m in [1, 2, 5] {
            let x = xs(m, k, &mut rng);
            let mut got = vec![0.0; m * n];
            run(QuantIsa::Portable, t, (m, k), &x, (&w, false), 2, &mut got).unwrap();
            for r in 0..m {
                let xr = &x[r * k..(r + 1) * k];
                for j in 0..n {
                    let wr = &dense[j * k..(j + 1) * k];
                    let (mut want, mut bound, mut mag) = (0.0f64, 0.0f64, 0.0f64);
                    for (xb, wb) in xr.chunks_exact(16).zip(wr.chunks_exact(16)) {
                        let dx = f64::from(xb.iter().fold(0.0f32, |a, v| a.max(v.abs()))) / 127.0;
                        for (xi, wi) in xb.iter().zip(wb) {
                            let (xi, wi) = (f64::from(*xi), f64::from(*wi));
                            want += xi * wi;
                            bound += wi.abs() * dx / 2.0;
                            mag += (xi * wi).abs();
                        }
                    }
                    let err = (f64::from(got[r * n + j]) - want).abs();
                    assert!(
                        err <= bound + 1e-4 * mag + 1e-6,
                        "{t:?} m={m} ({r}, {j}): {} vs {want}, bound {bound}",
                        got[r * n + j]
                    );
                    // the bound is not vacuous: far below the dot's magnitude
                    assert!(bound < 0.05 * mag, "{t:?}: bound {bound} of {mag}");
                }
            }
        }
    }
}

#[test]
fn nan_in_x_reaches_the_output_and_bad_shapes_are_errors() {
    let (k, n) = (64, 3);
    let mut rng = Rng(3);
    let w = blocks(GgufType::Q4_1, n, k, &mut rng);
    let mut x = xs(1, k, &mut rng);
    x[5] = f32::NAN;
    let mut out = vec![0.0; n];
    run(
        QuantIsa::Portable,
        GgufType::Q4_1,
        (1, k),
        &x,
        (&w, false),
        1,
        &mut out,
    )
    .unwrap();
    assert!(out.iter().all(|v| v.is_nan()));
    let p = QuantIsa::Portable;
    assert!(run(
        p,
        GgufType::F16,
        (1, 32),
        &[0.0; 32],
        (&[0; 64], false),
        1,
        &mut [0.0; 1]
    )
    .is_err());
    assert!(run(
        p,
        GgufType::Q8_0,
        (1, 32),
        &[0.0; 32],
        (&[0; 68], false),
        1,
        &mut [0.0; 1]
    )
    .is_err());
    assert!(run(
        p,
        GgufType::Q8_0,
        (1, 30),
        &[0.0; 30],
        (&[0; 34], false),
        1,
        &mut [0.0; 1]
    )
    .is_err());
    assert!(run(
        p,
        GgufType::Q8_0,
        (1, 32),
        &[0.0; 32],
        (&[0; 34], false),
        0,
        &mut [0.0; 1]
    )
    .is_err());
}

#[test]
fn a_row_has_the_same_bits_alone_and_in_any_batch() {
    // every group size: 115 rows take 64, 32, 16 (or 8 and 8) and 3; the others
    // one group of their own
    let (k, n) = (256, 21);
    let mut rng = Rng(5);
    for t in INT_TYPES {
        let w = blocks(t, n, k, &mut rng);
        for m in [115, 2, 4, 5, 6, 7, 8, 9, 12, 15] {
            let x = xs(m, k, &mut rng);
            for isa in QuantIsa::available() {
                let mut all = vec![0.0; m * n];
                run(isa, t, (m, k), &x, (&w, false), 2, &mut all).unwrap();
                for (r, want) in all.chunks_exact(n).enumerate() {
                    let mut alone = vec![0.0; n];
                    let row = &x[r * k..(r + 1) * k];
                    run(isa, t, (1, k), row, (&w, false), 1, &mut alone).unwrap();
                    let same = alone
                        .iter()
                        .zip(want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{t:?} {isa:?} m={m} row {r}");
                }
            }
        }
    }
}
