//! Malformed GGUF input: each case builds a byte image by hand and asserts the exact
//! `GgufError` variant, the key / tensor / offset it names, and that its message says
//! so. Lengths taken from the file (strings, arrays, counts) must never drive an
//! allocation larger than the file: a tracking allocator checks the largest single
//! allocation made while parsing.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};

use rustorch_core::gguf::{
    GgufError, GgufFile, GgufWriter, Value, ValueType, MAX_DIMS, MAX_NESTING,
};
use rustorch_core::GgmlType;

// ---------------------------------------------------------------------------
// Largest single allocation, per thread (tests run on several threads).
// ---------------------------------------------------------------------------

struct Tracking;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = LARGEST.try_with(|l| {
        if size > l.get() {
            l.set(size);
        }
    });
}

unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc_zeroed(layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        System.realloc(ptr, layout, new_size)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static ALLOC: Tracking = Tracking;

/// Parses `bytes`; also returns the largest allocation made while parsing.
fn parse(bytes: Vec<u8>) -> (Result<GgufFile, GgufError>, usize) {
    LARGEST.with(|l| l.set(0));
    let r = GgufFile::from_bytes(bytes);
    (r, LARGEST.with(Cell::get))
}

/// The error `bytes` must give; also checks that parsing allocated little.
#[track_caller]
fn err(bytes: Vec<u8>) -> GgufError {
    let len = bytes.len();
    match parse(bytes) {
        (Ok(f), _) => panic!("parsed a malformed image: {f:?}"),
        (Err(e), largest) => {
            assert!(
                largest <= 64 * 1024 + 32 * len,
                "largest allocation {largest} bytes for a {len}-byte image ({e})"
            );
            e
        }
    }
}

#[track_caller]
fn says(e: &GgufError, needles: &[&str]) {
    let msg = e.to_string();
    for n in needles {
        assert!(msg.contains(n), "message {msg:?} lacks {n:?}");
    }
}

// ---------------------------------------------------------------------------
// Byte images
// ---------------------------------------------------------------------------

const U8: u32 = ValueType::U8 as u32;
const U32: u32 = ValueType::U32 as u32;
const STRING: u32 = ValueType::String as u32;
const ARRAY: u32 = ValueType::Array as u32;
const F32: u32 = GgmlType::F32 as u32;

/// A GGUF image written field by field; `pos()` gives the offset of what comes next.
#[derive(Clone)]
struct Image(Vec<u8>);

impl Image {
    fn new(version: u32, n_tensors: u64, n_kv: u64) -> Self {
        let mut i = Image(b"GGUF".to_vec());
        i.u32(version).u64(n_tensors).u64(n_kv);
        i
    }
    fn v3(n_tensors: u64, n_kv: u64) -> Self {
        Self::new(3, n_tensors, n_kv)
    }
    fn pos(&self) -> u64 {
        self.0.len() as u64
    }
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn raw(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64).raw(s.as_bytes())
    }
    fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.str(key).u32(U32).u32(v)
    }
    fn kv_str(&mut self, key: &str, v: &str) -> &mut Self {
        self.str(key).u32(STRING).str(v)
    }
    /// Key, ARRAY tag, element type and length; the items are up to the caller.
    fn kv_array(&mut self, key: &str, elem: u32, len: u64) -> &mut Self {
        self.str(key).u32(ARRAY).u32(elem).u64(len)
    }
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    fn pad(&mut self, alignment: usize) -> &mut Self {
        let n = self.0.len().div_ceil(alignment) * alignment;
        self.0.resize(n, 0);
        self
    }
    fn zeros(&mut self, n: usize) -> &mut Self {
        self.0.resize(self.0.len() + n, 0);
        self
    }
    fn bytes(&self) -> Vec<u8> {
        self.0.clone()
    }
}

/// A valid image: one key, one F32 tensor of 4 elements.
fn valid() -> Image {
    let mut i = Image::v3(1, 1);
    i.kv_str("general.architecture", "llama")
        .tensor("t", &[4], F32, 0)
        .pad(32)
        .zeros(16);
    i
}

#[test]
fn the_valid_image_parses() {
    let (f, _) = parse(valid().bytes());
    let f = f.expect("valid image");
    assert_eq!(f.tensors()[0].n_bytes, 16);
    assert_eq!(f.architecture().unwrap(), "llama");
}

// ---------------------------------------------------------------------------
// Header
// ---------------------------------------------------------------------------

#[test]
fn wrong_magic() {
    let mut b = valid().bytes();
    b[..4].copy_from_slice(b"GGML");
    let e = err(b);
    assert!(
        matches!(e, GgufError::BadMagic { ref found } if found == b"GGML"),
        "{e:?}"
    );
    says(&e, &["magic", "offset 0", "GGUF"]);
}

#[test]
fn unsupported_version_1_and_4() {
    for version in [1, 4, 0, u32::MAX] {
        let e = err(Image::new(version, 0, 0).bytes());
        assert!(
            matches!(e, GgufError::UnsupportedVersion { version: v } if v == version),
            "{e:?}"
        );
        says(&e, &[&format!("version {version}"), "offset 4"]);
    }
    // Version 2 is read like 3.
    let (f, _) = parse(Image::new(2, 0, 0).bytes());
    assert_eq!(f.unwrap().version(), 2);
}

#[test]
fn truncated_header() {
    let full = Image::v3(0, 0).bytes();
    for (len, what, offset) in [
        (2, "magic", 0),
        (6, "version", 4),
        (12, "tensor count", 8),
        (23, "metadata count", 16),
    ] {
        let e = err(full[..len].to_vec());
        match &e {
            GgufError::Truncated {
                what: w, offset: o, ..
            } => {
                assert_eq!((w.as_str(), *o), (what, offset), "{e}");
            }
            _ => panic!("{len} bytes: {e:?}"),
        }
        says(&e, &[what, &format!("offset {offset}")]);
    }
}

#[test]
fn empty_image() {
    let e = err(Vec::new());
    assert!(
        matches!(e, GgufError::Truncated { ref what, offset: 0, needed: 4, available: 0 } if what == "magic"),
        "{e:?}"
    );
}

#[test]
fn metadata_count_beyond_the_file() {
    let e = err(Image::v3(0, u64::MAX).bytes());
    assert!(
        matches!(e, GgufError::LengthBeyondFile { ref what, offset: 16, len: u64::MAX, .. } if what == "metadata count"),
        "{e:?}"
    );
    says(&e, &["metadata count", "offset 16"]);
}

#[test]
fn tensor_count_beyond_the_file() {
    let mut i = Image::v3(1 << 40, 1);
    i.kv_str("general.architecture", "llama");
    let e = err(i.bytes());
    // The offset is that of the tensor count in the header.
    assert!(
        matches!(e, GgufError::LengthBeyondFile { ref what, offset: 8, len, .. } if what == "tensor count" && len == 1 << 40),
        "{e:?}"
    );
    says(&e, &["tensor count", "offset 8"]);
}

// ---------------------------------------------------------------------------
// Metadata
// ---------------------------------------------------------------------------

#[test]
fn truncated_metadata_value() {
    let mut i = Image::v3(0, 1);
    i.str("some.key").u32(U32);
    let at = i.pos();
    i.raw(&[1, 2]);
    let e = err(i.bytes());
    assert!(
        matches!(e, GgufError::Truncated { ref what, offset, needed: 4, available: 2 } if what.contains("some.key") && offset == at),
        "{e:?}"
    );
    says(&e, &["some.key", &format!("offset {at}")]);
}

#[test]
fn truncated_metadata_key() {
    let mut i = Image::v3(0, 2);
    i.kv_u32("a", 1);
    let at = i.pos();
    i.str("second.key");
    // The value type of the second key is missing.
    let e = err(i.bytes());
    assert!(
        matches!(e, GgufError::Truncated { ref what, offset, .. } if what == "value type" && offset == at + 18),
        "{e:?}"
    );
}

#[test]
fn string_length_beyond_the_file() {
    // A key whose length is 2^40.
    let mut i = Image::v3(0, 1);
    let at = i.pos();
    i.u64(1 << 40).raw(b"abcd").u32(U32).u32(0);
    let e = err(i.bytes());
    assert!(
        matches!(e, GgufError::LengthBeyondFile { ref what, offset, len, .. } if what == "metadata key" && offset == at && len == 1 << 40),
        "{e:?}"
    );
    says(
        &e,
        &["metadata key", &format!("offset {at}"), "1099511627776"],
    );

    // A string value one byte longer than what is left.
    let mut i = Image::v3(0, 1);
    i.str("general.name").u32(STRING);
    let at = i.pos();
    i.u64(6).raw(b"short");
    let e = err(i.bytes());
    assert!(
        matches!(e, GgufError::LengthBeyondFile { offset, len: 6, available: 5, .. } if offset == at),
        "{e:?}"
    );
    says(&e, &["general.name", &format!("offset {at}")]);

    // u64::MAX as a string length.
    let mut i = Image::v3(0, 1);
    i.str("k").u32(STRING).u64(u64::MAX).zeros(64);
    assert!(matches!(
        err(i.bytes()),
        GgufError::LengthBeyondFile { len: u64::MAX, .. }
    ));
}

#[test]
fn array_length_beyond_the_file_does_not_allocate() {
    for (elem, len) in [
        (U8, 1u64 << 62),
        (U32, 1 << 62),
        (STRING, u64::MAX),
        (ARRAY, 1 << 61),
        (U8, 65),
    ] {
        let mut i = Image::v3(0, 1);
        i.str("tokenizer.ggml.tokens").u32(ARRAY).u32(elem);
        let at = i.pos();
        i.u64(len).zeros(64);
        let bytes = i.bytes();
        let (r, largest) = parse(bytes);
        let e = r.expect_err("must fail");
        assert!(
            matches!(e, GgufError::LengthBeyondFile { offset, len: l, .. } if offset == at && l == len),
            "{elem}/{len}: {e:?}"
        );
        says(
            &e,
            &[
                "tokenizer.ggml.tokens",
                &format!("offset {at}"),
                &len.to_string(),
            ],
        );
        assert!(largest < 4096, "{len} elements: allocated {largest} bytes");
    }
}

#[test]
fn nested_array_lengths_are_checked_too() {
    // An array of 2 arrays, the second of which claims 2^62 u32s.
    let mut i = Image::v3(0, 1);
    i.kv_array("nested", ARRAY, 2).u32(U8).u64(1).u8(7).u32(U32);
    let at = i.pos();
    i.u64(1 << 62).zeros(16);
    let (r, largest) = parse(i.bytes());
    let e = r.expect_err("must fail");
    assert!(
        matches!(e, GgufError::LengthBeyondFile { offset, .. } if offset == at),
        "{e:?}"
    );
    says(&e, &["nested"]);
    assert!(largest < 4096, "allocated {largest} bytes");
}

fn nested(depth: usize) -> Image {
    // `depth` levels of arrays, each holding one item; the innermost holds one u8.
    let mut i = Image::v3(0, 1);
    i.str("deep").u32(ARRAY);
    for _ in 1..depth {
        i.u32(ARRAY).u64(1);
    }
    i.u32(U8).u64(1).u8(42);
    i
}

#[test]
fn nesting_too_deep() {
    // MAX_NESTING levels are fine...
    let (f, _) = parse(nested(MAX_NESTING).bytes());
    let f = f.expect("nesting at the limit");
    let mut v = f.get("deep").unwrap();
    for _ in 0..MAX_NESTING {
        v = &v.as_array().unwrap()[0];
    }
    assert_eq!(v, &Value::U8(42));

    // ...one more is not.
    // The error points at the innermost (too deep) array: header, key "deep", the
    // ARRAY tag, then 12 bytes (element type, length) per level above it.
    let at = 24 + 12 + 4 + 12 * MAX_NESTING as u64;
    let e = err(nested(MAX_NESTING + 1).bytes());
    assert!(
        matches!(e, GgufError::NestingTooDeep { ref key, offset, max } if key == "deep" && offset == at && max == MAX_NESTING),
        "{e:?}"
    );
    says(
        &e,
        &["deep", &format!("offset {at}"), &MAX_NESTING.to_string()],
    );

    // Very deep nesting (a stack-overflow attempt) fails the same way.
    let mut i = Image::v3(0, 1);
    i.str("deeper").u32(ARRAY);
    for _ in 0..100_000 {
        i.u32(ARRAY).u64(1);
    }
    assert!(matches!(err(i.bytes()), GgufError::NestingTooDeep { .. }));
}

#[test]
fn unknown_value_type() {
    let mut i = Image::v3(0, 1);
    i.str("general.weird");
    let at = i.pos();
    i.u32(13).u64(0);
    let e = err(i.bytes());
    assert!(
        matches!(e, GgufError::UnknownValueType { ref key, offset, type_id: 13 } if key == "general.weird" && offset == at),
        "{e:?}"
    );
    says(&e, &["general.weird", &format!("offset {at}"), "13"]);

    // ...also as an array's element type.
    let mut i = Image::v3(0, 1);
    i.str("arr").u32(ARRAY);
    let at = i.pos();
    i.u32(0xdead_beef).u64(1).zeros(8);
    let e = err(i.bytes());
    assert!(
        matches!(e, GgufError::UnknownValueType { ref key, offset, type_id: 0xdead_beef } if key == "arr" && offset == at),
        "{e:?}"
    );
}

#[test]
fn duplicate_keys() {
    let mut i = Image::v3(0, 3);
    i.kv_u32("a.b", 1).kv_u32("c.d", 2);
    let at = i.pos();
    i.kv_str("a.b", "again");
    let e = err(i.bytes());
    assert!(
        matches!(e, GgufError::DuplicateKey { ref key, offset } if key == "a.b" && offset == at),
        "{e:?}"
    );
    says(&e, &["'a.b'", &format!("offset {at}")]);
}

#[test]
fn invalid_utf8_key() {
    let mut i = Image::v3(0, 1);
    i.u64(2).raw(&[0xff, 0xfe]).u32(U8).u8(0);
    let e = err(i.bytes());
    assert!(
        matches!(e, GgufError::InvalidUtf8 { ref what, offset: 32 } if what == "metadata key"),
        "{e:?}"
    );
}

#[test]
fn bad_general_alignment() {
    for (value, is_u64) in [(0, false), (3, false), (48, false), ((1 << 33) | 1, true)] {
        let mut i = Image::v3(0, 2);
        i.kv_str("general.architecture", "llama")
            .str("general.alignment");
        if is_u64 {
            i.u32(ValueType::U64 as u32).u64(value);
        } else {
            i.u32(U32).u32(value as u32);
        }
        let e = err(i.bytes());
        assert!(
            matches!(e, GgufError::BadAlignment { value: v } if v == value),
            "{e:?}"
        );
        says(&e, &["general.alignment", &value.to_string()]);
    }
    // The writer refuses them too.
    let mut w = GgufWriter::new();
    w.add("general.alignment", Value::U32(3));
    assert!(matches!(
        w.to_bytes(),
        Err(GgufError::BadAlignment { value: 3 })
    ));
    // A string is not an alignment either.
    let mut i = Image::v3(0, 1);
    i.kv_str("general.alignment", "32");
    assert!(matches!(err(i.bytes()), GgufError::BadAlignment { .. }));
}

// ---------------------------------------------------------------------------
// Tensor infos
// ---------------------------------------------------------------------------

#[test]
fn truncated_tensor_infos() {
    let mut i = Image::v3(1, 0);
    i.str("t").u32(2).u64(4);
    let at = i.pos();
    i.raw(&[0; 3]);
    let e = err(i.bytes());
    assert!(
        matches!(e, GgufError::Truncated { ref what, offset, needed: 8, available: 3 } if what == "tensor dimension" && offset == at),
        "{e:?}"
    );
    says(&e, &["tensor dimension", &format!("offset {at}")]);

    // Every prefix of the tensor directory fails cleanly.
    let full = valid();
    let start = 24 + 8 + 20 + 4 + 8 + 5;
    for cut in start..full.0.len() - 16 {
        err(full.0[..cut].to_vec());
    }
}

#[test]
fn truncated_tensor_data() {
    let mut i = valid();
    let n = i.0.len();
    i.0.truncate(n - 1);
    let e = err(i.bytes());
    assert!(
        matches!(e, GgufError::TensorOutOfBounds { ref name, offset: 128, size: 16, file_len: 143 } if name == "t"),
        "{e:?}"
    );
    says(&e, &["'t'", "offset 128", "16 bytes", "143"]);
}

#[test]
fn tensor_data_out_of_bounds() {
    for offset in [1 << 20, u64::MAX - 31, (i64::MAX as u64) & !31] {
        let mut i = Image::v3(1, 0);
        i.tensor("blk.0.attn_q.weight", &[8, 2], F32, offset)
            .pad(32)
            .zeros(64);
        let e = err(i.bytes());
        assert!(
            matches!(e, GgufError::TensorOutOfBounds { ref name, size: 64, .. } if name == "blk.0.attn_q.weight"),
            "{offset}: {e:?}"
        );
        says(&e, &["blk.0.attn_q.weight"]);
    }
}

#[test]
fn misaligned_tensor_offset() {
    let mut i = Image::v3(2, 0);
    i.tensor("a", &[4], F32, 0)
        .tensor("b", &[4], F32, 16)
        .pad(32)
        .zeros(64);
    let e = err(i.bytes());
    assert!(
        matches!(e, GgufError::TensorMisaligned { ref name, offset: 16, alignment: 32 } if name == "b"),
        "{e:?}"
    );
    says(&e, &["'b'", "16", "32"]);

    // With general.alignment = 16 the same offset is fine.
    let mut i = Image::v3(2, 1);
    i.kv_u32("general.alignment", 16)
        .tensor("a", &[4], F32, 0)
        .tensor("b", &[4], F32, 16)
        .pad(16)
        .zeros(32);
    let (f, _) = parse(i.bytes());
    let f = f.expect("aligned to 16");
    assert_eq!(f.alignment(), 16);
    assert_eq!(f.data_offset() % 16, 0);
}

#[test]
fn duplicate_tensor_names() {
    let mut i = Image::v3(2, 0);
    i.tensor("output.weight", &[4], F32, 0);
    let at = i.pos();
    i.tensor("output.weight", &[4], F32, 32).pad(32).zeros(64);
    let e = err(i.bytes());
    assert!(
        matches!(e, GgufError::DuplicateTensor { ref name, offset } if name == "output.weight" && offset == at),
        "{e:?}"
    );
    says(&e, &["output.weight", &format!("offset {at}")]);
}

#[test]
fn too_many_dimensions() {
    let mut i = Image::v3(1, 0);
    let at = i.pos();
    i.tensor("t5", &[1, 1, 1, 1, 1], F32, 0).pad(32).zeros(4);
    let e = err(i.bytes());
    assert!(
        matches!(e, GgufError::TooManyDims { ref name, offset, n_dims: 5, max } if name == "t5" && offset == at && max == MAX_DIMS),
        "{e:?}"
    );
    says(&e, &["t5", &format!("offset {at}"), "5 dimensions"]);

    // u32::MAX dimensions: refused before anything is read or allocated.
    let mut i = Image::v3(1, 0);
    i.str("t").u32(u32::MAX).zeros(32);
    assert!(matches!(
        err(i.bytes()),
        GgufError::TooManyDims {
            n_dims: u32::MAX,
            ..
        }
    ));
}

#[test]
fn element_count_overflow() {
    for dims in [
        &[1u64 << 32, 1 << 32][..],
        &[1 << 62, 2],
        &[1 << 16, 1 << 16, 1 << 16, 1 << 16],
    ] {
        let mut i = Image::v3(1, 0);
        i.tensor("huge", dims, F32, 0).pad(32).zeros(32);
        let e = err(i.bytes());
        assert!(
            matches!(e, GgufError::ElementCountOverflow { ref name, ref shape } if name == "huge" && shape == dims),
            "{e:?}"
        );
        says(&e, &["huge"]);
    }
    // The element count fits but the byte count does not.
    let mut i = Image::v3(1, 0);
    i.tensor("bytes", &[1 << 62], F32, 0).pad(32).zeros(32);
    assert!(matches!(
        err(i.bytes()),
        GgufError::ElementCountOverflow { .. }
    ));

    // A single dimension beyond i64::MAX.
    let mut i = Image::v3(1, 0);
    i.str("neg").u32(2).u64(4);
    let at = i.pos();
    i.u64(u64::MAX).u32(F32).u64(0).pad(32);
    let e = err(i.bytes());
    assert!(
        matches!(e, GgufError::BadDimension { ref name, offset, dim: 1, value: u64::MAX } if name == "neg" && offset == at),
        "{e:?}"
    );
}

#[test]
fn unknown_tensor_type() {
    // Removed ids (Q4_2, Q4_3, the repacked Q4_0/IQ4_NL variants) and the first unassigned one.
    for ty in [4u32, 5, 31, 32, 33, 36, 37, 38, 43, u32::MAX] {
        let mut i = Image::v3(1, 0);
        i.str("w").u32(1).u64(32);
        let at = i.pos();
        i.u32(ty).u64(0).pad(32).zeros(128);
        let e = err(i.bytes());
        assert!(
            matches!(e, GgufError::UnknownTensorType { ref name, offset, type_id } if name == "w" && offset == at && type_id == ty),
            "{e:?}"
        );
        says(&e, &["'w'", &format!("offset {at}"), &ty.to_string()]);
    }
}

#[test]
fn row_not_a_whole_number_of_blocks() {
    let mut i = Image::v3(1, 0);
    i.tensor("q", &[33, 1], GgmlType::Q8_0 as u32, 0)
        .pad(32)
        .zeros(128);
    let e = err(i.bytes());
    assert!(
        matches!(e, GgufError::NotBlockAligned { ref name, ne0: 33, block: 32, .. } if name == "q"),
        "{e:?}"
    );
}

#[test]
fn every_prefix_of_a_real_file_fails_or_parses_without_panic() {
    // The gguf-py writer reference: any cut before the end of the last tensor's data
    // is an error; cutting only trailing padding still leaves a valid file.
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/gguf/writer-reference.gguf");
    let full = std::fs::read(&path).expect("committed fixture");
    let f = GgufFile::from_bytes(full.clone()).unwrap();
    let last = f.tensors().last().unwrap();
    let data_end = (f.data_offset() + last.offset + last.n_bytes) as usize;
    for cut in 0..full.len() {
        let (r, largest) = parse(full[..cut].to_vec());
        assert!(
            largest <= 64 * 1024 + 32 * full.len(),
            "cut {cut}: allocated {largest}"
        );
        assert_eq!(r.is_ok(), cut >= data_end, "cut at {cut}: {:?}", r.err());
    }
}

// ---------------------------------------------------------------------------
// Files
// ---------------------------------------------------------------------------

fn tmp(name: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(name)
}

#[test]
fn a_directory_instead_of_a_file() {
    let dir = tmp("gguf_bad_input_dir.gguf");
    std::fs::create_dir_all(&dir).unwrap();
    let e = GgufFile::open(&dir).unwrap_err();
    assert!(
        matches!(e, GgufError::IsDirectory(ref p) if p == &dir),
        "{e:?}"
    );
    says(&e, &["gguf_bad_input_dir.gguf", "directory"]);
}

#[test]
fn a_missing_file() {
    let path = tmp("gguf_bad_input_does_not_exist.gguf");
    let e = GgufFile::open(&path).unwrap_err();
    assert!(
        matches!(e, GgufError::Io { path: ref p, ref source } if p == &path && source.kind() == std::io::ErrorKind::NotFound),
        "{e:?}"
    );
    says(&e, &["gguf_bad_input_does_not_exist.gguf"]);
}

#[test]
fn an_empty_file() {
    let path = tmp("gguf_bad_input_empty.gguf");
    std::fs::write(&path, b"").unwrap();
    let e = GgufFile::open(&path).unwrap_err();
    assert!(
        matches!(e, GgufError::Truncated { ref what, offset: 0, available: 0, .. } if what == "magic"),
        "{e:?}"
    );
    says(&e, &["magic", "offset 0"]);
}

#[test]
fn a_malformed_file_on_disk() {
    // The memory-mapped path reports the same errors as from_bytes.
    let path = tmp("gguf_bad_input_truncated.gguf");
    let mut b = valid().bytes();
    b.truncate(b.len() - 1);
    std::fs::write(&path, &b).unwrap();
    let e = GgufFile::open(&path).unwrap_err();
    assert!(matches!(e, GgufError::TensorOutOfBounds { .. }), "{e:?}");
}
