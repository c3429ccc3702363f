//! The threads a kernel's work items run on: the OpenMP team of the libgomp the
//! process already has loaded (torch's), or else a rayon pool of the kernel's own.
//!
//! Why not always rayon: torch's OpenMP workers busy-wait for a few milliseconds
//! after each torch op, so a rayon pool of torch's size started right after one
//! puts twice as many runnable threads on the cores. Handing the work to libgomp's
//! `GOMP_parallel` from the thread that runs torch's ops reuses those very workers
//! (libgomp keeps one pool per calling thread), so nothing is oversubscribed.
//!
//! The choice is made once, at the first multi-threaded call: libgomp if a
//! `libgomp*.so*` is mapped into the process (never loaded by us: `RTLD_NOLOAD`),
//! else rayon — as in `cargo bench`, which has no torch.
//! `ASYNCLLM_KERNEL_POOL=rayon` forces rayon (for benchmarks that compare the two);
//! `omp` or unset means the default.
//!
//! Inside a region (`team_region`: one team held for a call that makes many small
//! parallel calls, the fused decode step) `run_items` and `run_queue` fork on the
//! region's waiting threads instead of starting a team.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use rayon::prelude::*;

use super::team_region;
use super::KernelError;

/// Where a multi-threaded call runs.
#[derive(Clone, Copy)]
pub(crate) enum Team {
    /// The OpenMP team of the process's libgomp.
    #[cfg(target_os = "linux")]
    Omp(omp::GompParallel),
    /// A rayon pool of the kernel's own (`pool`).
    Rayon,
}

impl Team {
    /// The team for this process, chosen at the first call and kept;
    /// `num_threads` only words the error of a bad `ASYNCLLM_KERNEL_POOL`.
    pub(crate) fn get(num_threads: usize) -> Result<Team, KernelError> {
        static TEAM: OnceLock<Result<Team, String>> = OnceLock::new();
        TEAM.get_or_init(choose)
            .clone()
            .map_err(|msg| KernelError::Threads(num_threads, msg))
    }
}

/// Calls `body` once on each thread of an OpenMP team of `num_threads` (the
/// calling thread among them) and returns when all are done; `body` shares out
/// the work itself. A panic in `body` is resumed on the calling thread.
#[cfg(target_os = "linux")]
pub(crate) fn run_on_omp<F: Fn() + Sync>(
    parallel: omp::GompParallel,
    num_threads: usize,
    body: &F,
) -> Result<(), KernelError> {
    omp::run(parallel, num_threads, body)
}

fn choose() -> Result<Team, String> {
    match std::env::var("ASYNCLLM_KERNEL_POOL").as_deref() {
        Ok("rayon") => return Ok(Team::Rayon),
        Ok("omp") | Err(std::env::VarError::NotPresent) => {}
        Ok(other) => {
            return Err(format!(
                "ASYNCLLM_KERNEL_POOL must be \"omp\" or \"rayon\", got {other:?}"
            ))
        }
        Err(e) => return Err(format!("ASYNCLLM_KERNEL_POOL: {e}")),
    }
    #[cfg(target_os = "linux")]
    if let Some(parallel) = omp::find() {
        return Ok(Team::Omp(parallel));
    }
    Ok(Team::Rayon)
}

/// A rayon pool of `num_threads` threads, built on first use and kept.
pub(crate) fn pool(num_threads: usize) -> Result<Arc<rayon::ThreadPool>, KernelError> {
    static POOLS: Mutex<Vec<(usize, Arc<rayon::ThreadPool>)>> = Mutex::new(Vec::new());
    // The list is only ever pushed to whole, so a panic elsewhere cannot leave it
    // inconsistent: a poisoned lock is safe to use.
    let mut pools = POOLS.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((_, pool)) = pools.iter().find(|(n, _)| *n == num_threads) {
        return Ok(Arc::clone(pool));
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(num_threads)
        .thread_name(|i| format!("asyncllm-attn-{i}"))
        .build()
        .map_err(|e| KernelError::Threads(num_threads, e.to_string()))?;
    let pool = Arc::new(pool);
    pools.push((num_threads, Arc::clone(&pool)));
    Ok(pool)
}

#[cfg(target_os = "linux")]
mod omp {
    use std::any::Any;
    use std::ffi::{c_char, c_uint, c_void, CStr, CString};
    use std::os::unix::ffi::OsStrExt;
    use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
    use std::path::PathBuf;
    use std::sync::{Mutex, PoisonError};

    use super::KernelError;

    /// The first panic of a team's threads, kept to be resumed by the caller.
    type Panic = Mutex<Option<Box<dyn Any + Send>>>;

    /// `void GOMP_parallel(void (*fn)(void *), void *data, unsigned num_threads,
    /// unsigned flags)`: runs `fn(data)` on a team of `num_threads` threads, the
    /// caller included, and returns when every thread has returned.
    pub(crate) type GompParallel =
        unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint);

    /// What the team's threads are handed: the caller's body and where a panic goes.
    struct Shared<'a, F> {
        body: &'a F,
        panic: Panic,
    }

    pub(crate) fn run<F: Fn() + Sync>(
        parallel: GompParallel,
        num_threads: usize,
        body: &F,
    ) -> Result<(), KernelError> {
        let n = c_uint::try_from(num_threads)
            .map_err(|_| KernelError::Threads(num_threads, "too many threads".into()))?;
        let shared = Shared {
            body,
            panic: Mutex::new(None),
        };
        let data = &shared as *const Shared<'_, F> as *mut c_void;
        // SAFETY: `parallel` is libgomp's `GOMP_parallel` (`find`), whose signature
        // `GompParallel` states. `data` points to `shared`, which outlives the call:
        // GOMP_parallel returns only after every thread has returned from
        // `trampoline::<F>`, which reads `data` as the `Shared<F>` it is, and only
        // through shared references (`F: Sync`, the panic slot behind a mutex).
        // flags 0: no proc_bind request.
        unsafe { parallel(trampoline::<F>, data, n, 0) };
        let panic = shared
            .panic
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(payload) = panic {
            resume_unwind(payload);
        }
        Ok(())
    }

    /// Each team thread's entry point. Never unwinds into libgomp: a panic is
    /// caught and stored for `run` to resume on the calling thread.
    extern "C" fn trampoline<F: Fn() + Sync>(data: *mut c_void) {
        // SAFETY: `run` passes a pointer to a live `Shared<F>` (see there).
        let shared = unsafe { &*(data as *const Shared<'_, F>) };
        if let Err(payload) = catch_unwind(AssertUnwindSafe(shared.body)) {
            // A poisoned slot still holds a valid Option; keep the first panic.
            let mut slot = shared.panic.lock().unwrap_or_else(PoisonError::into_inner);
            slot.get_or_insert(payload);
        }
    }

    /// `GOMP_parallel` of the libgomp mapped into this process, if exactly one
    /// is (or several, one of them torch's: the one under a `torch` directory).
    pub(crate) fn find() -> Option<GompParallel> {
        let path = mapped_libgomp()?;
        let path = CString::new(path.as_os_str().as_bytes()).ok()?;
        open(&path, libc::RTLD_NOW | libc::RTLD_NOLOAD)
    }

    /// `GOMP_parallel` of the libgomp `dlopen(path, flags)` gives (with
    /// `RTLD_NOLOAD`: only one already loaded).
    pub(crate) fn open(path: &CStr, flags: libc::c_int) -> Option<GompParallel> {
        // SAFETY: `path` is NUL-terminated. With RTLD_NOLOAD this returns a handle
        // only to a library already loaded (running no initialisers), else null;
        // without it (tests only) it loads libgomp, whose initialiser only reads
        // OMP_* variables. The handle is never closed, so the library stays
        // mapped as long as the pointer taken from it is kept (the process's life).
        let handle = unsafe { libc::dlopen(path.as_ptr(), flags) };
        if handle.is_null() {
            return None;
        }
        let name: &CStr = c"GOMP_parallel";
        // SAFETY: a live handle and a NUL-terminated name.
        let sym = unsafe { libc::dlsym(handle, name.as_ptr() as *const c_char) };
        if sym.is_null() {
            return None;
        }
        // SAFETY: libgomp's `GOMP_parallel` has the C signature `GompParallel`
        // (libgomp/libgomp_g.h, stable since GCC 4.9).
        Some(unsafe { std::mem::transmute::<*mut c_void, GompParallel>(sym) })
    }

    /// The path of the `libgomp*.so*` mapped into the process, from /proc/self/maps.
    fn mapped_libgomp() -> Option<PathBuf> {
        let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
        let mut paths: Vec<PathBuf> = maps
            .lines()
            // address perms offset dev inode, then the path after padding
            .filter_map(|line| line.splitn(6, ' ').nth(5))
            .map(|path| PathBuf::from(path.trim_start()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("libgomp") && n.contains(".so"))
            })
            .collect();
        paths.sort();
        paths.dedup();
        match paths.len() {
            0 => None,
            1 => paths.pop(),
            _ => paths
                .into_iter()
                .find(|p| p.components().any(|c| c.as_os_str() == "torch")),
        }
    }
}

/// The OpenMP trampoline on the system's libgomp (loaded here, as `cargo test`
/// has no torch); skipped where there is none. Once it is loaded, the kernel
/// tests that make their first multi-threaded call later take the OpenMP team
/// too: both teams give the same results.
#[cfg(all(test, target_os = "linux"))]
mod tests {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::omp;

    fn system_libgomp() -> Option<omp::GompParallel> {
        let found = omp::open(c"libgomp.so.1", libc::RTLD_NOW);
        if found.is_none() {
            eprintln!("no libgomp.so.1 on this system: OpenMP team not tested");
        }
        found
    }

    #[test]
    fn omp_team_runs_body_on_every_thread() {
        let Some(parallel) = system_libgomp() else {
            return;
        };
        for threads in [1, 2, 3] {
            let calls = AtomicUsize::new(0);
            super::run_on_omp(parallel, threads, &|| {
                calls.fetch_add(1, Ordering::Relaxed);
            })
            .unwrap();
            assert_eq!(calls.into_inner(), threads);
        }
    }

    #[test]
    fn omp_team_panic_reaches_the_caller() {
        let Some(parallel) = system_libgomp() else {
            return;
        };
        let result = catch_unwind(AssertUnwindSafe(|| {
            super::run_on_omp(parallel, 2, &|| panic!("in the team"))
        }));
        let payload = result.expect_err("the panic must be resumed on the caller");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"in the team"));
    }
}

/// Runs `item(idx, scratch)` for every idx in 0..num_items on `num_threads`
/// threads of the team; each thread keeps one scratch buffer. Each thread works
/// through a contiguous share of the items in order, then takes what is left of
/// the others' (a thread the OS descheduled holds up no one): consecutive items
/// read consecutive memory (a weight's rows), and a thread reading one long run
/// keeps the hardware prefetcher ahead of it, where items dealt out in turn cut
/// every thread's stream into short pieces (out of cache, two threads then read
/// a small GGUF weight slower than one).
pub(crate) fn run_items<F: Fn(usize, &mut Vec<f32>) + Sync>(
    num_items: usize,
    num_threads: usize,
    item: &F,
) -> Result<(), KernelError> {
    if num_threads == 1 || num_items <= 1 {
        let mut buf = Vec::new();
        (0..num_items).for_each(|i| item(i, &mut buf));
        return Ok(());
    }
    let shares = Shares::new(num_items, num_threads);
    let arrived = AtomicUsize::new(0);
    let each = || {
        let mut buf = Vec::new();
        let me = arrived.fetch_add(1, Ordering::Relaxed) % num_threads;
        while let Some(idx) = shares.next(me) {
            item(idx, &mut buf);
        }
    };
    if team_region::fork_in_region(num_threads, &each) {
        return Ok(());
    }
    match Team::get(num_threads)? {
        #[cfg(target_os = "linux")]
        Team::Omp(parallel) => run_on_omp(parallel, num_threads, &each)?,
        Team::Rayon => pool(num_threads)?.install(|| {
            (0..num_items)
                .into_par_iter()
                .for_each_init(Vec::new, |buf, idx| item(idx, buf))
        }),
    }
    Ok(())
}

/// Runs `body(item, state)` for every item of `items` on `num_threads` threads
/// of the team, each thread with its own `state` from `init`. Items are handed
/// out one at a time as threads ask, like rayon's work stealing: a thread the OS
/// descheduled holds up no one. Below two items (or one thread) the calling
/// thread does them all: a small call pays for no wake-up.
pub(crate) fn run_queue<I, S, N, F>(
    items: I,
    num_threads: usize,
    init: N,
    body: &F,
) -> Result<(), KernelError>
where
    I: Iterator + Send,
    I::Item: Send,
    N: Fn() -> S + Sync + Send,
    F: Fn(I::Item, &mut S) + Sync,
{
    let (lower, _) = items.size_hint();
    if num_threads <= 1 || lower < 2 {
        let mut state = init();
        items.for_each(|item| body(item, &mut state));
        return Ok(());
    }
    let queue = std::sync::Mutex::new(items);
    let each = || {
        let mut state = init();
        loop {
            // Only `next` runs under the lock and it cannot panic; were the lock
            // poisoned anyway, the iterator in it would still be valid.
            let next = queue.lock().unwrap_or_else(PoisonError::into_inner).next();
            let Some(item) = next else { break };
            body(item, &mut state);
        }
    };
    if team_region::fork_in_region(num_threads, &each) {
        return Ok(());
    }
    match Team::get(num_threads)? {
        #[cfg(target_os = "linux")]
        Team::Omp(parallel) => run_on_omp(parallel, num_threads, &each),
        Team::Rayon => {
            let items = queue.into_inner().unwrap_or_else(PoisonError::into_inner);
            let all: Vec<I::Item> = items.collect();
            pool(num_threads)?.install(|| {
                all.into_par_iter()
                    .for_each_init(&init, |state, item| body(item, state))
            });
            Ok(())
        }
    }
}

/// The items cut into one contiguous share per thread, each with its own cursor
/// (atomic: taking an item is one instruction, never a sleep in the kernel).
#[cfg_attr(not(target_os = "linux"), allow(dead_code))] // the OpenMP team's only
struct Shares {
    ends: Vec<usize>,
    cursors: Vec<Cursor>,
}

/// A thread's cursor on a cache line pair of its own. Packed side by side, the
/// cursors shared a line, and every item a thread took from its own share
/// pulled that line from the other core: at one row an item is a few hundred
/// nanoseconds of work, and the contended `lock xadd` was 16 % of a SmolLM2
/// decode step's samples (Zen 5, two threads). 128 bytes: the adjacent-line
/// prefetcher moves lines in pairs.
#[repr(align(128))]
struct Cursor(AtomicUsize);

#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
impl Shares {
    fn new(num_items: usize, num_threads: usize) -> Shares {
        let bound = |t: usize| num_items * t / num_threads;
        Shares {
            ends: (1..=num_threads).map(bound).collect(),
            cursors: (0..num_threads)
                .map(|t| Cursor(AtomicUsize::new(bound(t))))
                .collect(),
        }
    }

    /// The next item for thread `me`: its own share's, then the others' in turn.
    fn next(&self, me: usize) -> Option<usize> {
        let n = self.ends.len();
        (0..n).map(|i| (me + i) % n).find_map(|t| {
            let idx = self.cursors[t].0.fetch_add(1, Ordering::Relaxed);
            (idx < self.ends[t]).then_some(idx)
        })
    }
}

#[cfg(test)]
mod share_tests {
    use super::Shares;

    #[test]
    fn every_item_is_taken_once_each_thread_starting_on_its_own_share() {
        for (items, threads) in [(0, 2), (1, 2), (5, 2), (36, 2), (37, 3), (7, 8)] {
            let shares = Shares::new(items, threads);
            let firsts: Vec<Option<usize>> = (0..threads).map(|me| shares.next(me)).collect();
            for (t, first) in firsts.iter().enumerate() {
                // (with fewer items than threads a thread without a share steals one
                // before the next thread starts)
                if items >= threads {
                    let own = items * t / threads;
                    assert_eq!(*first, Some(own), "thread {t} starts on its own share");
                }
            }
            let mut taken: Vec<usize> = firsts.into_iter().flatten().collect();
            // then thread 0 takes three items for each one of the others'
            'all: loop {
                for me in 0..threads {
                    for _ in 0..if me == 0 { 3 } else { 1 } {
                        let Some(idx) = shares.next(me) else {
                            break 'all;
                        };
                        taken.push(idx);
                    }
                }
            }
            for me in 0..threads {
                taken.extend(std::iter::from_fn(|| shares.next(me)));
            }
            taken.sort_unstable();
            assert_eq!(
                taken,
                (0..items).collect::<Vec<_>>(),
                "{items} items, {threads} threads"
            );
        }
    }
}
