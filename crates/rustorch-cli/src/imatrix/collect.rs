//! The collector: llama-imatrix's `IMatrixCollector::collect_imatrix` as a
//! [`ProductObserver`] of the CPU backend.
//!
//! Per weight matrix it sums, over every activation row the product multiplies, the square
//! of each input column (`acc[j] += x[j]·x[j]`, in f32, rows in batch order) and counts the
//! rows. As llama.cpp's callback it takes:
//!
//! * dense products (`MUL_MAT`) of weights named `blk.*` (and `output.weight` with
//!   `--process-output`) whose input has at least 16 rows (`src1->ne[1] < 16` is skipped);
//! * every expert product (`MUL_MAT_ID`), per expert: slot by slot, and within a slot batch
//!   row by batch row, each row added to the expert the router gave that slot.
//!
//! When a count passes a multiple of the chunk size the chunk counter advances and, every
//! `--output-frequency` chunks (and `--save-frequency` into `OUT.at_N`), the file is saved as
//! it stands, exactly when llama-imatrix saves it.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Mutex;

use rustorch_core::backend::WeightRef;
use rustorch_core::gguf::GgufFile;
use rustorch_llm::model::ProductObserver;

use super::file::{self, Entry, Save};

/// How and where the collected matrix is saved.
pub struct SaveParams {
    pub out: PathBuf,
    /// Write the legacy `.dat` format instead of GGUF.
    pub legacy: bool,
    /// Tokens per chunk (`n_ctx / n_parallel`).
    pub chunk_size: i64,
    /// Save every this many chunks (`--output-frequency`).
    pub out_freq: i32,
    /// Also save a copy `OUT.at_N` every this many chunks (0: never).
    pub save_freq: i32,
    /// Text files the matrix was computed from (earlier ones from `--in-file` first).
    pub datasets: Vec<String>,
}

/// What the observer accumulates.
#[derive(Default)]
struct State {
    stats: BTreeMap<String, Entry>,
    /// Chunks processed, as llama-imatrix counts them (`m_last_chunk`).
    last_chunk: i32,
    /// The first error met inside a forward call (reported after it).
    error: Option<String>,
}

/// Collects the importance matrix of one model's forward calls.
pub struct Collector {
    /// Weight tensors by the byte offset of their data in the mapped file.
    names: HashMap<usize, String>,
    process_output: bool,
    save: SaveParams,
    state: Mutex<State>,
}

impl Collector {
    pub fn new(gguf: &GgufFile, process_output: bool, save: SaveParams) -> Self {
        let base = gguf.data_offset();
        let names = gguf
            .tensors()
            .iter()
            .map(|t| ((base + t.offset) as usize, t.name.clone()))
            .collect();
        Collector {
            names,
            process_output,
            save,
            state: Mutex::new(State::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds earlier results (`--in-file`), as llama-imatrix's `load_imatrix`: a legacy file's
    /// means are scaled back to sums of `chunk_size` rows per chunk.
    pub fn load(&self, im: &file::Imatrix) -> anyhow::Result<()> {
        let mut st = self.lock();
        let chunk = self.save.chunk_size;
        for (name, entry) in &im.entries {
            let e = st.stats.entry(name.clone()).or_default();
            if im.legacy {
                if e.sums.is_empty() {
                    e.sums = vec![0.0; entry.sums.len()];
                    e.counts = vec![0];
                }
                for (v, &s) in e.sums.iter_mut().zip(&entry.sums) {
                    *v += s * chunk as f32;
                }
                let add = entry.counts.first().copied().unwrap_or(0) * chunk;
                for c in e.counts.iter_mut() {
                    *c += add;
                }
            } else {
                if e.sums.is_empty() {
                    e.sums = vec![0.0; entry.sums.len()];
                } else if e.sums.len() != entry.sums.len() {
                    anyhow::bail!(
                        "mismatched sums size for {name}: {} != {}",
                        entry.sums.len(),
                        e.sums.len()
                    );
                }
                if e.counts.is_empty() {
                    e.counts = vec![0; entry.counts.len()];
                } else if e.counts.len() == 1 && entry.counts.len() > 1 {
                    e.counts = vec![e.counts[0]; entry.counts.len()];
                } else if e.counts.len() != entry.counts.len() {
                    anyhow::bail!(
                        "mismatched counts size for {name}: {} != {}",
                        entry.counts.len(),
                        e.counts.len()
                    );
                }
                for (v, &s) in e.sums.iter_mut().zip(&entry.sums) {
                    *v += s;
                }
                for (c, &n) in e.counts.iter_mut().zip(&entry.counts) {
                    *c += n;
                }
            }
        }
        let max = st
            .stats
            .values()
            .flat_map(|e| e.counts.iter().copied())
            .max()
            .unwrap_or(0);
        st.last_chunk = (max / chunk.max(1)) as i32;
        Ok(())
    }

    /// The error an observed product ran into, if any (the run must stop).
    pub fn error(&self) -> Option<String> {
        self.lock().error.clone()
    }

    /// Writes the matrix as it stands to OUT (`n_chunk`: to `OUT.at_N`).
    pub fn save(&self, n_chunk: Option<i32>) -> anyhow::Result<()> {
        let st = self.lock();
        self.write(&st, n_chunk)
    }

    fn write(&self, st: &State, n_chunk: Option<i32>) -> anyhow::Result<()> {
        let mut path = self.save.out.clone().into_os_string();
        if let Some(n) = n_chunk.filter(|&n| n > 0) {
            path.push(format!(".at_{n}"));
        }
        let path = PathBuf::from(path);
        let s = Save {
            entries: &st.stats,
            datasets: &self.save.datasets,
            chunk_count: st.last_chunk,
            chunk_size: self.save.chunk_size as i32,
        };
        let bytes = if self.save.legacy {
            file::to_legacy(&s)
        } else {
            file::to_gguf(&s)?
        };
        std::fs::write(&path, bytes)
            .map_err(|e| anyhow::anyhow!("cannot write '{}': {e}", path.display()))?;
        // llama-imatrix ends each save with a newline on stdout (between its perplexity
        // values too); so do we, for the same output
        println!();
        Ok(())
    }

    /// Entries with experts (or whole matrices) that never saw a row, for the warnings
    /// llama-imatrix prints when saving: (name, percent of matrices with data).
    pub fn partial(&self) -> Vec<(String, f32)> {
        self.lock()
            .stats
            .iter()
            .filter_map(|(n, e)| {
                let zeros = e.counts.iter().filter(|&&c| c == 0).count();
                (zeros > 0).then(|| {
                    let all = e.counts.len();
                    (n.clone(), 100.0 * (all - zeros) as f32 / all as f32)
                })
            })
            .collect()
    }

    pub fn n_entries(&self) -> usize {
        self.lock().stats.len()
    }

    pub fn last_chunk(&self) -> i32 {
        self.lock().last_chunk
    }

    /// After a count grew to `count`: advance the chunk counter and save as llama-imatrix.
    fn after_count(&self, st: &mut State, count: i64) {
        let n_chunk = (count / self.save.chunk_size.max(1)) as i32;
        if n_chunk <= st.last_chunk {
            return;
        }
        let step = n_chunk - st.last_chunk;
        st.last_chunk = n_chunk;
        let due = |freq: i32| freq > 0 && (n_chunk % freq) / step == 0;
        let (save, copy) = (due(self.save.out_freq), due(self.save.save_freq));
        if save {
            if let Err(e) = self.write(st, None) {
                st.error.get_or_insert(format!("{e:#}"));
            }
        }
        if copy {
            if let Err(e) = self.write(st, Some(n_chunk)) {
                st.error.get_or_insert(format!("{e:#}"));
            }
        }
    }
}

fn all_finite(v: &[f32]) -> bool {
    v.iter().all(|x| x.is_finite())
}

impl ProductObserver for Collector {
    fn product(&self, w: &WeightRef, x: &[f32]) {
        let Some(name) = self.names.get(&w.start) else {
            return; // a row block after the first of a fused weight (phi3)
        };
        let ne0 = w.n_cols;
        let rows = x.len() / ne0.max(1);
        if rows < 16 {
            return;
        }
        if !(name.starts_with("blk.") || (self.process_output && name == "output.weight")) {
            return;
        }
        let mut st = self.lock();
        if st.error.is_some() {
            return;
        }
        let e = st.stats.entry(name.clone()).or_default();
        // one count per dense matrix (an older file's equal per-expert counts fold to one)
        if e.counts.len() > 1 && e.counts.iter().all(|&c| c == e.counts[0]) {
            e.counts.truncate(1);
        }
        if e.sums.is_empty() {
            e.sums = vec![0.0; ne0];
            e.counts = vec![0];
        } else if e.sums.len() != ne0 {
            let msg = format!("inconsistent size for {name} ({} vs {ne0})", e.sums.len());
            st.error = Some(msg);
            return;
        }
        for row in x.chunks_exact(ne0) {
            for (acc, &v) in e.sums.iter_mut().zip(row) {
                *acc += v * v;
            }
        }
        if !all_finite(&e.sums) {
            st.error = Some(format!("non-finite values detected in {name}"));
            return;
        }
        let counts: Vec<i64> = e
            .counts
            .iter_mut()
            .map(|c| {
                *c += rows as i64;
                *c
            })
            .collect();
        for c in counts {
            self.after_count(&mut st, c);
        }
    }

    fn expert_product(
        &self,
        experts: &[WeightRef],
        ids: &[usize],
        k: usize,
        x: &[f32],
        per_slot: bool,
    ) {
        let Some(first) = experts.first() else {
            return;
        };
        let Some(name) = self.names.get(&first.start) else {
            return;
        };
        let (n_as, ne0) = (experts.len(), first.n_cols);
        let n_tokens = ids.len() / k.max(1);
        let mut st = self.lock();
        if st.error.is_some() {
            return;
        }
        let e = st.stats.entry(name.clone()).or_default();
        if e.counts.len() == 1 && n_as > 1 {
            // broadcast, when loading an old imatrix
            e.counts = vec![e.counts[0]; n_as];
        }
        if e.sums.is_empty() {
            e.sums = vec![0.0; ne0 * n_as];
            e.counts = vec![0; n_as];
        } else if e.sums.len() != ne0 * n_as {
            let msg = format!(
                "inconsistent size for {name} ({} vs {})",
                e.sums.len(),
                ne0 * n_as
            );
            st.error = Some(msg);
            return;
        } else if e.counts.len() != n_as {
            let msg = format!(
                "inconsistent expert count for {name} ({} vs {n_as})",
                e.counts.len()
            );
            st.error = Some(msg);
            return;
        }
        let mut touched = vec![false; n_as];
        for slot in 0..k {
            for row in 0..n_tokens {
                let ex = ids[row * k + slot];
                if ex >= n_as {
                    continue;
                }
                let r = if per_slot { row * k + slot } else { row };
                let xr = &x[r * ne0..(r + 1) * ne0];
                e.counts[ex] += 1;
                touched[ex] = true;
                for (acc, &v) in e.sums[ex * ne0..(ex + 1) * ne0].iter_mut().zip(xr) {
                    *acc += v * v;
                }
            }
        }
        for (ex, &t) in touched.iter().enumerate() {
            if t && !all_finite(&e.sums[ex * ne0..(ex + 1) * ne0]) {
                st.error = Some(format!("non-finite values detected in {name}"));
                return;
            }
        }
        let counts = e.counts.clone();
        for c in counts {
            self.after_count(&mut st, c);
        }
    }
}
