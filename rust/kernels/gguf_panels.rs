//! The panel layout of GGUF blocks: what the integer kernel (`gguf_int`) reads
//! with plain vector loads instead of transposing 16 rows' bytes every block.
//!
//! The kernel puts 16 weight rows in the lanes of a vector, so each block of the
//! GGUF layout (row after row) costs a 16 × 16-byte transpose per 16 bytes it
//! reads (16 loads, 12 inserts, 8 unpacks), and another for a 2-byte scale: at
//! one activation row that was most of the call (in cache, one thread, 2048 ×
//! 2048: the kernel ran 1.6-2.1× faster with the transposes removed). llama.cpp
//! repacks its weights at load for the same reason. The layout keeps the bytes
//! (the same size: no second copy), so a layer repacks its blocks in place once.
//!
//! Rows `16p..16p + 16` (one panel, `16 · row_bytes` bytes, where the rows were)
//! hold, for each block `b` of the row in turn, `16 · BYTES` bytes:
//! - the block's body (its bytes without a 2-byte f16 scale `d` at its start,
//!   Q4_0 / Q5_0 / Q8_0, or end, Q6_K) as 4-byte words, word `t` of lane
//!   (row) `l` at `64t + 4l`: 16 lanes of word `t` are one 512-bit load;
//! - then, for those four types, the 16 lanes' `d` (2 bytes each): one 256-bit
//!   load that converts to 16 floats.
//!
//! The rows past the last whole panel (`rows % 16`) stay as they are. Every body
//! is whole words (16, 20, 24, 32, 144, 176, 208 bytes). Float types (F32, F16,
//! BF16) have no panel layout.

use super::gguf::GgufType;
use super::KernelError;

/// Weight rows in a panel.
pub const PANEL: usize = 16;

/// Where a block type keeps a separate 2-byte `d` the layout moves out of the
/// body, if it does: at the start (true) or the end (false).
pub(super) fn lone_d(t: GgufType) -> Option<bool> {
    match t {
        GgufType::Q4_0 | GgufType::Q5_0 | GgufType::Q8_0 => Some(true),
        GgufType::Q6K => Some(false),
        _ => None,
    }
}

/// A block type's layout: (block bytes, body offset in the GGUF block, body bytes,
/// `d` offset in the GGUF block if it has a lone `d`).
fn shape(t: GgufType) -> Result<(usize, usize, usize, Option<usize>), KernelError> {
    if matches!(t, GgufType::F32 | GgufType::F16 | GgufType::Bf16) {
        return Err(KernelError::Shape(format!(
            "{t:?} is not a block type: it has no panel layout"
        )));
    }
    let bytes = t.block().1;
    Ok(match lone_d(t) {
        Some(true) => (bytes, 2, bytes - 2, Some(0)),
        Some(false) => (bytes, 0, bytes - 2, Some(bytes - 2)),
        None => (bytes, 0, bytes, None),
    })
}

/// Rows of `row_bytes` in `w`, after checking `w` is whole rows of `k`.
fn rows_of(t: GgufType, k: usize, len: usize) -> Result<(usize, usize), KernelError> {
    let rb = t.row_bytes(k)?;
    if k == 0 || !len.is_multiple_of(rb) {
        return Err(KernelError::Shape(format!(
            "{t:?}: {len} bytes are not whole rows of {rb} bytes ({k} elements)"
        )));
    }
    Ok((len / rb, rb))
}

/// The byte of lane `lane`'s `d` relative to the panel-block's start, for a body
/// of `body` bytes (word `t` of the lane is at `64t + 4 lane`).
#[inline(always)]
fn d_at(body: usize, lane: usize) -> usize {
    PANEL * body + 2 * lane
}

/// `w` (rows of `k` elements of `t`, in the GGUF layout) into the panel layout,
/// in place.
pub fn pack(t: GgufType, k: usize, w: &mut [u8]) -> Result<(), KernelError> {
    let (n, rb) = rows_of(t, k, w.len())?;
    let (bytes, skip, body, d) = shape(t)?;
    let mut plain = vec![0u8; PANEL * rb];
    for panel in w.chunks_exact_mut(PANEL * rb).take(n / PANEL) {
        plain.copy_from_slice(panel);
        for (b, dst) in panel.chunks_exact_mut(PANEL * bytes).enumerate() {
            for lane in 0..PANEL {
                let block = &plain[lane * rb + b * bytes..][..bytes];
                let words = dst
                    .chunks_exact_mut(64)
                    .zip(block[skip..skip + body].chunks_exact(4));
                for (line, src) in words {
                    line[4 * lane..4 * lane + 4].copy_from_slice(src);
                }
                if let Some(d) = d {
                    dst[d_at(body, lane)..][..2].copy_from_slice(&block[d..d + 2]);
                }
            }
        }
    }
    Ok(())
}

/// Row `r` of `w` (in the panel layout) in the GGUF layout, into `out`
/// (`row_bytes` bytes).
fn row(t: GgufType, rb: usize, n: usize, w: &[u8], r: usize, out: &mut [u8]) {
    if r >= n / PANEL * PANEL {
        out.copy_from_slice(&w[r * rb..(r + 1) * rb]);
        return;
    }
    let panel = &w[r / PANEL * PANEL * rb..(r / PANEL + 1) * PANEL * rb];
    lane_row(t, panel, r % PANEL, out);
}

/// Lane `lane` of a whole panel in the GGUF layout, into `out` (one row).
fn lane_row(t: GgufType, panel: &[u8], lane: usize, out: &mut [u8]) {
    let Ok((bytes, skip, body, d)) = shape(t) else {
        return;
    };
    for (src, block) in panel
        .chunks_exact(PANEL * bytes)
        .zip(out.chunks_exact_mut(bytes))
    {
        // word t of the lane is bytes 4 lane.. of the panel-block's 64-byte line t
        let words = src
            .chunks_exact(64)
            .zip(block[skip..skip + body].chunks_exact_mut(4));
        for (line, dst) in words {
            dst.copy_from_slice(&line[4 * lane..4 * lane + 4]);
        }
        if let Some(d) = d {
            block[d..d + 2].copy_from_slice(&src[d_at(body, lane)..][..2]);
        }
    }
}

/// A whole panel's 16 rows in the GGUF layout, into `out` (as many bytes).
pub(super) fn unpack_panel(t: GgufType, panel: &[u8], out: &mut [u8]) {
    for (lane, dst) in out.chunks_exact_mut(panel.len() / PANEL).enumerate() {
        lane_row(t, panel, lane, dst);
    }
}

/// Rows of `w` (rows of `k` elements of `t` in the panel layout) dequantized into
/// `out` (`[rows, k]`), equal to `gguf::dequantize` of the GGUF layout: each panel
/// is unpacked into a cache-resident buffer first, so the weight is read once.
pub fn dequantize(t: GgufType, k: usize, w: &[u8], out: &mut [f32]) -> Result<(), KernelError> {
    let (n, rb) = rows_of(t, k, w.len())?;
    shape(t)?;
    if out.len() != n * k {
        return Err(KernelError::Shape(format!(
            "dequantize {t:?}: {n} rows of {k} need {} elements, out has {}",
            n * k,
            out.len()
        )));
    }
    let whole = n / PANEL * PANEL;
    let mut plain = vec![0u8; PANEL * rb];
    let panels = w[..whole * rb].chunks_exact(PANEL * rb);
    for (panel, o) in panels.zip(out.chunks_exact_mut(PANEL * k)) {
        unpack_panel(t, panel, &mut plain);
        super::gguf::dequantize(t, k, &plain, o)?;
    }
    super::gguf::dequantize(t, k, &w[whole * rb..], &mut out[whole * k..])
}

/// Rows `ids` of `w` (rows of `k` elements of `t` in the panel layout) in the
/// GGUF layout, one after another into `out`: what the float paths and the
/// embedding's lookups read.
pub fn unpack_rows(
    t: GgufType,
    k: usize,
    w: &[u8],
    ids: &[usize],
    out: &mut [u8],
) -> Result<(), KernelError> {
    let (n, rb) = rows_of(t, k, w.len())?;
    shape(t)?;
    if out.len() != ids.len() * rb {
        return Err(KernelError::Shape(format!(
            "unpack_rows {t:?}: out has {} bytes, {} rows need {}",
            out.len(),
            ids.len(),
            ids.len() * rb
        )));
    }
    if let Some(bad) = ids.iter().find(|&&r| r >= n) {
        return Err(KernelError::Shape(format!(
            "unpack_rows {t:?}: row {bad} is past the {n} rows"
        )));
    }
    for (&r, dst) in ids.iter().zip(out.chunks_exact_mut(rb)) {
        row(t, rb, n, w, r, dst);
    }
    Ok(())
}
