//! The step's grammar work on a thread of the extension's own. The runner hands
//! it a draw's tokens and the matchers whose next masks it wants, and goes on
//! (output handling, scheduling, the next step's inputs) while the matchers
//! advance and the masks are filled, neither needing the GIL nor waiting for it.
//!
//! Why not a Python helper thread: it needed the GIL to start the job and again
//! between the advance and the fill, while the runner's thread held it running
//! Python; the fill slid into the next forward pass, where it took a core from
//! torch's threads instead of using the one left idle between two forward passes.
//!
//! Jobs run one at a time, in the order they were submitted, so a step's masks
//! always follow the previous step's advance.

use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Mutex;
use std::thread;
use std::time::Instant;

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

type Task = Box<dyn FnOnce() + Send>;

/// What a job gives back: the rows whose matchers failed, or what went wrong.
pub(super) type JobResult = Result<Vec<usize>, String>;

/// A finished job: its result and how long it ran on the worker.
#[derive(Clone)]
pub(super) struct Done {
    result: JobResult,
    seconds: f64,
}

/// One thread, started on the first job, running jobs in submission order; it
/// ends when its owner drops the worker (the channel closes). A process forked
/// after it started has no such thread: it starts its own rather than queue jobs
/// that nothing would run.
pub(super) struct SerialWorker {
    name: &'static str,
    // the process that started the thread, the thread's queue, its placement
    tx: Mutex<Option<(u32, Sender<Task>, placement::AwayFrom)>>,
}

fn panic_text(p: &(dyn Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string())
}

impl SerialWorker {
    pub(super) fn new(name: &'static str) -> Self {
        SerialWorker {
            name,
            tx: Mutex::new(None),
        }
    }

    /// Queues `job`; its result (or its panic, as text) arrives on the receiver.
    pub(super) fn submit(
        &self,
        job: impl FnOnce() -> JobResult + Send + 'static,
    ) -> PyResult<Receiver<Done>> {
        let (done, result) = channel();
        let task: Task = Box::new(move || {
            let t0 = Instant::now();
            let result = catch_unwind(AssertUnwindSafe(job))
                .unwrap_or_else(|p| Err(format!("grammar job panicked: {}", panic_text(&*p))));
            let seconds = t0.elapsed().as_secs_f64();
            let _ = done.send(Done { result, seconds }); // its owner may be gone
        });
        let mut slot = self
            .tx
            .lock()
            .map_err(|_| PyRuntimeError::new_err("grammar worker lock poisoned"))?;
        let pid = std::process::id();
        if slot
            .as_ref()
            .is_none_or(|(started_by, _, _)| *started_by != pid)
        {
            let (tx, rx) = channel::<Task>();
            let (id_tx, id_rx) = channel();
            thread::Builder::new()
                .name(self.name.to_string())
                .spawn(move || {
                    let _ = id_tx.send(placement::ThreadId::current());
                    for task in rx {
                        task();
                    }
                })
                .map_err(|e| PyRuntimeError::new_err(format!("cannot start {}: {e}", self.name)))?;
            let id = id_rx
                .recv()
                .map_err(|_| PyRuntimeError::new_err(format!("{} did not start", self.name)))?;
            *slot = Some((pid, tx, placement::AwayFrom::new(id)));
        }
        let (_, tx, away) = slot.as_ref().expect("started above");
        away.update();
        tx.send(task)
            .map_err(|_| PyRuntimeError::new_err(format!("{} has stopped", self.name)))?;
        Ok(result)
    }
}

/// A job submitted to the grammar worker: `wait()` gives the indices of the
/// matchers whose fill failed (their rows allow EOS only), or raises what went
/// wrong. The job writes into the caller's bitmask array; the job holds that
/// array's buffer until it has finished, and dropping an unfinished job waits
/// for it, so the memory outlives every write to it.
#[pyclass(frozen, module = "asyncllm._core")]
pub struct MaskJob {
    // the job's result on its way, then as received
    state: Mutex<(Option<Receiver<Done>>, Option<Done>)>,
    // the bitmask array the job writes: held (and its export pinned) until then
    _out: PyBuffer<i32>,
}

impl MaskJob {
    pub(super) fn new(result: Receiver<Done>, out: PyBuffer<i32>) -> Self {
        MaskJob {
            state: Mutex::new((Some(result), None)),
            _out: out,
        }
    }

    fn outcome(&self) -> Done {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(rx) = state.0.take() {
            state.1 = Some(rx.recv().unwrap_or_else(|_| Done {
                result: Err("the grammar worker stopped before the job ended".into()),
                seconds: 0.0,
            }));
        }
        state.1.clone().expect("received above")
    }
}

#[pymethods]
impl MaskJob {
    /// Waits (GIL released) for the job; returns the indices of the matchers
    /// whose fill failed, or raises RuntimeError with why the job failed.
    fn wait(&self, py: Python<'_>) -> PyResult<Vec<usize>> {
        py.detach(|| self.outcome().result)
            .map_err(PyRuntimeError::new_err)
    }

    /// Seconds the job ran on the grammar thread (waits for it first).
    #[getter]
    fn run_seconds(&self, py: Python<'_>) -> f64 {
        py.detach(|| self.outcome().seconds)
    }
}

impl Drop for MaskJob {
    fn drop(&mut self) {
        // The job may still write into `_out`: wait for it before the buffer
        // goes. This blocks with the GIL held, which is safe: the worker never
        // takes the GIL, so the job ends without this thread's help.
        let _ = self.outcome();
    }
}

/// Where the worker runs: on any CPU the submitting thread may use but the one
/// it is on. The submitter (the runner's thread) goes on with Python work, and
/// the job is meant to run beside it; the scheduler, left alone, often woke the
/// worker on the submitter's own CPU (the other one looking busy with torch's
/// spinning threads) and ran the job there, before the submitter, in full.
#[cfg(target_os = "linux")]
mod placement {
    use std::mem::{size_of, zeroed};
    use std::sync::atomic::{AtomicI32, Ordering};

    pub(super) struct ThreadId(libc::pid_t);

    impl ThreadId {
        pub(super) fn current() -> Self {
            // SAFETY: gettid has no preconditions.
            ThreadId(unsafe { libc::gettid() })
        }
    }

    pub(super) struct AwayFrom {
        worker: libc::pid_t,
        // the CPUs the submitting thread could use when the worker started
        allowed: libc::cpu_set_t,
        // the CPU the worker was last kept off (-1: none)
        excluded: AtomicI32,
    }

    impl AwayFrom {
        pub(super) fn new(worker: ThreadId) -> Self {
            // SAFETY: cpu_set_t is plain bits (all-zero is the empty set), and
            // sched_getaffinity writes at most `size_of::<cpu_set_t>()` bytes into it.
            let allowed = unsafe {
                let mut set: libc::cpu_set_t = zeroed();
                if libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) != 0 {
                    libc::CPU_ZERO(&mut set); // unknown: placement stays the scheduler's
                }
                set
            };
            AwayFrom {
                worker: worker.0,
                allowed,
                excluded: AtomicI32::new(-1),
            }
        }

        /// Called on the submitting thread: keeps the worker off its CPU.
        /// A failure leaves the placement to the scheduler (it only costs time).
        pub(super) fn update(&self) {
            // SAFETY: sched_getcpu has no preconditions.
            let cpu = unsafe { libc::sched_getcpu() };
            if cpu < 0 || self.excluded.load(Ordering::Relaxed) == cpu {
                return;
            }
            let mut set = self.allowed;
            // SAFETY: CPU_ISSET/CPU_CLR/CPU_COUNT index within the set (`cpu` is
            // checked against its size); sched_setaffinity reads `set` only.
            unsafe {
                if (cpu as usize) >= libc::CPU_SETSIZE as usize
                    || !libc::CPU_ISSET(cpu as usize, &set)
                {
                    return;
                }
                libc::CPU_CLR(cpu as usize, &mut set);
                if libc::CPU_COUNT(&set) == 0 {
                    return; // one CPU: nowhere else to go
                }
                libc::sched_setaffinity(self.worker, size_of::<libc::cpu_set_t>(), &set);
            }
            self.excluded.store(cpu, Ordering::Relaxed);
        }
    }
}

#[cfg(not(target_os = "linux"))]
mod placement {
    pub(super) struct ThreadId;

    impl ThreadId {
        pub(super) fn current() -> Self {
            ThreadId
        }
    }

    /// Elsewhere the scheduler places the worker.
    pub(super) struct AwayFrom;

    impl AwayFrom {
        pub(super) fn new(_: ThreadId) -> Self {
            AwayFrom
        }

        pub(super) fn update(&self) {}
    }
}
