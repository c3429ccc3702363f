//! Threads that compile grammars at the lowest scheduling priority, with a
//! deadline per job.
//!
//! Why: compiling a pathological grammar burns CPU for as long as its budget
//! allows, and on a machine with few cores that CPU came from the engine's step
//! loop and the server's event loop — every stream stalled while one request's
//! grammar compiled. At nice 19 a compile only gets the CPU the step loop
//! leaves idle. The deadline bounds what its own request waits when the
//! machine is busy: that request fails, the compile runs to the end of its
//! fuel and its result is dropped, nothing else waits on it.
//!
//! The threads start on the first job; a process forked after they started
//! starts its own (a forked child has no such threads).

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use thiserror::Error;

type Task = Box<dyn FnOnce() + Send>;

/// The nice value of the compile threads: the lowest priority.
pub const COMPILE_NICE: i32 = 19;

/// Why a job gave no result.
#[derive(Debug, Error, PartialEq)]
pub enum PoolError {
    #[error("compiling took longer than its deadline of {0:.1} s (the server is busy, or the grammar is too costly)")]
    Deadline(f64),
    #[error("the grammar compile threads cannot run jobs: {0}")]
    Stopped(String),
}

/// `threads` low-priority threads running jobs in submission order.
pub struct CompilePool {
    name: &'static str,
    threads: usize,
    // the process that started the threads, and their queue
    queue: Mutex<Option<(u32, Sender<Task>)>>,
}

impl CompilePool {
    pub fn new(name: &'static str, threads: usize) -> Self {
        CompilePool {
            name,
            threads: threads.max(1),
            queue: Mutex::new(None),
        }
    }

    /// Runs `job` on one of the pool's threads and waits for it at most
    /// `deadline` (None: as long as it takes).
    pub fn run<T: Send + 'static>(
        &self,
        deadline: Option<Duration>,
        job: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, PoolError> {
        let (done, result) = channel();
        let task: Task = Box::new(move || {
            let _ = done.send(job()); // its caller may have stopped waiting
        });
        self.sender()?
            .send(task)
            .map_err(|_| PoolError::Stopped("the threads have exited".into()))?;
        match deadline {
            None => result
                .recv()
                .map_err(|_| PoolError::Stopped("a job panicked".into())),
            Some(d) => result.recv_timeout(d).map_err(|e| match e {
                RecvTimeoutError::Timeout => PoolError::Deadline(d.as_secs_f64()),
                RecvTimeoutError::Disconnected => PoolError::Stopped("a job panicked".into()),
            }),
        }
    }

    fn sender(&self) -> Result<Sender<Task>, PoolError> {
        let mut slot = self
            .queue
            .lock()
            .map_err(|_| PoolError::Stopped("lock poisoned".into()))?;
        let pid = std::process::id();
        if let Some((started_by, tx)) = slot.as_ref() {
            if *started_by == pid {
                return Ok(tx.clone());
            }
        }
        let (tx, rx) = channel::<Task>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..self.threads {
            let rx = rx.clone();
            thread::Builder::new()
                .name(format!("{}-{i}", self.name))
                .spawn(move || {
                    lower_priority();
                    while let Some(task) = next(&rx) {
                        // a panicking job drops its result sender: its caller is told
                        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(task));
                    }
                })
                .map_err(|e| PoolError::Stopped(format!("cannot start a thread: {e}")))?;
        }
        *slot = Some((pid, tx.clone()));
        Ok(tx)
    }
}

fn next(rx: &Mutex<Receiver<Task>>) -> Option<Task> {
    rx.lock().ok()?.recv().ok()
}

/// Puts the calling thread at `COMPILE_NICE`. On Linux a nice value belongs to
/// a thread (its tid), not to the process. A failure leaves it at the normal
/// priority (it costs the other threads time, not correctness).
fn lower_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: gettid and setpriority have no memory preconditions.
    unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, COMPILE_NICE);
    }
}

/// The nice value of the calling thread (Linux; 0 elsewhere).
pub fn current_nice() -> i32 {
    #[cfg(target_os = "linux")]
    // SAFETY: as above.
    unsafe {
        libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t)
    }
    #[cfg(not(target_os = "linux"))]
    0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn jobs_run_at_the_lowest_priority() {
        let before = current_nice();
        let pool = CompilePool::new("test-compile", 1);
        let nice = pool.run(None, current_nice).unwrap();
        if cfg!(target_os = "linux") {
            assert_eq!(nice, COMPILE_NICE);
        }
        assert_eq!(current_nice(), before, "the caller's priority is its own");
    }

    #[test]
    fn a_job_past_its_deadline_fails_its_caller_only() {
        let pool = CompilePool::new("test-compile", 2);
        let t0 = Instant::now();
        let slow = pool.run(Some(Duration::from_millis(50)), || {
            thread::sleep(Duration::from_millis(500));
            1
        });
        assert_eq!(slow, Err(PoolError::Deadline(0.05)));
        assert!(t0.elapsed() < Duration::from_millis(400));
        // the other thread still answers while the slow job runs on
        assert_eq!(pool.run(Some(Duration::from_secs(5)), || 2), Ok(2));
    }

    #[test]
    fn a_panicking_job_is_an_error_and_the_pool_goes_on() {
        let pool = CompilePool::new("test-compile", 1);
        let r: Result<(), _> = pool.run(None, || panic!("boom"));
        assert!(matches!(r, Err(PoolError::Stopped(_))));
        assert_eq!(pool.run(None, || 3), Ok(3));
    }
}
