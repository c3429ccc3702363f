//! The linear (matrix-vector) kernel against an f64 reference, for every
//! instruction-set variant this machine runs, f32 and bf16 weights; and its
//! promise that a row's result does not depend on the batch around it.

use super::linear::{run, LinearIsa};
use super::{bf16_to_f32, f32_to_bf16, KernelError, LinearShape};

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed * 0x9E37_79B9_7F4A_7C15 + 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn reference(shape: LinearShape, x: &[f32], w: &[f32], bias: Option<&[f32]>) -> Vec<f64> {
    let LinearShape { m, k, n } = shape;
    let mut out = vec![0.0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let dot: f64 = (0..k)
                .map(|t| f64::from(x[i * k + t]) * f64::from(w[j * k + t]))
                .sum();
            out[i * n + j] = dot + bias.map_or(0.0, |b| f64::from(b[j]));
        }
    }
    out
}

/// Shapes with tails in k (not a multiple of the lanes), in n (not a multiple of
/// a work item) and row counts across the row groups.
const SHAPES: [(usize, usize, usize); 6] = [
    (1, 64, 64),
    (1, 576, 1536),
    (2, 100, 70),
    (3, 37, 129),
    (5, 512, 200),
    (9, 33, 65),
];

#[test]
fn f32_weights_match_the_reference_on_every_isa() {
    for isa in LinearIsa::available() {
        for threads in [1, 2, 3] {
            for (seed, &(m, k, n)) in SHAPES.iter().enumerate() {
                let shape = LinearShape { m, k, n };
                let (x, w, b) = (values(m * k, seed as u64), values(n * k, 99), values(n, 7));
                let mut out = vec![0.0f32; m * n];
                run(shape, &x, &w, Some(&b), threads, &mut out, isa).unwrap();
                let want = reference(shape, &x, &w, Some(&b));
                for (got, want) in out.iter().zip(&want) {
                    let tol = 1e-5 * (k as f64).sqrt();
                    assert!(
                        (f64::from(*got) - want).abs() <= tol,
                        "{isa:?} {threads} threads {shape:?}: {got} vs {want}"
                    );
                }
            }
        }
    }
}

#[test]
fn bf16_weights_and_activations_match_the_reference_on_every_isa() {
    for isa in LinearIsa::available() {
        for &(m, k, n) in &SHAPES {
            let shape = LinearShape { m, k, n };
            let x: Vec<u16> = values(m * k, 3).into_iter().map(f32_to_bf16).collect();
            let w: Vec<u16> = values(n * k, 4).into_iter().map(f32_to_bf16).collect();
            let mut out = vec![0u16; m * n];
            run(shape, &x, &w, None, 2, &mut out, isa).unwrap();
            let xf: Vec<f32> = x.iter().map(|v| bf16_to_f32(*v)).collect();
            let wf: Vec<f32> = w.iter().map(|v| bf16_to_f32(*v)).collect();
            let want = reference(shape, &xf, &wf, None);
            for (got, want) in out.iter().zip(&want) {
                // The f32 sum is rounded once to bf16: 8 bits of mantissa.
                let got = f64::from(bf16_to_f32(*got));
                assert!(
                    (got - want).abs() <= want.abs() / 128.0 + 1e-4,
                    "{isa:?} {shape:?}: {got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn a_row_gives_the_same_bits_alone_and_in_any_batch() {
    let (k, n) = (300, 130);
    let w = values(n * k, 5);
    let x = values(9 * k, 6);
    for isa in LinearIsa::available() {
        let mut batch = vec![0.0f32; 9 * n];
        run(LinearShape { m: 9, k, n }, &x, &w, None, 2, &mut batch, isa).unwrap();
        for i in 0..9 {
            for threads in [1, 2] {
                let mut alone = vec![0.0f32; n];
                let row = &x[i * k..(i + 1) * k];
                run(
                    LinearShape { m: 1, k, n },
                    row,
                    &w,
                    None,
                    threads,
                    &mut alone,
                    isa,
                )
                .unwrap();
                assert_eq!(alone, batch[i * n..(i + 1) * n], "{isa:?} row {i}");
            }
        }
    }
}

#[test]
fn bad_shapes_are_refused_before_writing() {
    let mut out = vec![7.0f32; 4];
    let err = run(
        LinearShape { m: 2, k: 3, n: 2 },
        &[0.0f32; 5],
        &[0.0f32; 6],
        None,
        1,
        &mut out,
        LinearIsa::Portable,
    )
    .unwrap_err();
    assert!(matches!(err, KernelError::Shape(_)));
    assert!(err.to_string().contains("x has 5 elements"), "{err}");
    let err = run(
        LinearShape { m: 2, k: 3, n: 2 },
        &[0.0f32; 6],
        &[0.0f32; 6],
        Some(&[0.0; 3]),
        1,
        &mut out,
        LinearIsa::Portable,
    )
    .unwrap_err();
    assert!(err.to_string().contains("bias"), "{err}");
    assert_eq!(out, [7.0; 4]);
}
