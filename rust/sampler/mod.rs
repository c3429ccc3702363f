//! The CPU sampler: one call per step samples every row of a `[rows, vocab]`
//! f32 logits matrix. Pure Rust (no pyo3): `py::sampler` is its binding and
//! `asyncllm.worker.sampler_torch` the torch code whose semantics it keeps.
//!
//! Per row, reading the logits in place (never copying the row):
//! - logit bias (added first), `min_tokens` and bad-word bans (-inf) and
//!   repetition/frequency/presence penalties are a short sorted list of changed
//!   entries (`penalties`), only over the tokens the request biases or has seen;
//! - greedy rows: the argmax (first index of the maximum), one vector pass;
//! - `top_k` set: one pass keeps the candidates >= the k-th largest (ties at the
//!   boundary kept, as in the reference), then temperature, top-p and min-p work
//!   on those few sorted candidates (`top_k`);
//! - otherwise (`sample_full`) after the argmax one pass writes
//!   exp((logit - max) / temperature) to scratch with chunk sums, and the draw
//!   is an inverse CDF with ONE uniform; top-p and min-p by rejection
//!   rounds: a drawn token they keep is a draw from the kept set, exactly, and
//!   membership is one masked sum where a floor would be a selection;
//! - uniforms: Philox4x32-10 keyed by the row's `seed` with counter
//!   (`position`, `stream`) and the rejection round, so a token depends only on
//!   the request's seed, stream and output position, never on the batch.
//!
//! Top-p keeps the largest tokens while the mass of those before them is below
//! `top_p`; tokens tied at the boundary are kept together (the reference keeps
//! them together too). Min-p keeps tokens with probability >= `min_p` × the
//! largest, after top-k and top-p, as the reference does.
//!
//! Logprobs (`num_logprobs >= 0`) are of the RAW logits (before penalties,
//! bans and temperature): the sampled token's logprob and rank (1 + the number
//! of tokens with a strictly larger logit), then the `num_logprobs` largest,
//! lower index first among equal logits.
//!
//! Non-finite logits: NaN is ignored (never sampled, no mass). A row whose
//! largest (changed) logit is +inf or -inf, or that is all NaN, is not sampled
//! at random: it gets its argmax (the first +inf; the first -inf; token 0 if all
//! NaN) and its index is returned in `nonfinite` so the caller can report it.
//! Logprobs of a row whose raw maximum is not finite are NaN (as torch's
//! log_softmax gives), its ranks still count larger logits.

mod check;
mod inputs;
mod penalties;
mod philox;
mod select;
#[cfg(test)]
mod tests;
mod top_k;

use std::sync::{Mutex, PoisonError};

use rayon::prelude::*;

use crate::kernels::team::{self, Team};
use crate::kernels::KernelError;
use select::Arith;
use top_k::TopK;

pub use inputs::{Bias, Masks};
pub use philox::{philox4x32_10, uniform, uniform_round};

/// One row's sampling parameters.
#[derive(Clone, Copy, Debug)]
pub struct RowParams {
    /// An argmax: every field below but the logprobs is ignored.
    pub greedy: bool,
    /// > 0 and finite for a random row.
    pub temperature: f32,
    /// 0 = off; >= vocab is off too.
    pub top_k: u32,
    /// In (0, 1]; 1 = off.
    pub top_p: f32,
    /// In [0, 1]; 0 = off.
    pub min_p: f32,
    /// > 0; 1 = off.
    pub repetition: f32,
    pub frequency: f32,
    pub presence: f32,
    /// Philox key and counter: see `uniform`.
    pub seed: u64,
    pub stream: u64,
    pub position: u64,
    /// -1 = no logprobs, else how many top logprobs besides the sampled one.
    pub num_logprobs: i32,
}

/// Per-row token lists in CSR form: row r's are `tokens[offsets[r]..offsets[r+1]]`.
#[derive(Clone, Copy)]
pub struct TokenLists<'a> {
    pub offsets: &'a [usize],
    pub tokens: &'a [u32],
}

/// Everything one call reads.
pub struct Batch<'a> {
    /// `[rows, vocab]` row-major.
    pub logits: &'a [f32],
    pub vocab: usize,
    pub rows: &'a [RowParams],
    /// The tokens each row has seen (prompt or outputs), each once, and
    /// `seen_counts` (parallel to `seen.tokens`): occurrences among the outputs.
    pub seen: TokenLists<'a>,
    pub seen_counts: &'a [u32],
    /// The tokens each row may not sample now (`min_tokens`, bad words).
    pub banned: TokenLists<'a>,
    /// Additive logit biases (`logit_bias`), applied before the penalties.
    pub bias: Bias<'a>,
    /// The allowed-token bitmasks of the constrained rows (structured output).
    pub masks: Masks<'a>,
}

/// Where one call writes.
pub struct Outputs<'a> {
    /// `[rows]`: the sampled token of each row.
    pub sampled: &'a mut [i64],
    /// `[rows]`: 1 + the number of tokens whose raw logit is larger than the
    /// sampled one's (0 on rows without logprobs).
    pub ranks: &'a mut [i64],
    /// `[rows, width]`: the sampled token, then the top `num_logprobs`; padded
    /// with id -1 and NaN. `width` may be 0 when no row wants logprobs.
    pub logprob_ids: &'a mut [i64],
    pub logprob_values: &'a mut [f32],
    pub width: usize,
}

/// Samples every row; returns the rows with non-finite logits (see the module
/// docs). Checks every argument before writing anything. `num_threads` (at
/// least 1) threads share the rows (see `kernels::team` for which threads).
pub fn sample(
    batch: &Batch<'_>,
    out: Outputs<'_>,
    num_threads: usize,
) -> Result<Vec<usize>, KernelError> {
    check::check(batch, &out, num_threads)?;
    let n = batch.rows.len();
    let width = out.width;
    let mut items: Vec<RowOut<'_>> = Vec::with_capacity(n);
    let mut ids = out.logprob_ids.chunks_mut(width.max(1));
    let mut vals = out.logprob_values.chunks_mut(width.max(1));
    for (r, (s, k)) in out.sampled.iter_mut().zip(out.ranks.iter_mut()).enumerate() {
        let (i, v): (&mut [i64], &mut [f32]) = if width == 0 {
            (&mut [], &mut [])
        } else {
            (
                ids.next().unwrap_or_default(),
                vals.next().unwrap_or_default(),
            )
        };
        items.push(RowOut {
            row: r,
            sampled: s,
            rank: k,
            ids: i,
            values: v,
            nonfinite: false,
        });
    }
    let isa = Isa::detect();
    let new_scratch = || Scratch::new(batch.vocab);
    if num_threads == 1 || n <= 1 {
        let mut scratch = new_scratch();
        for item in items.iter_mut() {
            isa.row(batch, item, &mut scratch);
        }
    } else {
        match Team::get(num_threads)? {
            #[cfg(target_os = "linux")]
            Team::Omp(parallel) => {
                let queue = Mutex::new(items.iter_mut());
                team::run_on_omp(parallel, num_threads, &|| {
                    let mut scratch = new_scratch();
                    loop {
                        // Only `next` runs under the lock and it cannot panic.
                        let next = queue.lock().unwrap_or_else(PoisonError::into_inner).next();
                        let Some(item) = next else { break };
                        isa.row(batch, item, &mut scratch);
                    }
                })?;
            }
            Team::Rayon => team::pool(num_threads)?.install(|| {
                items
                    .par_iter_mut()
                    .for_each_init(new_scratch, |scratch, item| isa.row(batch, item, scratch))
            }),
        }
    }
    Ok(items
        .iter()
        .filter(|i| i.nonfinite)
        .map(|i| i.row)
        .collect())
}

/// One row's slice of the outputs.
struct RowOut<'a> {
    row: usize,
    sampled: &'a mut i64,
    rank: &'a mut i64,
    ids: &'a mut [i64],
    values: &'a mut [f32],
    nonfinite: bool,
}

/// A thread's working memory, sized for one row.
struct Scratch {
    e: Vec<f32>,
    e2: Vec<f32>,
    sums: Vec<f32>,
    /// A constrained row with its disallowed tokens at -inf.
    masked: Vec<f32>,
    ov: Vec<(u32, f32)>,
    cands: Vec<(f32, u32)>,
}

impl Scratch {
    fn new(vocab: usize) -> Self {
        Scratch {
            e: Vec::new(),
            e2: Vec::new(),
            sums: vec![0.0; vocab.div_ceil(select::CHUNK)],
            masked: Vec::new(),
            ov: Vec::new(),
            cands: Vec::new(),
        }
    }
}

/// The instruction sets the row function is compiled for.
#[derive(Clone, Copy)]
enum Isa {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
}

impl Isa {
    fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return Isa::Avx2Fma;
        }
        Isa::Portable
    }

    fn row(self, b: &Batch<'_>, o: &mut RowOut<'_>, s: &mut Scratch) {
        match self {
            Isa::Portable => row::<PortableArith>(b, o, s),
            // SAFETY: `Avx2Fma` is only constructed where the CPU has AVX2 and
            // FMA (`detect`).
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => unsafe { row_avx2_fma(b, o, s) },
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn row_avx2_fma(b: &Batch<'_>, o: &mut RowOut<'_>, s: &mut Scratch) {
    row::<select::Fused>(b, o, s)
}

/// aarch64 always has FMA; elsewhere the portable instance may not.
#[cfg(target_arch = "aarch64")]
type PortableArith = select::Fused;
#[cfg(not(target_arch = "aarch64"))]
type PortableArith = select::Split;

#[inline(always)]
fn row<A: Arith>(b: &Batch<'_>, o: &mut RowOut<'_>, s: &mut Scratch) {
    let r = o.row;
    let p = &b.rows[r];
    let v = b.vocab;
    let raw = &b.logits[r * v..(r + 1) * v];
    let mut masked = std::mem::take(&mut s.masked);
    let logits = match b.masks.of(r) {
        Some(bits) => {
            select::mask_into(raw, bits, &mut masked);
            &masked[..]
        }
        None => raw,
    };
    let (s0, s1) = (b.seen.offsets[r], b.seen.offsets[r + 1]);
    let (b0, b1) = (b.banned.offsets[r], b.banned.offsets[r + 1]);
    penalties::overrides(
        logits,
        p,
        &b.seen.tokens[s0..s1],
        &b.seen_counts[s0..s1],
        &b.banned.tokens[b0..b1],
        b.bias.of(r),
        &mut s.ov,
    );
    let (token, nonfinite) = if p.greedy {
        let (i, m) = argmax(logits, &s.ov);
        (i, !m.is_finite())
    } else if p.top_k > 0 && (p.top_k as usize) < v {
        sample_top_k(logits, p, s)
    } else {
        sample_full::<A>(logits, p, s)
    };
    *o.sampled = token as i64;
    o.nonfinite = nonfinite;
    if p.num_logprobs >= 0 {
        logprobs::<A>(logits, token, p.num_logprobs as usize, o, s);
    } else {
        *o.rank = 0;
    }
    s.masked = masked;
}

/// The first index of the largest changed logit (NaN ignored) and that logit;
/// a row with nothing above -inf gets its first -inf, or (0, NaN) if all NaN.
#[inline(always)]
fn argmax(row: &[f32], ov: &[(u32, f32)]) -> (usize, f32) {
    if ov.is_empty() {
        // no closure: closures are not always inlined, and outside the row
        // function's `#[target_feature]` they lose its instruction set
        return select::argmax(row).unwrap_or_else(|| no_maximum(row, ov));
    }
    let mut best: Option<(usize, f32)> = None;
    penalties::segments(row, ov, |start, xs| {
        if let Some((i, m)) = select::argmax(xs) {
            if best.is_none_or(|b| m > b.1) {
                best = Some((start + i, m));
            }
        }
    });
    best.unwrap_or_else(|| no_maximum(row, ov))
}

#[cold]
fn no_maximum(row: &[f32], ov: &[(u32, f32)]) -> (usize, f32) {
    let mut first = None;
    penalties::segments(row, ov, |start, xs| {
        if first.is_none() {
            first = xs
                .iter()
                .position(|&x| x == f32::NEG_INFINITY)
                .map(|i| start + i);
        }
    });
    first.map_or((0, f32::NAN), |i| (i, f32::NEG_INFINITY))
}

/// The draw of a row with `top_k` in 1..vocab: among the candidates only.
#[inline(always)]
fn sample_top_k(row: &[f32], p: &RowParams, s: &mut Scratch) -> (usize, bool) {
    let mut sel = TopK::new(p.top_k as usize, std::mem::take(&mut s.cands));
    if s.ov.is_empty() {
        sel.push_all(row, &mut s.e2, &mut s.e);
    } else {
        penalties::segments(row, &s.ov, |start, xs| sel.push(start, xs));
    }
    let cands = sel.finish();
    let result = draw_sorted(&cands, p);
    s.cands = cands;
    result
}

/// Temperature, top-p, min-p and the draw over candidates sorted largest first.
fn draw_sorted(cands: &[(f32, u32)], p: &RowParams) -> (usize, bool) {
    let Some(&(m, first)) = cands.first() else {
        return (0, true); // all NaN
    };
    if !m.is_finite() {
        return (first as usize, true);
    }
    let inv_t = 1.0 / f64::from(p.temperature);
    let e = |x: f32| ((f64::from(x) - f64::from(m)) * inv_t).exp();
    let total: f64 = cands.iter().map(|c| e(c.0)).sum();
    // top-p: keep while the mass before is below top_p (ties kept together)
    let mut kept = cands.len();
    if p.top_p < 1.0 {
        let limit = f64::from(p.top_p) * total;
        let mut before = 0.0;
        for (i, c) in cands.iter().enumerate() {
            if before >= limit && c.0 != cands[i - 1].0 {
                kept = i;
                break;
            }
            before += e(c.0);
        }
    }
    // min-p: probability >= min_p × the largest's, whose exponential is 1
    if p.min_p > 0.0 {
        let floor = f64::from(p.min_p);
        kept = cands[..kept]
            .iter()
            .take_while(|c| e(c.0) >= floor)
            .count()
            .max(1);
    }
    let kept = &cands[..kept];
    let mass: f64 = kept.iter().map(|c| e(c.0)).sum();
    let target = uniform(p.seed, p.stream, p.position) * mass;
    let mut acc = 0.0;
    for c in kept {
        acc += e(c.0);
        if acc > target {
            return (c.1 as usize, false);
        }
    }
    (kept[kept.len() - 1].1 as usize, false)
}

/// Rejection rounds of `sample_full` before it computes the top-p floor.
const ROUNDS: u32 = 4;

/// The draw of a row without top-k: the argmax, then the exponentials of the
/// whole row in scratch with `CHUNK`-entry sums so that the inverse CDF skips
/// whole chunks (the row is read from memory once, then from cache).
///
/// Top-p and min-p by rejection: a token drawn from the whole distribution and
/// kept by them is a draw from the kept set's renormalised distribution, and it
/// is kept with probability >= top_p. Membership costs one masked sum (the mass
/// strictly above the token's: below top_p × total means kept; tokens tied at
/// the boundary are kept together) where the floor would cost a selection. After
/// `ROUNDS` rejections (a tiny top_p) the floor is computed and the next round's
/// uniform draws from the kept set directly. Every round's uniform is a pure
/// function of (seed, stream, position, round), so the token still is too.
#[inline(always)]
fn sample_full<A: Arith>(row: &[f32], p: &RowParams, s: &mut Scratch) -> (usize, bool) {
    let (first, m) = argmax(row, &s.ov);
    if !m.is_finite() {
        return (first, true);
    }
    let inv_t = 1.0 / p.temperature;
    s.e.resize(row.len(), 0.0);
    let e = &mut s.e;
    let total = if s.ov.is_empty() {
        select::exp_sums::<A>(row, m, inv_t, e, &mut s.sums)
    } else {
        penalties::segments(row, &s.ov, |start, xs| {
            select::exp_into::<A>(xs, m, inv_t, &mut e[start..start + xs.len()]);
        });
        select::chunk_sums(e, 0.0, &mut s.sums)
    };
    let e = &s.e;
    let limit = f64::from(p.top_p) * total;
    for round in 0..ROUNDS {
        let t = draw(e, &s.sums, 0.0, total, p, round, first);
        // (no closures here: see `argmax`)
        if e[t] >= p.min_p && (p.top_p >= 1.0 || select::mass_above(e, e[t]) < limit) {
            return (t, false);
        }
    }
    let mut floor = p.min_p;
    if p.top_p < 1.0 {
        floor = floor.max(select::top_p_floor(e, limit, &mut s.e2));
    }
    let mass = select::chunk_sums(e, floor, &mut s.sums);
    (draw(e, &s.sums, floor, mass, p, ROUNDS, first), false)
}

/// The inverse-CDF draw of round `round` over the entries >= `floor`.
#[inline(always)]
fn draw(
    e: &[f32],
    sums: &[f32],
    floor: f32,
    mass: f64,
    p: &RowParams,
    round: u32,
    first: usize,
) -> usize {
    let target = philox::uniform_round(p.seed, p.stream, p.position, round) * mass;
    // `None` is unreachable: the maximum has exponential 1 >= any floor
    select::inverse_cdf(e, sums, floor, target).unwrap_or(first)
}

/// The raw logits' logprobs of `token` and of the row's top `num`.
#[inline(always)]
fn logprobs<A: Arith>(row: &[f32], token: usize, num: usize, o: &mut RowOut<'_>, s: &mut Scratch) {
    let m = select::max(row);
    let lse = if m.is_finite() {
        f64::from(m) + select::sum_exp::<A>(row, m).ln()
    } else {
        f64::NAN
    };
    let lp = |x: f32| (f64::from(x) - lse) as f32;
    *o.rank = 1 + select::count_greater(row, row[token]) as i64;
    o.ids.fill(-1);
    o.values.fill(f32::NAN);
    o.ids[0] = token as i64;
    o.values[0] = lp(row[token]);
    if num > 0 {
        let mut sel = TopK::new(num, std::mem::take(&mut s.cands));
        sel.push(0, row);
        let top = sel.finish();
        for (j, c) in top.iter().take(num).enumerate() {
            o.ids[1 + j] = i64::from(c.1);
            o.values[1 + j] = lp(c.0);
        }
        s.cands = top;
    }
}
