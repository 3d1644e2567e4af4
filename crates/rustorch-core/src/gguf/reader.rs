//! Reading GGUF files. Every length read from the file is checked against the bytes
//! that remain before anything is allocated, so a corrupt file gives an error, never an
//! allocation larger than the file.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use memmap2::Mmap;

use super::error::GgufError;
use super::value::{Value, ValueType};
use super::{DEFAULT_ALIGNMENT, MAGIC};
use crate::types::GgmlType;

/// Most dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// Deepest nesting of arrays inside arrays that the reader accepts.
pub const MAX_NESTING: usize = 4;

/// One entry of the tensor directory.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions in ggml order: `dims[0]` is the row length (contiguous).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset of the data, relative to the start of the data section.
    pub offset: u64,
    /// Size of the data in bytes.
    pub n_bytes: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
    /// Row length (`ne[0]`).
    pub fn ne0(&self) -> usize {
        self.dims.first().copied().unwrap_or(1) as usize
    }
    /// Number of rows (product of all dimensions but the first).
    pub fn n_rows(&self) -> usize {
        self.dims.iter().skip(1).product::<u64>() as usize
    }
}

/// Fills the byte ranges `ranges` (sorted, disjoint `[start, end)`) of `buf` from the same
/// offsets of `file`, in pieces of whole 2 MiB pages read by up to 4 threads.
fn read_ranges(file: &File, buf: &mut [u8], ranges: &[(usize, usize)]) -> std::io::Result<()> {
    let n = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 4);
    let total: usize = ranges.iter().map(|&(a, b)| b - a).sum();
    let part = total.div_ceil(n).max(1).next_multiple_of(2 << 20);
    let mut pieces: Vec<(usize, &mut [u8])> = Vec::new();
    let (mut rest, mut done) = (buf, 0usize);
    for &(a, b) in ranges {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(a - done);
        let (mut range, tail) = tail.split_at_mut(b - a);
        (rest, done) = (tail, b);
        let mut off = a;
        while !range.is_empty() {
            let k = part.min(range.len());
            let (piece, r) = std::mem::take(&mut range).split_at_mut(k);
            pieces.push((off, piece));
            (range, off) = (r, off + k);
        }
    }
    std::thread::scope(|s| {
        let jobs: Vec<_> = pieces
            .into_iter()
            .map(|(off, piece)| s.spawn(move || read_at(file, piece, off as u64)))
            .collect();
        jobs.into_iter().try_for_each(|j| {
            j.join()
                .unwrap_or_else(|_| Err(std::io::Error::other("reader panicked")))
        })
    })
}

/// Maps `[start, end)` of `file` (page-aligned) read-only at the same offset of the anonymous
/// region `region`, over what was there. False where that is not possible.
#[cfg(unix)]
fn map_file_over(file: &File, region: &mut [u8], start: usize, end: usize) -> bool {
    use std::os::fd::AsRawFd;
    if end <= start || end > region.len() {
        return false;
    }
    let Ok(off) = libc::off_t::try_from(start) else {
        return false;
    };
    // SAFETY: the target lies inside `region`, a private anonymous mapping this function's
    // caller owns and that nothing borrows while it runs; MAP_FIXED replaces those pages.
    let p = unsafe {
        libc::mmap(
            region.as_mut_ptr().add(start).cast(),
            end - start,
            libc::PROT_READ,
            libc::MAP_PRIVATE | libc::MAP_FIXED,
            file.as_raw_fd(),
            off,
        )
    };
    p != libc::MAP_FAILED
}

#[cfg(not(unix))]
fn map_file_over(_: &File, _: &mut [u8], _: usize, _: usize) -> bool {
    false
}

#[cfg(unix)]
fn read_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
}

#[cfg(not(unix))]
fn read_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = file.try_clone()?;
    f.seek(SeekFrom::Start(offset))?;
    f.read_exact(buf)
}

enum Storage {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// An open GGUF file. Tensor data is borrowed from the memory map (or from the one copy
/// [`GgufFile::open_in_memory`] reads), never copied per tensor.
pub struct GgufFile {
    storage: Storage,
    version: u32,
    metadata: Vec<(String, Value)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("n_metadata", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

impl GgufFile {
    /// Opens and memory-maps `path`, then parses and validates the header.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref();
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(io)?;
        if meta.is_dir() {
            return Err(GgufError::IsDirectory(path.to_path_buf()));
        }
        let file = File::open(path).map_err(io)?;
        if meta.len() == 0 {
            return Self::parse(Storage::Owned(Vec::new()));
        }
        // SAFETY: the map is read-only; as with any mmap, a file truncated by another
        // process while mapped is outside what we can defend against.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(Storage::Mapped(map))
    }

    /// Opens `path` and reads it into anonymous memory that the kernel may back with 2 MiB
    /// pages: [`GgufFile::open`] then [`GgufFile::into_memory`].
    pub fn open_in_memory(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        Self::open(&path)?.into_memory(path)
    }

    /// This file (opened from `path`) with its bytes read into anonymous memory that the
    /// kernel may back with 2 MiB pages (`MADV_HUGEPAGE`); the parsed header is kept.
    /// Decoding streams every weight once per token: from a file mapping (4 KiB pages) the
    /// TLB misses at every page and the hardware prefetchers stop at every page boundary,
    /// which costs about 15% of the CPU's decode speed; the price is the time to read the
    /// file and memory the page cache could otherwise share. The token embeddings, when a
    /// separate output matrix exists, are only looked up a row at a time: their whole pages
    /// stay a map of the file.
    pub fn into_memory(mut self, path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref();
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let len = self.storage.bytes().len();
        if len == 0 {
            return Ok(self);
        }
        let file = File::open(path).map_err(io)?;
        if file.metadata().map_err(io)?.len() != len as u64 {
            return Err(io(std::io::Error::other(
                "the file changed size while it was being loaded",
            )));
        }
        let hole = match (
            self.tensor("token_embd.weight"),
            self.tensor("output.weight"),
        ) {
            (Ok((_, e)), Ok(_)) => {
                let page = 4096;
                let start = e.as_ptr() as usize - self.storage.bytes().as_ptr() as usize;
                (
                    start.next_multiple_of(page),
                    (start + e.len()) / page * page,
                )
            }
            _ => (0, 0),
        };
        let mut anon = memmap2::MmapOptions::new()
            .len(len)
            .map_anon()
            .map_err(io)?;
        // advice only: without transparent huge pages the memory is ordinary
        #[cfg(target_os = "linux")]
        let _ = anon.advise(memmap2::Advice::HugePage);
        let ranges = if map_file_over(&file, &mut anon[..], hole.0, hole.1) {
            vec![(0, hole.0), (hole.1, len)]
        } else {
            vec![(0, len)]
        };
        // several readers: the kernel's first touch of fresh memory (zeroing it) dominates
        read_ranges(&file, &mut anon[..], &ranges).map_err(io)?;
        // the header parsed from the map describes these identical bytes
        self.storage = Storage::Mapped(anon.make_read_only().map_err(io)?);
        Ok(self)
    }

    /// Parses a GGUF image held in memory (tests, fuzzing, embedded data).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::parse(Storage::Owned(bytes))
    }

    fn parse(storage: Storage) -> Result<Self, GgufError> {
        let bytes = storage.bytes();
        let mut c = Cursor { bytes, pos: 0 };
        let magic = c.take(4, "magic")?;
        if magic != MAGIC {
            return Err(GgufError::BadMagic {
                found: magic.to_vec(),
            });
        }
        let version = c.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion { version });
        }
        let n_tensors = c.u64("tensor count")?;
        let n_kv = c.u64("metadata count")?;
        // Each key/value takes at least 13 bytes, each tensor info at least 24. The
        // offsets are those of the counts in the header (8 and 16).
        c.check_count(n_kv, 13, "metadata count", 16)?;

        let mut metadata = Vec::new();
        let mut key_index = HashMap::new();
        for _ in 0..n_kv {
            let key_offset = c.pos as u64;
            let key = c.string("metadata key")?;
            let tag_offset = c.pos as u64;
            let tag = c.u32("value type")?;
            let ty = ValueType::from_id(tag).ok_or_else(|| GgufError::UnknownValueType {
                key: key.clone(),
                offset: tag_offset,
                type_id: tag,
            })?;
            let value = c.value(ty, &key, 0)?;
            if key_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::DuplicateKey {
                    key,
                    offset: key_offset,
                });
            }
            metadata.push((key, value));
        }

        let alignment = match key_index.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(&i) => {
                let v = metadata[i].1.as_u64().unwrap_or(0);
                if v == 0 || !v.is_power_of_two() {
                    return Err(GgufError::BadAlignment { value: v });
                }
                v
            }
        };

        c.check_count(n_tensors, 24, "tensor count", 8)?;
        let mut tensors = Vec::new();
        let mut tensor_index = HashMap::new();
        for _ in 0..n_tensors {
            let info_offset = c.pos as u64;
            let name = c.string("tensor name")?;
            let n_dims = c.u32("tensor n_dims")?;
            if n_dims as usize > MAX_DIMS {
                return Err(GgufError::TooManyDims {
                    name,
                    offset: info_offset,
                    n_dims,
                    max: MAX_DIMS,
                });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for d in 0..n_dims as usize {
                let dim_offset = c.pos as u64;
                let v = c.u64("tensor dimension")?;
                if v > i64::MAX as u64 {
                    return Err(GgufError::BadDimension {
                        name,
                        offset: dim_offset,
                        dim: d,
                        value: v,
                    });
                }
                dims.push(v);
            }
            let type_offset = c.pos as u64;
            let type_id = c.u32("tensor type")?;
            let ty = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownTensorType {
                name: name.clone(),
                offset: type_offset,
                type_id,
            })?;
            let offset = c.u64("tensor offset")?;
            let n_elements = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .filter(|&n| n <= i64::MAX as u64)
                .ok_or_else(|| GgufError::ElementCountOverflow {
                    name: name.clone(),
                    shape: dims.clone(),
                })?;
            let ne0 = dims.first().copied().unwrap_or(1);
            if !ne0.is_multiple_of(ty.block_size() as u64) {
                return Err(GgufError::NotBlockAligned {
                    name,
                    ty,
                    ne0,
                    block: ty.block_size(),
                });
            }
            let n_bytes =
                ty.bytes_for(n_elements)
                    .ok_or_else(|| GgufError::ElementCountOverflow {
                        name: name.clone(),
                        shape: dims.clone(),
                    })?;
            if !offset.is_multiple_of(alignment) {
                return Err(GgufError::TensorMisaligned {
                    name,
                    offset,
                    alignment,
                });
            }
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                return Err(GgufError::DuplicateTensor {
                    name,
                    offset: info_offset,
                });
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset,
                n_bytes,
            });
        }

        let data_offset = align_up(c.pos as u64, alignment);
        let file_len = bytes.len() as u64;
        for t in &tensors {
            let end = data_offset
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(t.n_bytes));
            if end.is_none_or(|e| e > file_len) {
                return Err(GgufError::TensorOutOfBounds {
                    name: t.name.clone(),
                    offset: data_offset.saturating_add(t.offset),
                    size: t.n_bytes,
                    file_len,
                });
            }
        }

        Ok(GgufFile {
            storage,
            version,
            metadata,
            key_index,
            tensors,
            tensor_index,
            alignment,
            data_offset,
        })
    }

    pub fn version(&self) -> u32 {
        self.version
    }
    pub fn alignment(&self) -> u64 {
        self.alignment
    }
    /// Absolute file offset where the data section starts.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }
    /// Size of the whole file in bytes.
    pub fn file_size(&self) -> u64 {
        self.storage.bytes().len() as u64
    }
    /// Metadata in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }
    /// Bytes of all tensor data (the weights).
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors().iter().map(|t| t.n_bytes).sum()
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey {
            key: key.to_string(),
        })
    }

    fn wrong(key: &str, expected: &'static str, v: &Value) -> GgufError {
        GgufError::WrongType {
            key: key.to_string(),
            expected,
            found: v.type_name(),
        }
    }

    /// An integer key that fits in u32.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        let v = self.require(key)?;
        v.as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(|| Self::wrong(key, "UINT32", v))
    }

    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.require(key)?;
        v.as_u64().ok_or_else(|| Self::wrong(key, "UINT64", v))
    }

    pub fn get_i64(&self, key: &str) -> Result<i64, GgufError> {
        let v = self.require(key)?;
        v.as_i64().ok_or_else(|| Self::wrong(key, "INT64", v))
    }

    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        let v = self.require(key)?;
        v.as_f64()
            .map(|x| x as f32)
            .ok_or_else(|| Self::wrong(key, "FLOAT32", v))
    }

    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        let v = self.require(key)?;
        v.as_bool().ok_or_else(|| Self::wrong(key, "BOOL", v))
    }

    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| Self::wrong(key, "STRING", v))
    }

    fn get_array(&self, key: &str, expected: &'static str) -> Result<&[Value], GgufError> {
        let v = self.require(key)?;
        v.as_array().ok_or_else(|| Self::wrong(key, expected, v))
    }

    pub fn get_string_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        let items = self.get_array(key, "ARRAY[STRING]")?;
        items
            .iter()
            .map(|x| x.as_str())
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                Self::wrong(key, "ARRAY[STRING]", self.get(key).unwrap_or(&Value::U8(0)))
            })
    }

    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>, GgufError> {
        let items = self.get_array(key, "ARRAY[FLOAT32]")?;
        items
            .iter()
            .map(|x| x.as_f64().map(|f| f as f32))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                Self::wrong(
                    key,
                    "ARRAY[FLOAT32]",
                    self.get(key).unwrap_or(&Value::U8(0)),
                )
            })
    }

    pub fn get_i64_array(&self, key: &str) -> Result<Vec<i64>, GgufError> {
        let items = self.get_array(key, "ARRAY[INT]")?;
        items
            .iter()
            .map(|x| x.as_i64())
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| Self::wrong(key, "ARRAY[INT]", self.get(key).unwrap_or(&Value::U8(0))))
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.get_str("general.architecture")
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor, borrowed from the map.
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        // Bounds were validated when the file was parsed.
        let start = (self.data_offset + info.offset) as usize;
        &self.storage.bytes()[start..start + info.n_bytes as usize]
    }

    /// Looks a tensor up by name and returns its info and bytes.
    pub fn tensor(&self, name: &str) -> Result<(&TensorInfo, &[u8]), GgufError> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| GgufError::MissingTensor {
                name: name.to_string(),
            })?;
        Ok((info, self.tensor_data(info)))
    }

    /// The whole file image.
    pub fn bytes(&self) -> &[u8] {
        self.storage.bytes()
    }
}

pub(crate) fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// What is being read, for error messages; turned into text only on error.
trait Describe: Copy {
    fn describe(self) -> String;
}

impl Describe for &str {
    fn describe(self) -> String {
        self.to_string()
    }
}

/// The value of a metadata key.
#[derive(Clone, Copy)]
struct ValueOf<'k>(&'k str);

impl Describe for ValueOf<'_> {
    fn describe(self) -> String {
        format!("value of '{}'", self.0)
    }
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn take(&mut self, n: usize, what: impl Describe) -> Result<&'a [u8], GgufError> {
        if (n as u64) > self.remaining() {
            return Err(GgufError::Truncated {
                what: what.describe(),
                offset: self.pos as u64,
                needed: n as u64,
                available: self.remaining(),
            });
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: impl Describe) -> Result<[u8; N], GgufError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: impl Describe) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: impl Describe) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Fails unless `count` items of at least `min_size` bytes could fit in what is
    /// left; `offset` is where the count itself was read.
    fn check_count(
        &self,
        count: u64,
        min_size: u64,
        what: &str,
        offset: u64,
    ) -> Result<(), GgufError> {
        if count.saturating_mul(min_size) > self.remaining() {
            return Err(GgufError::LengthBeyondFile {
                what: what.describe(),
                offset,
                len: count,
                available: self.remaining(),
            });
        }
        Ok(())
    }

    fn string(&mut self, what: impl Describe) -> Result<String, GgufError> {
        let offset = self.pos as u64;
        let len = self.u64(what)?;
        if len > self.remaining() {
            return Err(GgufError::LengthBeyondFile {
                what: what.describe(),
                offset,
                len,
                available: self.remaining(),
            });
        }
        let raw = self.take(len as usize, what)?;
        String::from_utf8(raw.to_vec()).map_err(|_| GgufError::InvalidUtf8 {
            what: what.describe(),
            offset: offset + 8,
        })
    }

    fn value(&mut self, ty: ValueType, key: &str, depth: usize) -> Result<Value, GgufError> {
        // Described only if something goes wrong: formatting the key for every value
        // read made parsing a large vocabulary several times slower.
        let what = ValueOf(key);
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>(what)?[0]),
            ValueType::I8 => Value::I8(self.array::<1>(what)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array(what)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array(what)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            ValueType::Bool => Value::Bool(self.array::<1>(what)?[0] != 0),
            ValueType::String => Value::String(self.string(what)?),
            ValueType::Array => {
                let offset = self.pos as u64;
                if depth >= MAX_NESTING {
                    return Err(GgufError::NestingTooDeep {
                        key: key.to_string(),
                        offset,
                        max: MAX_NESTING,
                    });
                }
                let tag = self.u32(what)?;
                let elem = ValueType::from_id(tag).ok_or_else(|| GgufError::UnknownValueType {
                    key: key.to_string(),
                    offset,
                    type_id: tag,
                })?;
                let len_offset = self.pos as u64;
                let len = self.u64(what)?;
                if len.saturating_mul(elem.min_size()) > self.remaining() {
                    return Err(GgufError::LengthBeyondFile {
                        what: format!("array '{key}'"),
                        offset: len_offset,
                        len,
                        available: self.remaining(),
                    });
                }
                let mut items = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                Value::Array(elem, items)
            }
        })
    }
}
