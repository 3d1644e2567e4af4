//! A persistent pool of worker threads for splitting kernels into tasks.
//!
//! Threads start once. A parallel call publishes the job (a borrowed closure and a task
//! count) together with a new generation number; workers, spinning on that number, and the
//! calling thread claim task indices with a compare-and-swap on one word holding
//! `(generation, next index)`, so a claim can only succeed for the current job. The caller
//! waits only for tasks that were claimed and are still running, never for workers that
//! have not woken up yet: on a busy machine a descheduled worker does not stall the call,
//! the caller simply runs more of the tasks itself. Nothing is allocated or spawned per
//! call, which matters at ~150-250 calls per decoded token.
//!
//! Idle workers spin briefly, then yield, then park; the submitter wakes parked workers.
//! A call made while the pool is busy (from a task, or from another thread) runs serially
//! on the calling thread.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Idle workers spin this long before yielding, and yield this long before parking.
const SPIN: Duration = Duration::from_micros(300);
const YIELD: Duration = Duration::from_millis(3);

/// Next-index value of a closed generation: above every task count (< `u32::MAX`).
const CLOSED: u64 = 0xffff_ffff;

struct Shared {
    /// `generation << 32 | next task index`.
    state: AtomicU64,
    /// The job's closure as the two words of a fat pointer, and its task count. Read only
    /// after observing the generation; a claim validates the generation again, so a value
    /// read from a newer job is never used: the submitter closes the old generation before
    /// writing them (Release), so whoever reads a newer job's words fails that claim.
    f_data: AtomicUsize,
    f_vtable: AtomicUsize,
    n_tasks: AtomicUsize,
    completed: AtomicUsize,
    sleepers: AtomicUsize,
    shutdown: AtomicBool,
    panicked: AtomicBool,
}

pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    submit: Mutex<()>,
    n_threads: usize,
}

impl ThreadPool {
    /// A pool of `n_threads` threads: the calling thread plus `n_threads - 1` workers.
    pub fn new(n_threads: usize) -> Self {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            f_data: AtomicUsize::new(0),
            f_vtable: AtomicUsize::new(0),
            n_tasks: AtomicUsize::new(0),
            completed: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
        });
        let mut workers = Vec::with_capacity(n_threads - 1);
        for i in 1..n_threads {
            let sh = Arc::clone(&shared);
            let spawned = std::thread::Builder::new()
                .name(format!("rustorch-worker-{i}"))
                .spawn(move || worker(&sh));
            match spawned {
                Ok(h) => workers.push(h),
                Err(_) => break,
            }
        }
        let n_threads = workers.len() + 1;
        ThreadPool {
            shared,
            workers,
            submit: Mutex::new(()),
            n_threads,
        }
    }

    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Runs `f(i)` for every `i` in `0..n_tasks`, spread over the pool, and returns when
    /// all are done. Tasks are claimed dynamically, so uneven tasks balance out.
    pub fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if n_tasks == 0 {
            return;
        }
        if self.workers.is_empty() || n_tasks == 1 || n_tasks >= u32::MAX as usize {
            (0..n_tasks).for_each(f);
            return;
        }
        let Ok(_guard) = self.submit.try_lock() else {
            (0..n_tasks).for_each(f);
            return;
        };
        let sh = &*self.shared;
        let [data, vtable] = fat_words(f);
        let prev = sh.state.load(Ordering::Relaxed) >> 32;
        // Close the previous generation before the job words change: a worker that observed
        // it but reads this job's (larger) task count must not find an index to claim in it.
        sh.state.store(prev << 32 | CLOSED, Ordering::SeqCst);
        // Release: a worker that reads one of these words also sees the closed generation.
        sh.f_data.store(data, Ordering::Release);
        sh.f_vtable.store(vtable, Ordering::Release);
        sh.n_tasks.store(n_tasks, Ordering::Release);
        sh.completed.store(0, Ordering::Relaxed);
        let gen = prev.wrapping_add(1) & 0xffff_ffff;
        // SeqCst: pairs with the sleepers check below and in `worker` (no lost wake-up)
        sh.state.store(gen << 32, Ordering::SeqCst);
        if sh.sleepers.load(Ordering::SeqCst) > 0 {
            for w in &self.workers {
                w.thread().unpark();
            }
        }
        let mine =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| claim(sh, gen, f, n_tasks)));
        // Wait for tasks claimed by workers. `f` stays alive until then: no task of this
        // generation can be claimed any more (every index is taken).
        let t0 = Instant::now();
        let mut spins = 0u32;
        while sh.completed.load(Ordering::Acquire) < n_tasks {
            spins = spins.wrapping_add(1);
            if spins < 256
                || (!spins.is_multiple_of(64) || t0.elapsed() < Duration::from_micros(50))
            {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        let worker_panicked = sh.panicked.swap(false, Ordering::Relaxed);
        if let Err(e) = mine {
            std::panic::resume_unwind(e);
        }
        if worker_panicked {
            panic!("a thread-pool task panicked");
        }
    }
}

fn fat_words(f: &(dyn Fn(usize) + Sync + '_)) -> [usize; 2] {
    // SAFETY: a `&dyn Trait` is two pointer-sized words (data, vtable).
    unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync + '_), [usize; 2]>(f) }
}

/// Claims and runs tasks of generation `gen` until none are left or a newer job replaced it.
fn claim(sh: &Shared, gen: u64, f: impl Fn(usize), n_tasks: usize) {
    let mut s = sh.state.load(Ordering::Acquire);
    loop {
        if s >> 32 != gen || (s & 0xffff_ffff) as usize >= n_tasks {
            return;
        }
        match sh
            .state
            .compare_exchange_weak(s, s + 1, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => {
                let i = (s & 0xffff_ffff) as usize;
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(i)));
                if r.is_err() {
                    sh.panicked.store(true, Ordering::Relaxed);
                }
                sh.completed.fetch_add(1, Ordering::Release);
                s = sh.state.load(Ordering::Acquire);
            }
            Err(now) => s = now,
        }
    }
}

fn worker(sh: &Shared) {
    let mut seen = 0u64;
    loop {
        let t0 = Instant::now();
        let mut spins = 0u32;
        let gen = loop {
            let g = sh.state.load(Ordering::Acquire) >> 32;
            if g != seen {
                break g;
            }
            if sh.shutdown.load(Ordering::Relaxed) {
                return;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(128) {
                std::hint::spin_loop();
                continue;
            }
            let idle = t0.elapsed();
            if idle < SPIN {
                std::hint::spin_loop();
            } else if idle < SPIN + YIELD {
                std::thread::yield_now();
            } else {
                sh.sleepers.fetch_add(1, Ordering::SeqCst);
                if sh.state.load(Ordering::SeqCst) >> 32 == seen
                    && !sh.shutdown.load(Ordering::SeqCst)
                {
                    std::thread::park_timeout(Duration::from_millis(100));
                }
                sh.sleepers.fetch_sub(1, Ordering::SeqCst);
            }
        };
        seen = gen;
        if sh.shutdown.load(Ordering::Relaxed) {
            return;
        }
        let words = [
            sh.f_data.load(Ordering::Acquire),
            sh.f_vtable.load(Ordering::Acquire),
        ];
        let n_tasks = sh.n_tasks.load(Ordering::Acquire);
        // SAFETY: `claim` calls this only after a compare-and-swap proved that the job is
        // still generation `gen` with an unclaimed task. The words were read after observing
        // `gen`; the submitter changes them only after every task of `gen` completed and
        // after closing `gen` (so words or a count from a newer job make that compare-and-
        // swap fail), so they are exactly `gen`'s closure, alive until the task is done.
        let call = |i: usize| {
            let f = unsafe { std::mem::transmute::<[usize; 2], &(dyn Fn(usize) + Sync)>(words) };
            f(i)
        };
        claim(sh, gen, call, n_tasks);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        let s = self.shared.state.load(Ordering::SeqCst);
        self.shared
            .state
            .store(s.wrapping_add(1 << 32), Ordering::SeqCst);
        for w in &self.workers {
            w.thread().unpark();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// The number of physical cores, or of logical CPUs when that cannot be read.
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
        return logical;
    };
    let mut cores = std::collections::HashSet::new();
    let (mut phys, mut core) = (None, None);
    for line in info.lines() {
        let mut kv = line.splitn(2, ':').map(str::trim);
        match (kv.next(), kv.next()) {
            (Some("physical id"), Some(v)) => phys = Some(v.to_string()),
            (Some("core id"), Some(v)) => core = Some(v.to_string()),
            (Some(""), _) | (None, _) => {}
            _ => {}
        }
        if line.trim().is_empty() {
            if let (Some(p), Some(c)) = (phys.take(), core.take()) {
                cores.insert((p, c));
            }
        }
    }
    if cores.is_empty() {
        logical
    } else {
        cores.len().min(logical)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn runs_every_task_once() {
        for threads in [1, 2, 3, 4] {
            let pool = ThreadPool::new(threads);
            for n in [0, 1, 2, 7, 100, 1000] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                for _ in 0..20 {
                    pool.run(n, &|i| {
                        hits[i].fetch_add(1, Ordering::Relaxed);
                    });
                }
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 20));
            }
        }
    }

    #[test]
    fn nested_and_concurrent_calls_run() {
        let pool = Arc::new(ThreadPool::new(2));
        let total = AtomicUsize::new(0);
        pool.run(4, &|_| {
            pool.run(3, &|_| {
                total.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(total.load(Ordering::Relaxed), 12);
        let handles: Vec<_> = (0..3)
            .map(|_| {
                let p = Arc::clone(&pool);
                std::thread::spawn(move || {
                    let c = AtomicUsize::new(0);
                    for _ in 0..100 {
                        p.run(5, &|_| {
                            c.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                    c.load(Ordering::Relaxed)
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), 500);
        }
    }

    #[test]
    fn survives_sleeping_workers() {
        let pool = ThreadPool::new(2);
        let c = AtomicUsize::new(0);
        pool.run(2, &|_| {
            c.fetch_add(1, Ordering::Relaxed);
        });
        std::thread::sleep(Duration::from_millis(50));
        pool.run(2, &|_| {
            c.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(c.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn task_panic_propagates() {
        let pool = ThreadPool::new(2);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(8, &|i| {
                if i == 5 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        let c = AtomicUsize::new(0);
        pool.run(4, &|_| {
            c.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(c.load(Ordering::Relaxed), 4);
    }

    /// A worker that wakes late must never run a task of one call with the descriptor of
    /// the next (or after that call has returned): every task runs exactly once, inside
    /// its own call. Calls alternate task counts so a stale count would admit a claim.
    #[test]
    fn back_to_back_calls_never_mix() {
        for threads in [2, 3, 5] {
            let pool = ThreadPool::new(threads);
            let stray = AtomicUsize::new(0);
            for run in 0..100_000usize {
                let n = if run % 2 == 0 { 2 } else { 9 };
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                let live = std::sync::atomic::AtomicBool::new(true);
                pool.run(n, &|i| {
                    if !live.load(Ordering::SeqCst) {
                        stray.fetch_add(1, Ordering::SeqCst);
                    }
                    hits[i].fetch_add(1, Ordering::SeqCst);
                });
                live.store(false, Ordering::SeqCst);
                let counts: Vec<usize> = hits.iter().map(|h| h.load(Ordering::SeqCst)).collect();
                assert!(counts.iter().all(|&c| c == 1), "run {run}: {counts:?}");
            }
            assert_eq!(stray.load(Ordering::SeqCst), 0);
        }
    }
}
