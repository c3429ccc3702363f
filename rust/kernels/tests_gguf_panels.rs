//! The panel layout (`gguf_panels`): it keeps every byte (rows unpack to the
//! GGUF layout exactly), and the integer kernel reads it to the same bits as the
//! GGUF layout on every path, with whole panels, a tail of plain rows, or none.

use super::gguf::{dequantize as dequantize_plain, GgufType};
use super::gguf_int::{run, QuantIsa};
use super::gguf_linear::gguf_linear;
use super::gguf_panels::{dequantize, pack, unpack_rows, PANEL};
use super::tests_gguf_int::{blocks, xs, Rng, INT_TYPES};

#[test]
fn every_row_unpacks_to_its_gguf_bytes() {
    let k = 512;
    let mut rng = Rng(11);
    for t in INT_TYPES {
        for n in [5, 16, 37] {
            let plain = blocks(t, n, k, &mut rng);
            let mut w = plain.clone();
            pack(t, k, &mut w).unwrap();
            if n >= PANEL {
                assert_ne!(w, plain, "{t:?}: whole panels change layout");
            }
            let ids: Vec<usize> = (0..n).rev().collect();
            let mut out = vec![0u8; plain.len()];
            unpack_rows(t, k, &w, &ids, &mut out).unwrap();
            let rb = plain.len() / n;
            for (i, &r) in ids.iter().enumerate() {
                assert_eq!(
                    out[i * rb..(i + 1) * rb],
                    plain[r * rb..(r + 1) * rb],
                    "{t:?} row {r}"
                );
            }
        }
    }
}

#[test]
fn panels_dequantize_to_the_same_bits() {
    let k = 512;
    let mut rng = Rng(17);
    for t in INT_TYPES {
        for n in [5, 16, 37] {
            let plain = blocks(t, n, k, &mut rng);
            let mut w = plain.clone();
            pack(t, k, &mut w).unwrap();
            let (mut want, mut got) = (vec![0.0; n * k], vec![f32::NAN; n * k]);
            dequantize_plain(t, k, &plain, &mut want).unwrap();
            dequantize(t, k, &w, &mut got).unwrap();
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{t:?} n={n}");
        }
    }
}

#[test]
fn the_kernel_gives_the_same_bits_on_panels() {
    let k = 256;
    let mut rng = Rng(13);
    for t in INT_TYPES {
        // whole panels, and panels then plain rows; items of two panels: one
        // item, one and a lone panel (48), and both with plain rows after
        for n in [5, 32, 37, 48, 53] {
            let plain = blocks(t, n, k, &mut rng);
            let mut w = plain.clone();
            pack(t, k, &mut w).unwrap();
            for m in [1, 2, 5, 16, 21, 70] {
                let x = xs(m, k, &mut rng);
                for isa in QuantIsa::available() {
                    let threads = 1 + m % 2;
                    let mut want = vec![0.0; m * n];
                    run(isa, t, (m, k), &x, (&plain, false), threads, &mut want).unwrap();
                    let mut got = vec![f32::NAN; m * n];
                    run(isa, t, (m, k), &x, (&w, true), threads, &mut got).unwrap();
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{t:?} {isa:?} n={n} m={m}");
                }
            }
        }
    }
}

#[test]
fn the_float_kernel_gives_the_same_bits_on_panels() {
    let k = 256;
    let mut rng = Rng(19);
    for t in INT_TYPES {
        let n = 37; // two panels and five plain rows
        let plain = blocks(t, n, k, &mut rng);
        let mut w = plain.clone();
        pack(t, k, &mut w).unwrap();
        for m in [1, 3] {
            let x = xs(m, k, &mut rng);
            let (mut want, mut got) = (vec![0.0; m * n], vec![f32::NAN; m * n]);
            gguf_linear(t, m, k, &x, &plain, false, 2, &mut want).unwrap();
            gguf_linear(t, m, k, &x, &w, true, 2, &mut got).unwrap();
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{t:?} m={m}");
        }
    }
    let mut out = [0.0; 1];
    assert!(gguf_linear(GgufType::F16, 1, 1, &[0.0], &[0; 2], true, 1, &mut out).is_err());
}

#[test]
fn bad_layouts_are_errors() {
    let mut w = vec![0u8; 16 * 64];
    assert!(
        pack(GgufType::F16, 32, &mut w).is_err(),
        "float types have no panels"
    );
    assert!(
        pack(GgufType::Q8_0, 32, &mut w[..100]).is_err(),
        "whole rows only"
    );
    let mut out = vec![0u8; 34];
    let w = vec![0u8; 34 * 3];
    assert!(
        unpack_rows(GgufType::Q8_0, 32, &w, &[3], &mut out).is_err(),
        "row past the end"
    );
    assert!(
        unpack_rows(GgufType::Q8_0, 32, &w, &[0, 1], &mut out).is_err(),
        "out too small"
    );
    unpack_rows(GgufType::Q8_0, 32, &w, &[2], &mut out).unwrap();
}
