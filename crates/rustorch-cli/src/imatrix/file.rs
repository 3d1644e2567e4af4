//! Importance-matrix files as llama.cpp 0.3.36 reads and writes them.
//!
//! * **GGUF** (what `llama-imatrix` writes by default): keys `general.type = "imatrix"`,
//!   `imatrix.datasets` (array of strings: the text files), `imatrix.chunk_count` and
//!   `imatrix.chunk_size` (u32); per weight matrix `NAME` (names sorted), the F32 tensors
//!   `NAME.in_sum2` of shape `[n_cols, n_mat]` (the sums over every row fed to the product of
//!   the squared activations, per input column, and per expert for MoE weights) and
//!   `NAME.counts` of shape `[1, n_mat]` (how many rows were summed); shapes written with
//!   trailing 1s dropped.
//! * **legacy `.dat`** (`--output-format dat`): `n_entries` (i32), then per entry (sorted by
//!   name) the name's length (i32) and bytes, `ncall` (i32, the chunks the entry saw,
//!   rounded up), `nval` (i32) and `nval` f32 values `sum / count · ncall`; then the chunk
//!   count (i32) and the text file's name (length i32 and bytes). All little-endian.
//!
//! [`load`] reads either (`common_imatrix_load`: GGUF when the file parses as GGUF, legacy
//! otherwise); [`Imatrix::weights`] gives the per-column importance `llama-quantize`
//! multiplies by.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, ensure, Context};
use rustorch_core::gguf::{GgufFile, GgufWriter, Value, ValueType};
use rustorch_core::GgmlType;

/// Sums and counts of one weight matrix (`Stats` in llama-imatrix).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Entry {
    /// `n_mat * n_cols` sums of squared activations, matrix (expert) by matrix.
    pub sums: Vec<f32>,
    /// Rows summed, one per matrix (one for a dense weight).
    pub counts: Vec<i64>,
}

/// An importance matrix (`common_imatrix`).
#[derive(Debug, Clone, Default)]
pub struct Imatrix {
    pub entries: BTreeMap<String, Entry>,
    pub datasets: Vec<String>,
    pub chunk_count: i32,
    pub chunk_size: i32,
    /// Read from a legacy `.dat` file: `sums` are `sum / count · ncall`, `counts` `[ncall]`.
    pub legacy: bool,
    /// The GGUF file had all three `imatrix.*` keys.
    pub has_metadata: bool,
}

impl Imatrix {
    /// The importance of each column, as `llama-quantize` makes it from the file: per
    /// matrix `sum / count` (1 for a matrix that saw no rows), or for a legacy file
    /// `value / ncall`.
    pub fn weights(&self) -> BTreeMap<String, Vec<f32>> {
        let mut out = BTreeMap::new();
        for (name, e) in &self.entries {
            let mut w = vec![0f32; e.sums.len()];
            if self.legacy {
                let ncall = e.counts.first().copied().unwrap_or(0);
                for (w, &s) in w.iter_mut().zip(&e.sums) {
                    *w = if ncall > 0 { s / ncall as f32 } else { s };
                }
            } else if !e.counts.is_empty() {
                let ne0 = e.sums.len() / e.counts.len();
                for (j, &c) in e.counts.iter().enumerate() {
                    let count = c as f32;
                    for i in 0..ne0 {
                        w[j * ne0 + i] = if count > 0.0 {
                            e.sums[j * ne0 + i] / count
                        } else {
                            1.0
                        };
                    }
                }
            }
            out.insert(name.clone(), w);
        }
        out
    }
}

/// `common_imatrix_load`: a GGUF imatrix, or else a legacy `.dat` file.
pub fn load(path: &Path) -> anyhow::Result<Imatrix> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read '{}'", path.display()))?;
    if bytes.starts_with(b"GGUF") {
        let g = GgufFile::from_bytes(bytes)
            .with_context(|| format!("reading the GGUF imatrix '{}'", path.display()))?;
        load_gguf(&g).with_context(|| format!("reading the imatrix '{}'", path.display()))
    } else {
        load_legacy(&bytes).with_context(|| format!("reading the imatrix '{}'", path.display()))
    }
}

fn load_gguf(g: &GgufFile) -> anyhow::Result<Imatrix> {
    ensure!(!g.tensors().is_empty(), "no data in file");
    let mut im = Imatrix::default();
    let datasets = g.get("imatrix.datasets");
    if let Some(Value::Array(ValueType::String, items)) = datasets {
        im.datasets = items
            .iter()
            .filter_map(|v| v.as_str().map(str::to_string))
            .collect();
    }
    let count = g.get("imatrix.chunk_count");
    let size = g.get("imatrix.chunk_size");
    im.has_metadata = datasets.is_some() && count.is_some() && size.is_some();
    im.chunk_count = count.and_then(Value::as_u64).unwrap_or(0) as i32;
    im.chunk_size = size.and_then(Value::as_u64).unwrap_or(0) as i32;
    // name -> (sums, counts), each once found
    type Pair = (Option<Vec<f32>>, Option<Vec<f32>>);
    let mut pairs: BTreeMap<String, Pair> = BTreeMap::new();
    for t in g.tensors() {
        let (name, is_sums) = if let Some(n) = t.name.strip_suffix(".in_sum2") {
            (n, true)
        } else if let Some(n) = t.name.strip_suffix(".counts") {
            (n, false)
        } else {
            continue;
        };
        if name.is_empty() {
            continue;
        }
        ensure!(
            t.ty == GgmlType::F32,
            "sums and counts for {name} must be F32 (found {})",
            t.ty
        );
        let v: Vec<f32> = g
            .tensor_data(t)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let slot = pairs.entry(name.to_string()).or_default();
        if is_sums {
            slot.0 = Some(v);
        } else {
            slot.1 = Some(v);
        }
    }
    for (name, (sums, counts)) in pairs {
        let (Some(sums), Some(counts)) = (sums, counts) else {
            bail!("mismatched sums and counts for {name}");
        };
        // llama.cpp rounds the stored counts to integers (std::lround)
        let counts = counts.iter().map(|&c| c.round() as i64).collect();
        im.entries.insert(name, Entry { sums, counts });
    }
    Ok(im)
}

/// Little-endian reads over a byte slice.
struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        let s = self.b.get(self.pos..self.pos.checked_add(n)?)?;
        self.pos += n;
        Some(s)
    }
    fn i32(&mut self) -> Option<i32> {
        self.take(4)
            .map(|s| i32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
}

fn load_legacy(bytes: &[u8]) -> anyhow::Result<Imatrix> {
    let mut r = Reader { b: bytes, pos: 0 };
    let n_entries = r.i32().unwrap_or(0);
    ensure!(
        n_entries >= 1,
        "no data in file (neither GGUF nor a legacy imatrix)"
    );
    let mut im = Imatrix {
        legacy: true,
        ..Imatrix::default()
    };
    for i in 0..n_entries {
        let len = r.i32().context("truncated")?;
        let name = usize::try_from(len)
            .ok()
            .and_then(|n| r.take(n))
            .with_context(|| format!("failed reading name for entry {}", i + 1))?;
        // (C reads the name as a C string: up to its first NUL)
        let name = name.split(|&c| c == 0).next().unwrap_or_default();
        let name = String::from_utf8_lossy(name).into_owned();
        let ncall = r.i32().context("truncated")?;
        let nval = r.i32().unwrap_or(0);
        ensure!(nval >= 1, "failed reading number of values for entry {i}");
        let data = r
            .take(nval as usize * 4)
            .with_context(|| format!("failed reading data for entry {i}"))?;
        let sums = data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        im.entries.insert(
            name,
            Entry {
                sums,
                counts: vec![i64::from(ncall)],
            },
        );
    }
    // the trailing chunk count and dataset name are optional
    if let Some(n) = r.i32() {
        im.chunk_count = n;
        if let Some(len) = r.i32().filter(|&l| l > 0) {
            if let Some(s) = r.take(len as usize) {
                let s = s.split(|&c| c == 0).next().unwrap_or_default();
                im.datasets.push(String::from_utf8_lossy(s).into_owned());
            }
        }
    }
    Ok(im)
}

/// What a save writes: the entries and the run's bookkeeping.
pub struct Save<'a> {
    pub entries: &'a BTreeMap<String, Entry>,
    pub datasets: &'a [String],
    /// Chunks processed (`m_last_chunk`).
    pub chunk_count: i32,
    /// Tokens per chunk (`n_ctx / n_parallel`).
    pub chunk_size: i32,
}

/// The GGUF file `save_imatrix` writes (every entry, even one with partial data).
pub fn to_gguf(s: &Save) -> anyhow::Result<Vec<u8>> {
    let mut w = GgufWriter::new();
    w.add("general.type", Value::String("imatrix".into()));
    w.add(
        "imatrix.datasets",
        Value::Array(
            ValueType::String,
            s.datasets
                .iter()
                .map(|d| Value::String(d.clone()))
                .collect(),
        ),
    );
    w.add("imatrix.chunk_count", Value::U32(s.chunk_count as u32));
    w.add("imatrix.chunk_size", Value::U32(s.chunk_size as u32));
    for (name, e) in s.entries {
        let nmat = e.counts.len();
        if e.sums.is_empty() || nmat == 0 {
            continue;
        }
        let ne0 = e.sums.len() / nmat;
        // ggml_n_dims: trailing 1s are not written
        let dims = |a: u64, b: u64| if b == 1 { vec![a] } else { vec![a, b] };
        let sums: Vec<u8> = e.sums.iter().flat_map(|v| v.to_le_bytes()).collect();
        let counts: Vec<u8> = e
            .counts
            .iter()
            .flat_map(|&c| (c as f32).to_le_bytes())
            .collect();
        w.add_tensor(
            format!("{name}.in_sum2"),
            GgmlType::F32,
            &dims(ne0 as u64, nmat as u64),
            sums,
        )?;
        w.add_tensor(
            format!("{name}.counts"),
            GgmlType::F32,
            &dims(1, nmat as u64),
            counts,
        )?;
    }
    Ok(w.to_bytes()?)
}

/// The legacy file `save_imatrix_legacy` writes: entries without any rows are skipped, and
/// an expert that saw none is stored as 1s.
pub fn to_legacy(s: &Save) -> Vec<u8> {
    let chunk = i64::from(s.chunk_size.max(1));
    let stored: Vec<(&String, &Entry)> = s
        .entries
        .iter()
        .filter(|(_, e)| !e.counts.is_empty() && e.counts.iter().any(|&c| c != 0))
        .collect();
    let mut out = Vec::new();
    out.extend_from_slice(&(stored.len() as i32).to_le_bytes());
    for (name, e) in stored {
        out.extend_from_slice(&(name.len() as i32).to_le_bytes());
        out.extend_from_slice(name.as_bytes());
        let max = e.counts.iter().copied().max().unwrap_or(0);
        let ncall = ((max + chunk - 1) / chunk) as i32;
        out.extend_from_slice(&ncall.to_le_bytes());
        let nval = e.sums.len();
        out.extend_from_slice(&(nval as i32).to_le_bytes());
        let per = nval / e.counts.len();
        for (i, &v) in e.sums.iter().enumerate() {
            let mut count = e.counts[i / per] as f32;
            let mut value = v;
            if count == 0.0 {
                value = 1.0;
                count = 1.0;
            }
            out.extend_from_slice(&((value / count) * ncall as f32).to_le_bytes());
        }
    }
    out.extend_from_slice(&s.chunk_count.to_le_bytes());
    let dataset = s.datasets.last().map(String::as_str).unwrap_or("");
    out.extend_from_slice(&(dataset.len() as i32).to_le_bytes());
    out.extend_from_slice(dataset.as_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> BTreeMap<String, Entry> {
        let mut m = BTreeMap::new();
        m.insert(
            "blk.0.attn_q.weight".to_string(),
            Entry {
                sums: vec![1.0, 4.0, 9.0, 16.0],
                counts: vec![2],
            },
        );
        m.insert(
            "blk.0.ffn_up_exps.weight".to_string(),
            Entry {
                sums: vec![2.0, 2.0, 5.0, 5.0],
                counts: vec![2, 0],
            },
        );
        m
    }

    #[test]
    fn gguf_round_trip_and_weights() {
        let entries = sample();
        let datasets = vec!["text.txt".to_string()];
        let bytes = to_gguf(&Save {
            entries: &entries,
            datasets: &datasets,
            chunk_count: 3,
            chunk_size: 128,
        })
        .unwrap();
        let g = GgufFile::from_bytes(bytes).unwrap();
        let im = load_gguf(&g).unwrap();
        assert!(im.has_metadata && !im.legacy);
        assert_eq!((im.chunk_count, im.chunk_size), (3, 128));
        assert_eq!(im.datasets, datasets);
        assert_eq!(im.entries, entries);
        let w = im.weights();
        assert_eq!(w["blk.0.attn_q.weight"], vec![0.5, 2.0, 4.5, 8.0]);
        // an expert without rows weighs 1
        assert_eq!(w["blk.0.ffn_up_exps.weight"], vec![1.0, 1.0, 1.0, 1.0]);
    }

    #[test]
    fn legacy_round_trip() {
        let entries = sample();
        let datasets = vec!["a.txt".to_string()];
        let bytes = to_legacy(&Save {
            entries: &entries,
            datasets: &datasets,
            chunk_count: 1,
            chunk_size: 2,
        });
        let im = load_legacy(&bytes).unwrap();
        assert!(im.legacy);
        assert_eq!(im.chunk_count, 1);
        assert_eq!(im.datasets, datasets);
        // ncall = ceil(2 / 2) = 1: values are the means
        assert_eq!(
            im.weights()["blk.0.attn_q.weight"],
            vec![0.5, 2.0, 4.5, 8.0]
        );
        assert_eq!(
            im.weights()["blk.0.ffn_up_exps.weight"],
            vec![1.0, 1.0, 1.0, 1.0]
        );
        assert!(load_legacy(&[0, 0, 0, 0]).is_err());
        assert!(load_legacy(&[1, 0, 0, 0, 200, 0, 0, 0]).is_err());
    }
}
