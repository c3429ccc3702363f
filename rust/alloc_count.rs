//! The extension's allocator: the system's, counting per thread the bytes it
//! holds, so that work run on one thread (compiling a grammar) can be weighed
//! by what it kept (`net`) and at most held (`peak`) — the grammar cache is
//! bounded in bytes with these figures — and `release_free_memory` hands freed
//! pages back to the system once a large grammar has gone.
//!
//! The counters are const-initialised thread locals without destructors: no
//! allocation, no lazy init, safe inside `alloc`. Counting costs two adds and a
//! compare per allocation.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// The system allocator, counted.
pub struct Counting;

thread_local! {
    // bytes allocated minus bytes freed on this thread since it started
    static HELD: Cell<i64> = const { Cell::new(0) };
    // the most HELD has been since the last `measure` began
    static PEAK: Cell<i64> = const { Cell::new(0) };
}

fn add(bytes: i64) {
    let held = HELD.with(|h| {
        let v = h.get() + bytes;
        h.set(v);
        v
    });
    PEAK.with(|p| {
        if held > p.get() {
            p.set(held)
        }
    });
}

// SAFETY: every call is forwarded to `System` unchanged; the counters touch no
// allocation.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            add(layout.size() as i64);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            add(layout.size() as i64);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        add(-(layout.size() as i64));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            add(new_size as i64 - layout.size() as i64);
        }
        p
    }
}

/// What a closure's allocations on the calling thread came to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Bytes still held when it returned (allocated minus freed; 0 if it freed
    /// more than it allocated).
    pub net: u64,
    /// The most bytes it held at once.
    pub peak: u64,
}

/// Runs `f`, measuring the heap it used on this thread. Only allocations made
/// on this thread count: run work that should be weighed on a thread of its own
/// (a thread that frees what others allocated lowers the figures).
pub fn measure<T>(f: impl FnOnce() -> T) -> (T, Usage) {
    let start = HELD.with(Cell::get);
    PEAK.with(|p| p.set(start));
    let out = f();
    let end = HELD.with(Cell::get);
    let peak = PEAK.with(Cell::get);
    let usage = Usage {
        net: (end - start).max(0) as u64,
        peak: (peak - start).max(0) as u64,
    };
    (out, usage)
}

/// Returns the allocator's free pages to the system (glibc keeps freed memory
/// in its arenas otherwise, and a thread's arena is rarely trimmed). Walks every
/// arena: call it after large frees, not per allocation.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measure_counts_what_stays_and_the_peak() {
        let (kept, usage) = measure(|| {
            let scratch = vec![0u8; 1 << 20];
            drop(scratch);
            vec![1u8; 4096]
        });
        assert_eq!(kept.len(), 4096);
        assert!(usage.net >= 4096 && usage.net < 8192, "{usage:?}");
        assert!(usage.peak >= 1 << 20, "{usage:?}");
    }

    #[test]
    fn measure_of_nothing_is_zero() {
        let (_, usage) = measure(|| 1 + 1);
        assert_eq!(usage, Usage::default());
    }
}
