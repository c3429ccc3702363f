//! GGUF weight blocks (llama.cpp's formats) and their exact dequantization;
//! `gguf_linear` computes on them.
//!
//! `decode_row` performs, per element, the float operations of gguf-py's numpy
//! reference in the same order (a product, then a sum or difference; Rust never
//! fuses them into an FMA), so its output equals `gguf.quants.dequantize` bit for
//! bit (Python tests check every type).

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
pub(super) fn half(b: &[u8], at: usize) -> f32 {
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
pub(super) fn scale_min_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
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
