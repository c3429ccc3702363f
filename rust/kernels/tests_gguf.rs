//! GGUF block kernels: the half-float conversion, dequantization of hand-made
//! blocks, and the linear kernel against dequantize + a plain dot product.
//! (Equality with gguf-py, bit for bit, is checked from Python.)

use super::gguf::{dequantize, f16_to_f32, GgufType};
use super::gguf_linear::gguf_linear;

#[test]
fn half_floats_convert_exactly() {
    assert_eq!(f16_to_f32(0x3c00), 1.0);
    assert_eq!(f16_to_f32(0xc000), -2.0);
    assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24)); // the smallest subnormal
    assert_eq!(f16_to_f32(0x8000).to_bits(), 0x8000_0000); // -0.0
    assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
    assert!(f16_to_f32(0x7e00).is_nan());
}

#[test]
fn q8_0_and_q4_1_blocks_by_hand() {
    // Q8_0: d = 0.5, then 32 int8 values
    let mut q8 = vec![0x00, 0x38];
    q8.extend((0..32).map(|i| (i as i8 - 16) as u8));
    let mut out = vec![0.0; 32];
    dequantize(GgufType::Q8_0, 32, &q8, &mut out).unwrap();
    assert_eq!(out[0], -8.0);
    assert_eq!(out[31], 7.5);
    // Q4_1: d = 1, m = -2; byte j holds element j (low nibble) and j + 16 (high)
    let mut q4 = vec![0x00, 0x3c, 0x00, 0xc0];
    q4.extend((0..16).map(|j| (j as u8) | (15 - j as u8) << 4));
    dequantize(GgufType::Q4_1, 32, &q4, &mut out).unwrap();
    assert_eq!(out[3], 1.0);
    assert_eq!(out[16], 13.0);
}

#[test]
fn linear_equals_dequantize_then_dot() {
    let (m, k, n) = (3, 64, 5);
    let t = GgufType::Q4_0;
    let rb = t.row_bytes(k).unwrap();
    let w: Vec<u8> = (0..n * rb)
        .map(|i| {
            if i % 18 == 1 {
                0x30
            } else {
                (i * 37 % 251) as u8
            }
        })
        .collect();
    let x: Vec<f32> = (0..m * k)
        .map(|i| ((i * 13 % 17) as f32 - 8.0) / 8.0)
        .collect();
    let mut dense = vec![0.0; n * k];
    dequantize(t, k, &w, &mut dense).unwrap();
    for threads in [1, 2] {
        let mut out = vec![0.0; m * n];
        gguf_linear(t, m, k, &x, &w, false, threads, &mut out).unwrap();
        for r in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|i| x[r * k + i] * dense[j * k + i]).sum();
                assert!((out[r * n + j] - want).abs() <= 1e-4 * want.abs().max(1.0));
            }
        }
    }
}

#[test]
fn bad_shapes_and_types_are_errors() {
    assert!(GgufType::from_name("IQ2_XXS").is_err());
    let mut out = vec![0.0; 32];
    assert!(dequantize(GgufType::Q8_0, 32, &[0; 33], &mut out).is_err());
    assert!(dequantize(GgufType::Q8_0, 30, &[0; 34], &mut out).is_err());
    let mut small = vec![0.0; 1];
    assert!(gguf_linear(
        GgufType::Q8_0,
        1,
        32,
        &[0.0; 32],
        &[0; 68],
        false,
        1,
        &mut small
    )
    .is_err());
}

#[test]
fn fused_block_types_equal_dequantize_then_dot() {
    // Q8_0, Q4_0 and Q4_1 take the fused path (scale times integer dot); more x
    // rows than a decoded row has room for block sums of.
    let (m, k, n) = (40, 64, 3);
    for t in [GgufType::Q8_0, GgufType::Q4_0, GgufType::Q4_1] {
        let (_, size) = t.block();
        let rb = t.row_bytes(k).unwrap();
        let w: Vec<u8> = (0..n * rb)
            .map(|i| match i % size {
                0 | 2 => 0x00,
                1 => 0x30,               // d = 0.125
                3 if size == 20 => 0xb8, // m = -0.5
                _ => (i * 37 % 251) as u8,
            })
            .collect();
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 13 % 17) as f32 - 8.0) / 8.0)
            .collect();
        let mut dense = vec![0.0; n * k];
        dequantize(t, k, &w, &mut dense).unwrap();
        let mut out = vec![0.0; m * n];
        gguf_linear(t, m, k, &x, &w, false, 2, &mut out).unwrap();
        for r in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|i| x[r * k + i] * dense[j * k + i]).sum();
                let scale: f32 = (0..k)
                    .map(|i| (x[r * k + i] * dense[j * k + i]).abs())
                    .sum();
                assert!(
                    (out[r * n + j] - want).abs() <= 1e-5 * scale + 1e-6,
                    "{t:?}"
                );
            }
        }
    }
}
