//! What every fuzz harness does with a parsed GGUF file: call every accessor, slice
//! every tensor, check the reader's invariants, and write the content back with
//! `GgufWriter` to check that it parses again to the same thing.
//!
//! Used by the libFuzzer target (`fuzz_targets/gguf_reader.rs`, `cargo fuzz run
//! gguf_reader`) and, through `#[path]`, by the stable-Rust fuzzer in
//! `crates/rustorch-core/tests/gguf_fuzz.rs`.

use rustorch_core::gguf::{GgufFile, GgufWriter, Value};

/// Parses `data` and, if it is a valid GGUF image, exercises it. Panics only on a bug.
pub fn fuzz_one(data: &[u8]) -> bool {
    match GgufFile::from_bytes(data.to_vec()) {
        Ok(f) => {
            exercise(&f);
            true
        }
        Err(e) => {
            // Every error renders (and names something).
            assert!(!e.to_string().is_empty());
            false
        }
    }
}

/// Touches everything a valid file offers; returns a checksum so that nothing is
/// optimised away.
pub fn exercise(f: &GgufFile) -> u64 {
    let mut acc = u64::from(f.version()) ^ f.alignment() ^ f.data_offset() ^ f.file_size();
    assert!(f.alignment().is_power_of_two());
    assert_eq!(f.data_offset() % f.alignment(), 0);
    assert_eq!(f.bytes().len() as u64, f.file_size());
    acc ^= format!("{f:?}").len() as u64;

    for (key, value) in f.metadata() {
        let looked_up = f.get(key).expect("every listed key can be looked up");
        assert!(same(looked_up, value), "{key}");
        acc ^= value.to_string().len() as u64 ^ value.type_name().len() as u64;
        acc ^= value.as_u64().unwrap_or(1) ^ value.as_i64().unwrap_or(2) as u64;
        acc ^= value.as_f64().map_or(3, f64::to_bits);
        acc ^=
            value.as_str().map_or(4, str::len) as u64 ^ u64::from(value.as_bool().unwrap_or(false));
        acc ^= value.as_array().map_or(5, <[Value]>::len) as u64;
        // Typed accessors: Ok or a WrongType error naming the key, never a panic.
        let checks: [Result<u64, String>; 9] = [
            f.get_u32(key).map(u64::from).map_err(|e| e.to_string()),
            f.get_u64(key).map_err(|e| e.to_string()),
            f.get_i64(key).map(|x| x as u64).map_err(|e| e.to_string()),
            f.get_f32(key)
                .map(|x| u64::from(x.to_bits()))
                .map_err(|e| e.to_string()),
            f.get_bool(key).map(u64::from).map_err(|e| e.to_string()),
            f.get_str(key)
                .map(|s| s.len() as u64)
                .map_err(|e| e.to_string()),
            f.get_string_array(key)
                .map(|v| v.len() as u64)
                .map_err(|e| e.to_string()),
            f.get_f32_array(key)
                .map(|v| v.len() as u64)
                .map_err(|e| e.to_string()),
            f.get_i64_array(key)
                .map(|v| v.len() as u64)
                .map_err(|e| e.to_string()),
        ];
        for c in checks {
            match c {
                Ok(x) => acc ^= x,
                Err(msg) => assert!(msg.contains(key.as_str()), "{msg}"),
            }
        }
    }
    acc ^= f.architecture().map_or(6, str::len) as u64;
    assert!(
        f.get("\u{0}no such key\u{0}").is_none()
            || f.metadata()
                .iter()
                .any(|(k, _)| k == "\u{0}no such key\u{0}")
    );

    for t in f.tensors() {
        let data = f.tensor_data(t);
        assert_eq!(data.len() as u64, t.n_bytes, "{}", t.name);
        assert_eq!(t.offset % f.alignment(), 0);
        assert!(f.data_offset() + t.offset + t.n_bytes <= f.file_size());
        assert_eq!(t.ty.bytes_for(t.n_elements()), Some(t.n_bytes));
        assert!(t.dims.len() <= rustorch_core::gguf::MAX_DIMS);
        let (info, bytes) = f
            .tensor(&t.name)
            .expect("every listed tensor can be looked up");
        assert_eq!(info, t);
        assert_eq!(bytes.as_ptr(), data.as_ptr());
        assert_eq!(f.tensor_info(&t.name), Some(t));
        acc ^= data.first().copied().unwrap_or(7) as u64 ^ data.last().copied().unwrap_or(8) as u64;
        acc ^= t.n_elements() ^ t.ne0() as u64 ^ t.n_rows() as u64;
    }
    acc ^= u64::from(f.tensor("\u{0}no such tensor").is_err());

    round_trip(f);
    acc
}

/// Writes the content back with `GgufWriter`; the result must parse to the same
/// metadata and tensors (data laid out anew, so offsets may differ).
fn round_trip(f: &GgufFile) {
    let mut w = GgufWriter::new();
    for (k, v) in f.metadata() {
        w.add(k.clone(), v.clone());
    }
    for t in f.tensors() {
        w.add_tensor(t.name.clone(), t.ty, &t.dims, f.tensor_data(t).to_vec())
            .expect("a tensor the reader accepts can be written");
    }
    let bytes = w
        .to_bytes()
        .expect("content the reader accepts can be written");
    let g = GgufFile::from_bytes(bytes).expect("the writer's output parses");
    assert_eq!(g.alignment(), f.alignment());
    assert_eq!(g.metadata().len(), f.metadata().len());
    for ((k1, v1), (k2, v2)) in f.metadata().iter().zip(g.metadata()) {
        assert_eq!(k1, k2);
        assert!(same(v1, v2), "{k1}: {v1:?} != {v2:?}");
    }
    assert_eq!(g.tensors().len(), f.tensors().len());
    for (a, b) in f.tensors().iter().zip(g.tensors()) {
        assert_eq!(
            (&a.name, a.ty, &a.dims, a.n_bytes),
            (&b.name, b.ty, &b.dims, b.n_bytes)
        );
        assert!(f.tensor_data(a) == g.tensor_data(b), "{}", a.name);
    }
}

/// Equality that compares floats by bits (NaN == NaN, -0.0 != 0.0).
pub fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::F32(x), Value::F32(y)) => x.to_bits() == y.to_bits(),
        (Value::F64(x), Value::F64(y)) => x.to_bits() == y.to_bits(),
        (Value::Array(ta, xa), Value::Array(tb, xb)) => {
            ta == tb && xa.len() == xb.len() && xa.iter().zip(xb).all(|(x, y)| same(x, y))
        }
        _ => a == b,
    }
}
