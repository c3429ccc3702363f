//! The machine's own limits, for the roofline benchmark: the peak rate of the
//! CPU's fused multiply-add units and the memory read bandwidth, each on a team
//! of threads. A bound is what this machine does, never one library call's rate.
//!
//! The FMA loop is the linear kernel's vector operations (`linear::simd`) with
//! enough independent accumulators to hide the FMA latency (12 chains: two FMA
//! ports of 4-5 cycles' latency need 8-10), on the best ISA variant there is.

use std::time::Instant;

use super::linear::simd::{self, Simd};
use super::linear::LinearIsa;
use super::team::{self, Team};
use super::KernelError;

const CHAINS: usize = 12;

/// Float operations per second (2 per fused multiply-add) of `num_threads`
/// threads each running `iters` rounds of `CHAINS` independent vector FMAs.
pub fn fma_peak(num_threads: usize, iters: usize) -> Result<(f64, &'static str), KernelError> {
    let isa = LinearIsa::detect()?;
    let lanes = match isa {
        LinearIsa::Portable => simd::Portable::LANES,
        #[cfg(target_arch = "x86_64")]
        LinearIsa::Avx2 => simd::Avx2::LANES,
        #[cfg(target_arch = "x86_64")]
        LinearIsa::Avx512 | LinearIsa::Avx512Bf16 => simd::Avx512::LANES,
    };
    let body = || {
        let sink = match isa {
            LinearIsa::Portable => fma_loop::<simd::Portable>(iters),
            // SAFETY: `Avx2` is detected only where the CPU has AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            LinearIsa::Avx2 => unsafe { fma_loop_avx2(iters) },
            // SAFETY: `Avx512` is detected only where the CPU has AVX512F.
            #[cfg(target_arch = "x86_64")]
            LinearIsa::Avx512 | LinearIsa::Avx512Bf16 => unsafe { fma_loop_avx512(iters) },
        };
        std::hint::black_box(sink);
    };
    let start = Instant::now();
    on_team(num_threads, &body)?;
    let secs = start.elapsed().as_secs_f64();
    let flops = 2.0 * (CHAINS * lanes * iters * num_threads) as f64;
    Ok((flops / secs, isa.name()))
}

/// Bytes per second of `num_threads` threads summing disjoint parts of `data`
/// (a buffer far larger than the caches, so the reads come from memory).
pub fn read_bandwidth(data: &[f32], num_threads: usize) -> Result<f64, KernelError> {
    let isa = LinearIsa::detect()?;
    let part = data.len().div_ceil(num_threads.max(1));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let body = || {
        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let chunk = data.chunks(part).nth(i).unwrap_or(&[]);
        let sum = match isa {
            LinearIsa::Portable => sum_loop::<simd::Portable>(chunk),
            // SAFETY: `Avx2` is detected only where the CPU has AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            LinearIsa::Avx2 => unsafe { sum_avx2(chunk) },
            // SAFETY: `Avx512` is detected only where the CPU has AVX512F.
            #[cfg(target_arch = "x86_64")]
            LinearIsa::Avx512 | LinearIsa::Avx512Bf16 => unsafe { sum_avx512(chunk) },
        };
        std::hint::black_box(sum);
    };
    let start = Instant::now();
    on_team(num_threads, &body)?;
    Ok(std::mem::size_of_val(data) as f64 / start.elapsed().as_secs_f64())
}

/// `body` once on each of `num_threads` threads (the caller among them).
fn on_team<F: Fn() + Sync>(num_threads: usize, body: &F) -> Result<(), KernelError> {
    if num_threads <= 1 {
        body();
        return Ok(());
    }
    match Team::get(num_threads)? {
        #[cfg(target_os = "linux")]
        Team::Omp(parallel) => team::run_on_omp(parallel, num_threads, body),
        Team::Rayon => {
            team::pool(num_threads)?.broadcast(|_| body());
            Ok(())
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn fma_loop_avx2(iters: usize) -> f32 {
    fma_loop::<simd::Avx2>(iters)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f")]
fn fma_loop_avx512(iters: usize) -> f32 {
    fma_loop::<simd::Avx512>(iters)
}

#[inline(always)]
fn fma_loop<S: Simd>(iters: usize) -> f32 {
    let seed = [1.0f32; 16];
    // SAFETY: `seed` holds 16 floats, at least `S::LANES`; the intrinsics are
    // those of the ISA the caller was compiled for (see `fma_peak`).
    unsafe {
        // Opaque operands: the chains cannot be folded away at compile time.
        let a = std::hint::black_box(S::load(seed.as_ptr()));
        let b = std::hint::black_box(S::load(seed.as_ptr()));
        let mut acc = [S::zero(); CHAINS];
        for _ in 0..iters {
            for c in acc.iter_mut() {
                *c = S::fma(*c, a, b);
            }
        }
        let mut v = S::zero();
        for c in acc {
            v = S::add(v, c);
        }
        S::sum(v)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn sum_avx2(data: &[f32]) -> f32 {
    sum_loop::<simd::Avx2>(data)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f")]
fn sum_avx512(data: &[f32]) -> f32 {
    sum_loop::<simd::Avx512>(data)
}

/// The sum of `data`'s whole vectors, on 8 accumulators: the loads, not the
/// latency of the adds, limit it.
#[inline(always)]
fn sum_loop<S: Simd>(data: &[f32]) -> f32 {
    let l = S::LANES;
    let p = data.as_ptr();
    // SAFETY: each load reads `S::LANES` floats at `o + a * l`, with
    // `o + 8 * l <= data.len()`; the intrinsics are those of the ISA the caller
    // was compiled for (see `read_bandwidth`).
    unsafe {
        let mut acc = [S::zero(); 8];
        let mut o = 0;
        while o + 8 * l <= data.len() {
            for (a, acc) in acc.iter_mut().enumerate() {
                *acc = S::add(*acc, S::load(p.add(o + a * l)));
            }
            o += 8 * l;
        }
        let mut v = S::zero();
        for a in acc {
            v = S::add(v, a);
        }
        S::sum(v)
    }
}
