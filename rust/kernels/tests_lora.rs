//! `lora_add` against per-token products, on every ISA the CPU has.

use super::bf16::{bf16_to_f32, f32_to_bf16};
use super::linear::{Elem, LinearIsa};
use super::lora::{add_checked, check, lora_add, LoraLayout, LoraShape};

/// A small deterministic generator: values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Three fused parts of 7, 6 and 8 outputs, rank 4 each.
const PARTS: [usize; 3] = [7, 6, 8];

/// Whether `b`'s element at rank row `j`, column `o` is in its part's block.
fn in_block(j: usize, o: usize) -> bool {
    let p = j / 4;
    let lo: usize = PARTS[..p].iter().sum();
    (lo..lo + PARTS[p]).contains(&o)
}

#[test]
fn mixed_slots_match_the_per_token_products() {
    let shape = LoraShape {
        tokens: 11,
        k: 19,
        width: 12,
        n: 21,
        slots: 3,
    };
    let x = values(shape.tokens * shape.k, 1);
    let a = values(shape.slots * shape.k * shape.width, 2);
    // b block-diagonal, as laid out; NaN off the blocks, which are never read
    let mut b = values(shape.slots * shape.width * shape.n, 3);
    for (i, v) in b.iter_mut().enumerate() {
        if !in_block(i / shape.n % shape.width, i % shape.n) {
            *v = f32::NAN;
        }
    }
    let y0 = values(shape.tokens * shape.n, 4);
    let slots = [2, -1, 0, 2, 1, 1, -1, 0, 2, 2, 0];
    let full = LoraLayout {
        parts: &PARTS,
        ranks: &[4, 4, 4],
    };
    for threads in [1, 3] {
        let mut y = y0.clone();
        lora_add(shape, full, &mut y, &x, &a, &b, &slots, threads).unwrap();
        for (t, &s) in slots.iter().enumerate() {
            for o in 0..shape.n {
                let mut want = y0[t * shape.n + o] as f64;
                if s >= 0 {
                    let s = s as usize;
                    for j in (0..shape.width).filter(|&j| in_block(j, o)) {
                        let h: f64 = (0..shape.k)
                            .map(|i| {
                                x[t * shape.k + i] as f64
                                    * a[(s * shape.k + i) * shape.width + j] as f64
                            })
                            .sum();
                        want += h * b[(s * shape.width + j) * shape.n + o] as f64;
                    }
                }
                let got = y[t * shape.n + o] as f64;
                assert!(
                    (got - want).abs() < 1e-4,
                    "token {t} out {o}: {got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn padded_ranks_are_never_read() {
    // slots of rank 2, 4 and 0 in blocks of 4: every A and B value past a
    // slot's rank is NaN, so reading one would show in the output
    let shape = LoraShape {
        tokens: 6,
        k: 9,
        width: 12,
        n: 21,
        slots: 3,
    };
    let ranks = [2usize, 4, 0];
    let x = values(shape.tokens * shape.k, 5);
    let mut a = values(shape.slots * shape.k * shape.width, 6);
    for (i, v) in a.iter_mut().enumerate() {
        let (s, j) = (i / (shape.k * shape.width), i % shape.width);
        if j % 4 >= ranks[s] {
            *v = f32::NAN;
        }
    }
    let mut b = values(shape.slots * shape.width * shape.n, 7);
    for (i, v) in b.iter_mut().enumerate() {
        let (s, j) = (i / (shape.width * shape.n), i / shape.n % shape.width);
        if j % 4 >= ranks[s] || !in_block(j, i % shape.n) {
            *v = f32::NAN;
        }
    }
    let y0 = values(shape.tokens * shape.n, 8);
    let slots = [0, 1, 2, 0, -1, 1];
    let mut y = y0.clone();
    let layout = LoraLayout {
        parts: &PARTS,
        ranks: &ranks,
    };
    lora_add(shape, layout, &mut y, &x, &a, &b, &slots, 2).unwrap();
    for (t, &s) in slots.iter().enumerate() {
        for o in 0..shape.n {
            let mut want = y0[t * shape.n + o] as f64;
            if s >= 0 {
                let s = s as usize;
                let cols = (0..shape.width).filter(|&j| j % 4 < ranks[s] && in_block(j, o));
                for j in cols {
                    let h: f64 = (0..shape.k)
                        .map(|i| {
                            x[t * shape.k + i] as f64
                                * a[(s * shape.k + i) * shape.width + j] as f64
                        })
                        .sum();
                    want += h * b[(s * shape.width + j) * shape.n + o] as f64;
                }
            }
            let got = y[t * shape.n + o] as f64;
            assert!(
                (got - want).abs() < 1e-4,
                "token {t} out {o}: {got} vs {want}"
            );
        }
    }
}

/// `lora_add` in `isa` for the tokens `ts` alone (their rows of x and y).
#[allow(clippy::too_many_arguments)]
fn add_rows<E: Elem>(
    isa: LinearIsa,
    s: LoraShape,
    layout: LoraLayout<'_>,
    y: &[E],
    x: &[E],
    a: &[E],
    b: &[E],
    slots: &[i64],
    ts: &[usize],
) -> Vec<E> {
    let (k, n) = (s.k, s.n);
    let mut y: Vec<E> = ts
        .iter()
        .flat_map(|&t| y[t * n..(t + 1) * n].to_vec())
        .collect();
    let x: Vec<E> = ts
        .iter()
        .flat_map(|&t| x[t * k..(t + 1) * k].to_vec())
        .collect();
    let slots: Vec<i64> = ts.iter().map(|&t| slots[t]).collect();
    let s = LoraShape {
        tokens: ts.len(),
        ..s
    };
    check(s, layout, [y.len(), x.len(), a.len(), b.len()], &slots).unwrap();
    add_checked(isa, s, layout, &mut y, &x, a, b, &slots, 2).unwrap();
    y
}

/// Whole vectors and tails of columns, 11 tokens of one slot (tiles of 8, 2
/// and 1), a rank below the block (11 of 16): on every ISA, f32 and bf16, each
/// token's result is the per-token product's, and the same bits alone as in
/// the batch; the padded ranks (NaN here) are never read.
#[test]
fn tiles_match_the_products_and_each_token_alone_on_every_isa() {
    let parts = [40usize, 24, 56];
    let s = LoraShape {
        tokens: 21,
        k: 37,
        width: 48,
        n: 120,
        slots: 3,
    };
    let ranks = [16usize, 11, 0];
    let layout = LoraLayout {
        parts: &parts,
        ranks: &ranks,
    };
    let bounds = [0, 40, 64, 120];
    let live = |sl: usize, j: usize, o: usize| {
        j % 16 < ranks[sl] && (bounds[j / 16]..bounds[j / 16 + 1]).contains(&o)
    };
    let x = values(s.tokens * s.k, 11);
    let mut a = values(s.slots * s.k * s.width, 12);
    for (i, v) in a.iter_mut().enumerate() {
        if i % s.width % 16 >= ranks[i / (s.k * s.width)] {
            *v = f32::NAN;
        }
    }
    let mut b = values(s.slots * s.width * s.n, 13);
    for (i, v) in b.iter_mut().enumerate() {
        let (sl, j) = (i / (s.width * s.n), i / s.n % s.width);
        if !live(sl, j, i % s.n) {
            *v = f32::NAN;
        }
    }
    let y = values(s.tokens * s.n, 14);
    let slots: Vec<i64> = (0..s.tokens as i64)
        .map(|t| [0, 0, 1, 0, -1, 2][t as usize % 6])
        .collect();
    let bf = |v: &[f32]| v.iter().map(|&x| f32_to_bf16(x)).collect::<Vec<u16>>();
    let (xb, ab, bb, yb) = (bf(&x), bf(&a), bf(&b), bf(&y));
    let all: Vec<usize> = (0..s.tokens).collect();
    for isa in LinearIsa::available() {
        let got = add_rows(isa, s, layout, &y, &x, &a, &b, &slots, &all);
        let got_bf = add_rows(isa, s, layout, &yb, &xb, &ab, &bb, &slots, &all);
        for t in 0..s.tokens {
            let alone = add_rows(isa, s, layout, &y, &x, &a, &b, &slots, &[t]);
            let alone_bf = add_rows(isa, s, layout, &yb, &xb, &ab, &bb, &slots, &[t]);
            let row = t * s.n..(t + 1) * s.n;
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&alone), bits(&got[row.clone()]), "{isa:?} token {t}");
            assert_eq!(alone_bf, got_bf[row], "{isa:?} bf16 token {t}");
            for o in 0..s.n {
                let mut want = y[t * s.n + o] as f64;
                if slots[t] >= 0 {
                    let sl = slots[t] as usize;
                    for j in (0..s.width).filter(|&j| live(sl, j, o)) {
                        let h: f64 = (0..s.k)
                            .map(|i| x[t * s.k + i] as f64 * a[(sl * s.k + i) * s.width + j] as f64)
                            .sum();
                        want += h * b[(sl * s.width + j) * s.n + o] as f64;
                    }
                }
                let (f, h) = (got[t * s.n + o] as f64, bf16_to_f32(got_bf[t * s.n + o]));
                assert!((f - want).abs() < 1e-4, "{isa:?} {t} {o}: {f} vs {want}");
                // bf16 operands and bf16 rounding of y: a loose bound
                assert!(
                    (h as f64 - want).abs() < 0.1,
                    "{isa:?} bf16 {t} {o}: {h} vs {want}"
                );
            }
        }
    }
}

#[test]
fn a_bad_slot_is_refused_before_writing() {
    let shape = LoraShape {
        tokens: 2,
        k: 3,
        width: 2,
        n: 4,
        slots: 1,
    };
    let mut y = vec![1.0f32; 8];
    let (x, a, b) = (vec![1.0f32; 6], vec![1.0f32; 6], vec![1.0f32; 8]);
    let one = |parts| LoraLayout { parts, ranks: &[2] };
    let err = lora_add(shape, one(&[4]), &mut y, &x, &a, &b, &[0, 1], 1).unwrap_err();
    assert!(
        err.to_string().contains("token 1 has slot 1, not in -1..1"),
        "{err}"
    );
    let err = lora_add(shape, one(&[1, 2]), &mut y, &x, &a, &b, &[0, 0], 1).unwrap_err();
    assert!(
        err.to_string().contains("parts [1, 2] must split n=4"),
        "{err}"
    );
    let err = lora_add(shape, one(&[2, 1, 1]), &mut y, &x, &a, &b, &[0, 0], 1).unwrap_err();
    assert!(err.to_string().contains("equal rank blocks"), "{err}");
    let high = LoraLayout {
        parts: &[4],
        ranks: &[3],
    };
    let err = lora_add(shape, high, &mut y, &x, &a, &b, &[0, 0], 1).unwrap_err();
    assert!(err.to_string().contains("a rank of at most 2"), "{err}");
    assert!(y.iter().all(|&v| v == 1.0));
}
