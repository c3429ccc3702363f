//! GGUF weight blocks (llama.cpp's formats): dequantization, and a linear layer
//! that computes on the blocks for the few rows of a decode step.
//!
//! **Exact dequantization.** `decode_row` performs, per element, the float
//! operations of gguf-py's numpy reference in the same order (a product, then a
//! sum or difference; Rust never fuses them into an FMA), so its output equals
//! `gguf.quants.dequantize` bit for bit (Python tests check every type).
//!
//! **The linear kernel** decodes one weight row at a time into a buffer that stays
//! in L1 and takes its dot product with each row of `x`: the weight is read once
//! per step, as blocks (4.5-8.5 bits a weight instead of 32), and the float weight
//! never exists in memory. Work items are ranges of output features, shared out
//! over the team of `team::Team`.

use std::sync::{Mutex, PoisonError};

use rayon::prelude::*;

use super::team::{self, Team};
use super::KernelError;

/// A block format: elements per block and bytes per block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufType {
    F32,
    F16,
    Bf16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
}

const QK_K: usize = 256;

impl GgufType {
    /// The type of a ggml type name (`"Q4_K"`), or an error naming it.
    pub fn from_name(name: &str) -> Result<GgufType, KernelError> {
        Ok(match name {
            "F32" => GgufType::F32,
            "F16" => GgufType::F16,
            "BF16" => GgufType::Bf16,
            "Q4_0" => GgufType::Q4_0,
            "Q4_1" => GgufType::Q4_1,
            "Q5_0" => GgufType::Q5_0,
            "Q5_1" => GgufType::Q5_1,
            "Q8_0" => GgufType::Q8_0,
            "Q4_K" => GgufType::Q4K,
            "Q5_K" => GgufType::Q5K,
            "Q6_K" => GgufType::Q6K,
            other => return Err(KernelError::Shape(format!("unknown GGUF type {other:?}"))),
        })
    }

    /// (elements, bytes) of one block.
    pub fn block(self) -> (usize, usize) {
        match self {
            GgufType::F32 => (1, 4),
            GgufType::F16 | GgufType::Bf16 => (1, 2),
            GgufType::Q4_0 => (32, 18),
            GgufType::Q4_1 => (32, 20),
            GgufType::Q5_0 => (32, 22),
            GgufType::Q5_1 => (32, 24),
            GgufType::Q8_0 => (32, 34),
            GgufType::Q4K => (QK_K, 144),
            GgufType::Q5K => (QK_K, 176),
            GgufType::Q6K => (QK_K, 210),
        }
    }

    /// Bytes of a row of `k` elements, or an error when `k` is not whole blocks.
    pub fn row_bytes(self, k: usize) -> Result<usize, KernelError> {
        let (elems, bytes) = self.block();
        if !k.is_multiple_of(elems) {
            return Err(KernelError::Shape(format!(
                "{self:?}: a row of {k} elements is not whole blocks of {elems}"
            )));
        }
        Ok(k / elems * bytes)
    }
}

/// IEEE half to single precision, exactly (subnormals, infinities, NaN payloads).
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match exp {
        0 if man == 0 => sign,
        0 => {
            // man * 2^-24, exact in f32
            let v = man as f32 * (1.0 / 16_777_216.0);
            return if sign != 0 { -v } else { v };
        }
        31 => sign | 0x7f80_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

#[inline(always)]
fn half(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// One row: `raw` (whole blocks of `t`) decoded into `out` (its elements).
#[inline(always)]
pub fn decode_row(t: GgufType, raw: &[u8], out: &mut [f32]) {
    match t {
        GgufType::F32 => {
            for (o, c) in out.iter_mut().zip(raw.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgufType::F16 => {
            for (o, c) in out.iter_mut().zip(raw.chunks_exact(2)) {
                *o = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        GgufType::Bf16 => {
            for (o, c) in out.iter_mut().zip(raw.chunks_exact(2)) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
            }
        }
        GgufType::Q4_0 => blocks(raw, out, q4_0),
        GgufType::Q4_1 => blocks(raw, out, q4_1),
        GgufType::Q5_0 => blocks(raw, out, q5_0),
        GgufType::Q5_1 => blocks(raw, out, q5_1),
        GgufType::Q8_0 => blocks(raw, out, q8_0),
        GgufType::Q4K => blocks(raw, out, |b: &[u8; 144], o| decode_k4(b, None, o)),
        GgufType::Q5K => blocks(raw, out, q5_k),
        GgufType::Q6K => blocks(raw, out, decode_q6k),
    }
}

/// `decode` over every block of a row, on fixed-size arrays: constant bounds let
/// the compiler drop the bounds checks and vectorize the element loops.
#[inline(always)]
fn blocks<const B: usize, const E: usize>(
    raw: &[u8],
    out: &mut [f32],
    decode: impl Fn(&[u8; B], &mut [f32; E]),
) {
    for (o, b) in out.chunks_exact_mut(E).zip(raw.chunks_exact(B)) {
        if let (Ok(b), Ok(o)) = (b.try_into(), o.try_into()) {
            decode(b, o);
        }
    }
}

#[inline(always)]
fn q4_0(b: &[u8; 18], o: &mut [f32; 32]) {
    let d = half(b, 0);
    for j in 0..16 {
        o[j] = d * f32::from((b[2 + j] & 0x0f) as i8 - 8);
        o[j + 16] = d * f32::from((b[2 + j] >> 4) as i8 - 8);
    }
}

#[inline(always)]
fn q4_1(b: &[u8; 20], o: &mut [f32; 32]) {
    let (d, m) = (half(b, 0), half(b, 2));
    for j in 0..16 {
        o[j] = d * f32::from(b[4 + j] & 0x0f) + m;
        o[j + 16] = d * f32::from(b[4 + j] >> 4) + m;
    }
}

#[inline(always)]
fn q5_0(b: &[u8; 22], o: &mut [f32; 32]) {
    let d = half(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for j in 0..16 {
        let lo = (b[6 + j] & 0x0f) | ((((qh >> j) & 1) as u8) << 4);
        let hi = (b[6 + j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
        o[j] = d * f32::from(lo as i8 - 16);
        o[j + 16] = d * f32::from(hi as i8 - 16);
    }
}

#[inline(always)]
fn q5_1(b: &[u8; 24], o: &mut [f32; 32]) {
    let (d, m) = (half(b, 0), half(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for j in 0..16 {
        let lo = (b[8 + j] & 0x0f) | ((((qh >> j) & 1) as u8) << 4);
        let hi = (b[8 + j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
        o[j] = d * f32::from(lo) + m;
        o[j + 16] = d * f32::from(hi) + m;
    }
}

#[inline(always)]
fn q8_0(b: &[u8; 34], o: &mut [f32; 32]) {
    let d = half(b, 0);
    for j in 0..32 {
        o[j] = f32::from(b[2 + j] as i8) * d;
    }
}

#[inline(always)]
fn q5_k(b: &[u8; 176], o: &mut [f32; QK_K]) {
    decode_k4(b, Some(&b[16..48]), o)
}

/// The eight 6-bit scales and mins packed in 12 bytes (Q4_K and Q5_K).
#[inline(always)]
fn scale_min_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for i in 0..4 {
        sc[i] = s[i] & 0x3f;
        sc[i + 4] = (s[8 + i] & 0x0f) | ((s[i] >> 2) & 0x30);
        mn[i] = s[4 + i] & 0x3f;
        mn[i + 4] = (s[8 + i] >> 4) | ((s[4 + i] >> 2) & 0x30);
    }
    (sc, mn)
}

/// Q4_K (`qh` None) and Q5_K (`qh`: the fifth bits) blocks of 256.
#[inline(always)]
fn decode_k4<const B: usize>(b: &[u8; B], qh: Option<&[u8]>, o: &mut [f32; QK_K]) {
    let (d, dmin) = (half(b, 0), half(b, 2));
    let (sc, mn) = scale_min_k4(&b[4..16]);
    let qs = &b[B - 128..];
    for j in 0..8 {
        let dj = d * f32::from(sc[j]);
        let mj = dmin * f32::from(mn[j]);
        let group = &qs[(j / 2) * 32..(j / 2) * 32 + 32];
        let shift = if j % 2 == 0 { 0 } else { 4 };
        for l in 0..32 {
            let mut q = (group[l] >> shift) & 0x0f;
            if let Some(qh) = qh {
                q |= ((qh[l] >> j) & 1) << 4;
            }
            o[j * 32 + l] = dj * f32::from(q) - mj;
        }
    }
}

#[inline(always)]
fn decode_q6k(b: &[u8; 210], o: &mut [f32; QK_K]) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = half(b, 208);
    for (g, (&scale, og)) in scales.iter().zip(o.chunks_exact_mut(16)).enumerate() {
        let dg = d * f32::from(scale as i8);
        for (i, oe) in og.iter_mut().enumerate() {
            let e = g * 16 + i;
            let (h, r) = (e / 128, e % 128);
            let low = if r < 64 {
                ql[h * 64 + r] & 0x0f
            } else {
                ql[h * 64 + r - 64] >> 4
            };
            let high = (qh[h * 32 + r % 32] >> (2 * (r / 32))) & 0x03;
            *oe = dg * f32::from((low | (high << 4)) as i8 - 32);
        }
    }
}

/// Rows of blocks `raw` ([rows, row_bytes]) dequantized into `out` ([rows, k]).
pub fn dequantize(t: GgufType, k: usize, raw: &[u8], out: &mut [f32]) -> Result<(), KernelError> {
    let rb = t.row_bytes(k)?;
    if k == 0 || !raw.len().is_multiple_of(rb) || out.len() != raw.len() / rb * k {
        return Err(KernelError::Shape(format!(
            "dequantize {t:?}: {} bytes of rows of {rb} bytes do not make {} elements of rows of {k}",
            raw.len(),
            out.len()
        )));
    }
    for (o, r) in out.chunks_exact_mut(k).zip(raw.chunks_exact(rb)) {
        decode_row(t, r, o);
    }
    Ok(())
}

/// Output features per work item.
const ITEM_ROWS: usize = 16;

/// `out[m, n] = x[m, k] · dequantize(w)[n, k]ᵀ` on `num_threads` threads; `w` is
/// `n` rows of blocks of `t`. Every check runs before `out` is written.
pub fn gguf_linear(
    t: GgufType,
    m: usize,
    k: usize,
    x: &[f32],
    w: &[u8],
    num_threads: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
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
        item_rows(
            t,
            k,
            rb,
            x,
            &w[rows.start * rb..rows.end * rb],
            buf,
            |r, j, v| {
                // SAFETY: `out` holds m * n elements (checked above) that only this
                // call writes; (r, rows.start + j) is in bounds and in this item's
                // range of output features alone, so no two threads write it.
                unsafe { out_ptr.get().add(r * n + rows.start + j).write(v) }
            },
        );
    };
    run_items(n.div_ceil(ITEM_ROWS), num_threads, &item)
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
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
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

/// Runs `item(idx, scratch)` for every idx in 0..num_items on the team.
fn run_items<F: Fn(usize, &mut Vec<f32>) + Sync>(
    num_items: usize,
    num_threads: usize,
    item: &F,
) -> Result<(), KernelError> {
    if num_threads == 1 || num_items <= 1 {
        let mut buf = Vec::new();
        (0..num_items).for_each(|i| item(i, &mut buf));
        return Ok(());
    }
    match Team::get(num_threads)? {
        #[cfg(target_os = "linux")]
        Team::Omp(parallel) => {
            let next = Mutex::new(0..num_items);
            team::run_on_omp(parallel, num_threads, &|| {
                let mut buf = Vec::new();
                loop {
                    // Only `next` runs under the lock and it cannot panic.
                    let idx = next.lock().unwrap_or_else(PoisonError::into_inner).next();
                    let Some(idx) = idx else { break };
                    item(idx, &mut buf);
                }
            })?;
        }
        Team::Rayon => team::pool(num_threads)?.install(|| {
            (0..num_items)
                .into_par_iter()
                .for_each_init(Vec::new, |buf, idx| item(idx, buf))
        }),
    }
    Ok(())
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
