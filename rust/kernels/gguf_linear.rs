//! `out = x · dequantize(W)ᵀ` on GGUF blocks for the few rows of a decode step.
//!
//! Each weight row is read once per call, as blocks (4.5-8.5 bits a weight instead
//! of 32), and the float weight never exists in memory: the common 32-blocks
//! (Q8_0, Q4_0, Q4_1) multiply the block's scale into the dot of its integers; the
//! other types decode the row into a buffer that stays in L1 and dot it with each
//! row of `x`. Work items are ranges of output features, shared out over the team
//! of `team::Team`. Not bit-equal to dequantize + GEMM (another summation order),
//! equal to float rounding (tests).

#[cfg(target_arch = "x86_64")]
use super::bf16::{isa_cap, IsaCap};
use super::gguf::{decode_row, half, GgufType};
use super::gguf_panels::{unpack_panel, PANEL};
use super::team;
use super::KernelError;

/// Output features per work item (one panel of the panel layout).
const ITEM_ROWS: usize = PANEL;

/// `out[m, n] = x[m, k] · dequantize(w)[n, k]ᵀ` on `num_threads` threads; `w` is
/// `n` rows of blocks of `t`, in the panel layout (`gguf_panels`) when `panels`:
/// each item's panel is unpacked into a buffer first. Every check runs before
/// `out` is written.
#[allow(clippy::too_many_arguments)] // the product's operands and the layout
pub fn gguf_linear(
    t: GgufType,
    m: usize,
    k: usize,
    x: &[f32],
    w: &[u8],
    panels: bool,
    num_threads: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    if panels && matches!(t, GgufType::F32 | GgufType::F16 | GgufType::Bf16) {
        return Err(KernelError::Shape(format!(
            "gguf_linear: {t:?} has no panel layout"
        )));
    }
    let rb = t.row_bytes(k)?;
    let n = w.len().checked_div(rb).unwrap_or(0);
    if num_threads == 0 || k == 0 || w.len() != n * rb || x.len() != m * k || out.len() != m * n {
        return Err(KernelError::Shape(format!(
            "gguf_linear {t:?}: x has {} elements, w {} bytes, out {}; [m={m}, k={k}] needs \
             w of whole rows of {rb} bytes and out of m*n ({num_threads} threads)",
            x.len(),
            w.len(),
            out.len()
        )));
    }
    let out_ptr = OutPtr(out.as_mut_ptr());
    let item = |idx: usize, buf: &mut Vec<f32>| {
        // a decoded weight row, or each x row's block sums
        buf.resize(k.max(m * (k / 32)), 0.0);
        let rows = idx * ITEM_ROWS..((idx + 1) * ITEM_ROWS).min(n);
        let mut item_w = &w[rows.start * rb..rows.end * rb];
        let plain;
        if panels && rows.len() == PANEL {
            // the rows past the last whole panel stay in the GGUF layout
            let mut unpacked = vec![0u8; item_w.len()];
            unpack_panel(t, item_w, &mut unpacked);
            plain = unpacked;
            item_w = &plain;
        }
        item_rows(t, k, rb, x, item_w, buf, |r, j, v| {
            // SAFETY: `out` holds m * n elements (checked above) that only this
            // call writes; (r, rows.start + j) is in bounds and in this item's
            // range of output features alone, so no two threads write it.
            unsafe { out_ptr.get().add(r * n + rows.start + j).write(v) }
        });
    };
    team::run_items(n.div_ceil(ITEM_ROWS), num_threads, &item)
}

/// The dot products of one item's weight rows with every row of `x`, through the
/// best vector unit this CPU has (the same arithmetic: only the dot's lanes vary).
fn item_rows<F: Fn(usize, usize, f32)>(
    t: GgufType,
    k: usize,
    rb: usize,
    x: &[f32],
    w: &[u8],
    buf: &mut [f32],
    store: F,
) {
    // `ASYNCLLM_KERNEL_ISA=portable` forces the plain path (tests run both here)
    #[cfg(target_arch = "x86_64")]
    if !matches!(isa_cap(), Ok(IsaCap::Portable))
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
    {
        // SAFETY: the CPU has AVX2 and FMA (checked just above).
        return unsafe { item_rows_avx2(t, k, rb, x, w, buf, &store) };
    }
    item_rows_generic(t, k, rb, x, w, buf, &store)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn item_rows_avx2(
    t: GgufType,
    k: usize,
    rb: usize,
    x: &[f32],
    w: &[u8],
    buf: &mut [f32],
    store: &dyn Fn(usize, usize, f32),
) {
    item_rows_generic(t, k, rb, x, w, buf, store)
}

#[inline(always)]
fn item_rows_generic(
    t: GgufType,
    k: usize,
    rb: usize,
    x: &[f32],
    w: &[u8],
    buf: &mut [f32],
    store: &dyn Fn(usize, usize, f32),
) {
    if matches!(t, GgufType::Q8_0 | GgufType::Q4_0 | GgufType::Q4_1) {
        // The common 32-blocks: the block's scale applied to the dot of its
        // integers (and its offset to the sum of x's 32 values, computed once per
        // x row), without writing the decoded row anywhere.
        let blocks = k / 32;
        let (xsum, _) = buf.split_at_mut(x.len() / k * blocks);
        for (s, xb) in xsum.iter_mut().zip(x.chunks_exact(32)) {
            *s = xb.iter().sum();
        }
        for (j, row) in w.chunks_exact(rb).enumerate() {
            for (r, xr) in x.chunks_exact(k).enumerate() {
                let xs = &xsum[r * blocks..(r + 1) * blocks];
                let v = match t {
                    GgufType::Q8_0 => fused_q8_0(row, xr),
                    _ => fused_q4(row, xr, xs, t == GgufType::Q4_1),
                };
                store(r, j, v);
            }
        }
        return;
    }
    let buf = &mut buf[..k];
    for (j, row) in w.chunks_exact(rb).enumerate() {
        decode_row(t, row, buf);
        for (r, xr) in x.chunks_exact(k).enumerate() {
            store(r, j, dot(buf, xr));
        }
    }
}

/// Σ_blocks d · Σ q·x over a row of Q8_0 blocks, in 8 lanes.
#[inline(always)]
fn fused_q8_0(row: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    for (b, xb) in row.chunks_exact(34).zip(x.chunks_exact(32)) {
        let (Ok(b), Ok(xb)) = (<&[u8; 34]>::try_from(b), <&[f32; 32]>::try_from(xb)) else {
            continue;
        };
        let mut p = [0.0f32; 8];
        for i in 0..4 {
            for l in 0..8 {
                p[l] += f32::from(b[2 + 8 * i + l] as i8) * xb[8 * i + l];
            }
        }
        let d = half(b, 0);
        for l in 0..8 {
            acc[l] += d * p[l];
        }
    }
    lanes_sum(acc)
}

/// Q4_0 (d · (q - 8)) and Q4_1 (d · q + m) rows: d · Σ q·x, plus the offset times
/// the block's Σ x (`xsum`), in 8 lanes.
#[inline(always)]
fn fused_q4(row: &[u8], x: &[f32], xsum: &[f32], with_min: bool) -> f32 {
    let (size, qs_at) = if with_min { (20, 4) } else { (18, 2) };
    let mut acc = [0.0f32; 8];
    let mut offsets = 0.0f32;
    for ((b, xb), xs) in row.chunks_exact(size).zip(x.chunks_exact(32)).zip(xsum) {
        let (Ok(qs), Ok(xb)) = (
            <&[u8; 16]>::try_from(&b[qs_at..qs_at + 16]),
            <&[f32; 32]>::try_from(xb),
        ) else {
            continue;
        };
        let mut p = [0.0f32; 8];
        for i in 0..2 {
            for l in 0..8 {
                let byte = qs[8 * i + l];
                p[l] += f32::from(byte & 0x0f) * xb[8 * i + l];
                p[l] += f32::from(byte >> 4) * xb[16 + 8 * i + l];
            }
        }
        let d = half(b, 0);
        for l in 0..8 {
            acc[l] += d * p[l];
        }
        offsets += if with_min { half(b, 2) } else { -8.0 * d } * xs;
    }
    lanes_sum(acc) + offsets
}

#[inline(always)]
fn lanes_sum(acc: [f32; 8]) -> f32 {
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// A dot product in 16 lanes (vectorized by the compiler), then a fixed tree.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..16 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut width = 8;
    while width > 0 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    let mut sum = acc[0];
    for (x, y) in ta.iter().zip(tb) {
        sum += x * y;
    }
    sum
}

/// The output's base pointer, shared by the work items (see `gguf_linear`).
struct OutPtr(*mut f32);

impl OutPtr {
    /// A method, not the field: closures then capture the whole (Sync) wrapper.
    fn get(&self) -> *mut f32 {
        self.0
    }
}
// SAFETY: the items behind this pointer write disjoint elements (see
// `gguf_linear`), and the pointer outlives them: `run_items` returns only after
// every item is done.
unsafe impl Sync for OutPtr {}
