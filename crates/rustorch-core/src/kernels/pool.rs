//! A fixed pool of worker threads for splitting kernels into tasks. Threads are started
//! once; a parallel call only hands out task indices, it never spawns.

pub struct ThreadPool {
    inner: Option<rayon::ThreadPool>,
    n_threads: usize,
}

impl ThreadPool {
    /// A pool of `n_threads` threads (the calling thread counts as one while it waits).
    pub fn new(n_threads: usize) -> Self {
        let n_threads = n_threads.max(1);
        let inner = if n_threads > 1 {
            rayon::ThreadPoolBuilder::new()
                .num_threads(n_threads)
                .thread_name(|i| format!("rustorch-worker-{i}"))
                .build()
                .ok()
        } else {
            None
        };
        let n_threads = if inner.is_some() { n_threads } else { 1 };
        ThreadPool { inner, n_threads }
    }

    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Runs `f(i)` for every `i` in `0..n_tasks`, spread over the pool, and returns when
    /// all are done.
    pub fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        match &self.inner {
            Some(pool) if n_tasks > 1 => pool.install(|| {
                use rayon::prelude::*;
                (0..n_tasks).into_par_iter().for_each(f);
            }),
            _ => (0..n_tasks).for_each(f),
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
