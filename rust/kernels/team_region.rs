//! A team held for the length of one call that makes many small parallel calls
//! (the fused decode step: five kernels and the work between them, per layer).
//!
//! Why: each kernel call handed to libgomp (`GOMP_parallel`) starts a team and
//! ends it at a barrier every thread must reach. A SmolLM2 verification step makes
//! 150 such calls of a few hundred microseconds each, and between them the calling
//! thread's serial work leaves the others waiting in libgomp: at 9 rows a fifth of
//! the step's samples (Zen 5, two threads). In a region the team is started once;
//! a fork publishes the body in one atomic store that the waiting threads spin on,
//! and the region's threads can take the serial work's rows too.
//!
//! A thread joins a fork only while it is open: the calling thread closes it once
//! its own share is done and then waits for those that joined alone. The kernels
//! share their items out dynamically, so a thread that joins late, or never (one
//! the OS descheduled, or a team libgomp gave fewer threads), holds up no one.

use std::any::Any;
use std::cell::{Cell, UnsafeCell};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use super::team::{self, Team};
use super::KernelError;

/// The fork's state word: the fork's number above `OPEN`, whether it still takes
/// threads, how many joined it, and `STOP` when the region ends.
const OPEN: u64 = 1 << 31;
const STOP: u64 = 1 << 30;
const JOINED: u64 = (1 << 30) - 1;
const EPOCH: u64 = 1 << 32;

/// Spins of a waiting thread before it yields its core between checks.
const SPINS: u32 = 1 << 14;

type Body = dyn Fn() + Sync;

/// What the region's threads share.
pub(crate) struct Region {
    state: Line<AtomicU64>,
    finished: Line<AtomicUsize>,
    /// The open fork's body; written only while no thread runs one (see `fork`).
    body: UnsafeCell<Option<*const Body>>,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    num_threads: usize,
}

/// A value on a cache line pair of its own (the waiting threads spin on it).
#[repr(align(128))]
struct Line<T>(T);

// SAFETY: `body` is the only field that is not Sync. It is written by the region's
// calling thread only between forks (every joined thread has finished, `fork`) and
// read by a thread only after joining the open fork, whose publication (a Release
// store of `state`) follows the write: no read races a write. The pointer it holds
// is to a `Fn + Sync` body, so calling it from several threads at once is sound.
unsafe impl Sync for Region {}

thread_local! {
    /// The region this thread runs (as its calling thread), if any.
    static CURRENT: Cell<Option<*const Region>> = const { Cell::new(None) };
}

/// Runs `master` on the calling thread while the team's other threads wait in a
/// region for its forks (`fork`): the kernels `master` calls on `num_threads`
/// threads use it instead of starting a team each. Outside a region that fits
/// (one thread, or already in one) this is `master()`.
pub(crate) fn region<R, M>(num_threads: usize, master: M) -> Result<R, KernelError>
where
    M: FnOnce() -> R + Send,
    R: Send,
{
    if num_threads <= 1 || CURRENT.with(Cell::get).is_some() {
        return Ok(master());
    }
    let region = Region {
        state: Line(AtomicU64::new(0)),
        finished: Line(AtomicUsize::new(0)),
        body: UnsafeCell::new(None),
        panic: Mutex::new(None),
        num_threads,
    };
    let caller = std::thread::current().id();
    let master = Mutex::new(Some(master));
    let result = Mutex::new(None);
    let each = || {
        if std::thread::current().id() == caller {
            let master = lock(&master).take();
            if let Some(master) = master {
                *lock(&result) = Some(region.lead(master));
            }
        } else {
            region.serve();
        }
    };
    match Team::get(num_threads)? {
        #[cfg(target_os = "linux")]
        Team::Omp(parallel) => team::run_on_omp(parallel, num_threads, &each)?,
        Team::Rayon => team::pool(num_threads)?.in_place_scope(|s| {
            for _ in 1..num_threads {
                s.spawn(|_| region.serve());
            }
            each();
        }),
    }
    let outcome = lock(&result).take();
    match outcome {
        Some(Ok(value)) => Ok(value),
        Some(Err(payload)) => resume_unwind(payload),
        // libgomp ran the body on the calling thread as thread 0: unreachable
        None => Err(KernelError::Threads(
            num_threads,
            "the region's calling thread did not run".into(),
        )),
    }
}

/// Runs `body` as a fork of the region the calling thread leads, when there is
/// one on `num_threads` threads (true), else does nothing (false).
pub(crate) fn fork_in_region<F: Fn() + Sync>(num_threads: usize, body: &F) -> bool {
    let Some(ptr) = CURRENT.with(Cell::get) else {
        return false;
    };
    // SAFETY: CURRENT holds a region only while `lead` runs on this thread, and
    // the region outlives `lead`; this call is within `lead` (on its thread) and
    // the reference does not outlive it.
    let region = unsafe { &*ptr };
    if region.num_threads != num_threads {
        return false;
    }
    region.fork(body);
    true
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // every value behind these locks is whole after any panic (set or taken once)
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Region {
    /// The calling thread's part: `master` with this region current, then the
    /// region stopped (also when `master` panics: the others must not wait on).
    fn lead<R>(&self, master: impl FnOnce() -> R) -> Result<R, Box<dyn Any + Send>> {
        struct Stop<'a>(&'a Region);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                CURRENT.with(|c| c.set(None));
                self.0.state.0.fetch_or(STOP, Ordering::Release);
            }
        }
        CURRENT.with(|c| c.set(Some(self as *const Region)));
        let _stop = Stop(self);
        catch_unwind(AssertUnwindSafe(master))
    }

    /// Another thread's part: join each open fork until the region stops.
    fn serve(&self) {
        let mut seen = self.state.0.load(Ordering::Acquire) / EPOCH;
        let mut spins = 0u32;
        loop {
            let s = self.state.0.load(Ordering::Acquire);
            if s & STOP != 0 {
                return;
            }
            if s / EPOCH == seen {
                spins += 1;
                if spins < SPINS {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
                continue;
            }
            seen = s / EPOCH;
            spins = 0;
            if !self.join(s) {
                continue;
            }
            // SAFETY: this thread joined the open fork, which `fork` published
            // after writing `body` (the Acquire above pairs with its Release) and
            // will not rewrite before this thread counts itself finished below.
            let body = unsafe { (*self.body.get()).expect("an open fork has a body") };
            // SAFETY: `fork` keeps the body alive until every joined thread has
            // finished (it waits for `finished` below before returning).
            if let Err(payload) = catch_unwind(AssertUnwindSafe(|| unsafe { (*body)() })) {
                lock(&self.panic).get_or_insert(payload);
            }
            self.finished.0.fetch_add(1, Ordering::Release);
        }
    }

    /// Counts this thread into the fork `s` shows, while it is open (another
    /// thread joining at the same instant only makes it try again).
    fn join(&self, mut s: u64) -> bool {
        let epoch = s / EPOCH;
        while s & OPEN != 0 && s / EPOCH == epoch {
            match self
                .state
                .0
                .compare_exchange_weak(s, s + 1, Ordering::Acquire, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(now) => s = now,
            }
        }
        false
    }

    /// Calls `body` on the calling thread and on each of the region's threads that
    /// joins before the caller's own call returns; returns when all have. A panic
    /// on any of them is resumed here.
    fn fork<'b, F: Fn() + Sync + 'b>(&self, body: &'b F) {
        let short: *const (dyn Fn() + Sync + 'b) = body;
        // SAFETY: only the lifetime is erased: the pointer is dereferenced only by
        // threads that joined this fork, and this function returns (ending the
        // borrow of `body`) only after every one of them has finished with it.
        let erased =
            unsafe { std::mem::transmute::<*const (dyn Fn() + Sync + 'b), *const Body>(short) };
        // SAFETY: no thread runs a body now (the last fork waited for all that
        // joined it, and none can join a closed fork), so none reads `body`.
        unsafe { *self.body.get() = Some(erased) };
        self.finished.0.store(0, Ordering::Relaxed);
        let s = self.state.0.load(Ordering::Relaxed);
        let next = (s / EPOCH).wrapping_add(1).wrapping_mul(EPOCH) | OPEN;
        self.state.0.store(next, Ordering::Release);
        let own = catch_unwind(AssertUnwindSafe(body));
        let joined = (self.state.0.fetch_and(!OPEN, Ordering::AcqRel) & JOINED) as usize;
        let mut spins = 0u32;
        while self.finished.0.load(Ordering::Acquire) < joined {
            spins += 1;
            if spins < SPINS {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        if let Err(payload) = own {
            resume_unwind(payload);
        }
        let theirs = lock(&self.panic).take();
        if let Some(payload) = theirs {
            resume_unwind(payload);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::{fork_in_region, region};
    use crate::kernels::team::run_items;

    #[test]
    fn every_item_of_every_fork_runs_once() {
        for threads in [1, 2, 3] {
            let counts: Vec<AtomicUsize> = (0..1000).map(|_| AtomicUsize::new(0)).collect();
            let forks = region(threads, || {
                for round in 0..200 {
                    let n = 1 + round % 7 * 100;
                    run_items(n, threads, &|i, _| {
                        counts[i].fetch_add(1, Ordering::Relaxed);
                    })
                    .unwrap();
                }
                200
            })
            .unwrap();
            assert_eq!(forks, 200);
            let expected: Vec<usize> = (0..1000)
                .map(|i| (0..200).filter(|r| i < 1 + r % 7 * 100).count())
                .collect();
            let got: Vec<usize> = counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
            assert_eq!(got, expected, "{threads} threads");
        }
    }

    #[test]
    fn a_panic_in_a_fork_or_the_caller_reaches_the_caller_and_ends_the_region() {
        let in_fork = catch_unwind(AssertUnwindSafe(|| {
            region(2, || run_items(64, 2, &|i, _| assert!(i != 63, "item 63")))
        }));
        let payload = in_fork.expect_err("the fork's panic must be resumed");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"item 63"));
        let in_caller = catch_unwind(AssertUnwindSafe(|| {
            region(2, || -> () { panic!("in the caller") })
        }));
        assert!(in_caller.is_err());
        // the team is whole again: the next region runs
        assert_eq!(region(2, || 7).unwrap(), 7);
    }

    #[test]
    fn outside_a_region_or_on_another_thread_count_nothing_forks() {
        assert!(!fork_in_region(2, &|| {}));
        let nested = region(2, || {
            // another thread count: no fork of this region
            let other = fork_in_region(3, &|| {});
            // a region inside the region: its caller's closure runs directly
            let inner = region(2, || 5).unwrap();
            (other, inner)
        })
        .unwrap();
        assert_eq!(nested, (false, 5));
    }
}
