//! Writer compatibility with llama.cpp's gguf-py.
//!
//! `scripts/record_gguf_fixtures.py` writes `tests/fixtures/gguf/writer-reference*.gguf`
//! with gguf-py's `GGUFWriter` and describes their content in a `.json` beside each.
//! Here `GgufWriter` rebuilds each file from its description; the bytes must be
//! identical. The file is then read back and every value checked.

use std::path::{Path, PathBuf};

use rustorch_core::gguf::{GgufError, GgufFile, GgufWriter, Value, ValueType};
use rustorch_core::GgmlType;
use serde_json::Value as Json;

const REFERENCES: [&str; 2] = ["writer-reference", "writer-reference-align64"];

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf")
}

fn load(name: &str) -> (Json, Vec<u8>) {
    let dir = fixture_dir();
    let json_path = dir.join(format!("{name}.json"));
    let gguf_path = dir.join(format!("{name}.gguf"));
    let text = std::fs::read_to_string(&json_path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run scripts/record_gguf_fixtures.py)",
            json_path.display()
        )
    });
    let desc: Json = serde_json::from_str(&text).expect("fixture JSON");
    let bytes =
        std::fs::read(&gguf_path).unwrap_or_else(|e| panic!("{}: {e}", gguf_path.display()));
    (desc, bytes)
}

fn value_type(name: &str) -> ValueType {
    (0..13)
        .filter_map(ValueType::from_id)
        .find(|t| t.name() == name)
        .unwrap_or_else(|| panic!("unknown value type {name}"))
}

fn hex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd hex length");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn int<T: TryFrom<i128>>(node: &Json) -> T {
    let v = &node["value"];
    let wide: i128 = v
        .as_u64()
        .map(i128::from)
        .or_else(|| v.as_i64().map(i128::from))
        .unwrap_or_else(|| panic!("not an integer: {node}"));
    T::try_from(wide).unwrap_or_else(|_| panic!("out of range: {node}"))
}

/// A description node (`{"type", "value", ["bits"], ["elem_type"]}`) as a `Value`.
fn to_value(node: &Json) -> Value {
    let ty = node["type"].as_str().expect("type");
    let bits = || node["bits"].as_str().expect("float without bits");
    match value_type(ty) {
        ValueType::U8 => Value::U8(int(node)),
        ValueType::I8 => Value::I8(int(node)),
        ValueType::U16 => Value::U16(int(node)),
        ValueType::I16 => Value::I16(int(node)),
        ValueType::U32 => Value::U32(int(node)),
        ValueType::I32 => Value::I32(int(node)),
        ValueType::U64 => Value::U64(int(node)),
        ValueType::I64 => Value::I64(int(node)),
        ValueType::F32 => Value::F32(f32::from_bits(
            u32::from_str_radix(bits(), 16).expect("bits"),
        )),
        ValueType::F64 => Value::F64(f64::from_bits(
            u64::from_str_radix(bits(), 16).expect("bits"),
        )),
        ValueType::Bool => Value::Bool(node["value"].as_bool().expect("bool")),
        ValueType::String => Value::String(node["value"].as_str().expect("string").to_string()),
        ValueType::Array => {
            let elem = value_type(node["elem_type"].as_str().expect("elem_type"));
            let items: Vec<Value> = node["value"]
                .as_array()
                .expect("items")
                .iter()
                .map(to_value)
                .collect();
            assert!(items.iter().all(|v| v.value_type() == elem), "{node}");
            Value::Array(elem, items)
        }
    }
}

/// Equality that tells -0.0 from 0.0 and compares NaN by bits.
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::F32(x), Value::F32(y)) => x.to_bits() == y.to_bits(),
        (Value::F64(x), Value::F64(y)) => x.to_bits() == y.to_bits(),
        (Value::Array(ta, xa), Value::Array(tb, xb)) => {
            ta == tb && xa.len() == xb.len() && xa.iter().zip(xb).all(|(x, y)| same(x, y))
        }
        _ => a == b,
    }
}

struct Tensor {
    name: String,
    ty: GgmlType,
    dims: Vec<u64>,
    data: Vec<u8>,
}

fn described_metadata(desc: &Json) -> Vec<(String, Value)> {
    desc["metadata"]
        .as_array()
        .expect("metadata")
        .iter()
        .map(|m| (m["key"].as_str().expect("key").to_string(), to_value(m)))
        .collect()
}

fn described_tensors(desc: &Json) -> Vec<Tensor> {
    desc["tensors"]
        .as_array()
        .expect("tensors")
        .iter()
        .map(|t| {
            let data = hex(t["data_hex"].as_str().expect("data_hex"));
            assert_eq!(data.len() as u64, t["n_bytes"].as_u64().expect("n_bytes"));
            Tensor {
                name: t["name"].as_str().expect("name").to_string(),
                ty: GgmlType::from_name(t["type"].as_str().expect("type")).expect("known type"),
                dims: t["shape"]
                    .as_array()
                    .expect("shape")
                    .iter()
                    .map(|d| d.as_u64().expect("dim"))
                    .collect(),
                data,
            }
        })
        .collect()
}

fn build(desc: &Json) -> GgufWriter {
    let mut w = GgufWriter::new();
    for (k, v) in described_metadata(desc) {
        w.add(k, v);
    }
    for t in described_tensors(desc) {
        w.add_tensor(t.name, t.ty, &t.dims, t.data)
            .expect("add_tensor");
    }
    w
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .or((a.len() != b.len()).then(|| a.len().min(b.len())))
}

#[test]
fn writer_output_is_byte_identical_to_gguf_py() {
    for name in REFERENCES {
        let (desc, reference) = load(name);
        assert_eq!(
            reference.len() as u64,
            desc["size"].as_u64().expect("size"),
            "{name}"
        );
        let ours = build(&desc).to_bytes().expect("to_bytes");
        if let Some(at) = first_difference(&ours, &reference) {
            let lo = at.saturating_sub(16);
            panic!(
                "{name}: first difference at byte {at} (ours {} bytes, gguf-py {} bytes)\n ours:   {:02x?}\n gguf-py: {:02x?}",
                ours.len(),
                reference.len(),
                &ours[lo..(at + 16).min(ours.len())],
                &reference[lo..(at + 16).min(reference.len())],
            );
        }
    }
}

#[test]
fn write_to_matches_to_bytes() {
    let (desc, reference) = load(REFERENCES[0]);
    let mut out = Vec::new();
    build(&desc).write_to(&mut out).expect("write_to");
    assert!(out == reference);
}

#[test]
fn reads_back_every_value() {
    for name in REFERENCES {
        let (desc, reference) = load(name);
        let f = GgufFile::from_bytes(reference).expect("parse reference");
        let meta = described_metadata(&desc);
        let tensors = described_tensors(&desc);
        let alignment = desc["alignment"].as_u64().expect("alignment");

        assert_eq!(f.version(), 3);
        assert_eq!(f.alignment(), alignment, "{name}");
        assert_eq!(
            f.data_offset(),
            desc["data_offset"].as_u64().expect("data_offset"),
            "{name}"
        );
        assert_eq!(f.data_offset() % alignment, 0);
        assert_eq!(f.file_size(), desc["size"].as_u64().expect("size"));

        // Every key, in file order, with its exact type and value.
        assert_eq!(f.metadata().len(), meta.len(), "{name}: key count");
        for ((k, v), (ek, ev)) in f.metadata().iter().zip(&meta) {
            assert_eq!(k, ek);
            assert!(same(v, ev), "{name}: {k}: read {v:?}, described {ev:?}");
            assert!(same(f.get(k).expect("get"), ev), "{k}");
        }

        // Tensors: directory, offsets (each aligned, packed in order) and bytes.
        assert_eq!(f.tensors().len(), tensors.len());
        let mut expected_offset = 0u64;
        for (info, t) in f.tensors().iter().zip(&tensors) {
            assert_eq!(info.name, t.name);
            assert_eq!(info.ty, t.ty, "{}", t.name);
            assert_eq!(info.dims, t.dims, "{}", t.name);
            assert_eq!(info.n_bytes, t.data.len() as u64, "{}", t.name);
            assert_eq!(info.offset, expected_offset, "{}", t.name);
            assert_eq!(info.offset % alignment, 0);
            expected_offset += (t.data.len() as u64).div_ceil(alignment) * alignment;
            assert_eq!(f.tensor_data(info), &t.data[..], "{}", t.name);
            let (by_name, data) = f.tensor(&t.name).expect("tensor by name");
            assert_eq!(by_name, info);
            assert_eq!(data, &t.data[..]);
        }
        assert_eq!(
            f.data_offset() + expected_offset,
            f.file_size(),
            "{name}: trailing padding"
        );
    }
}

#[test]
fn typed_accessors_on_reference() {
    let (_, reference) = load(REFERENCES[1]);
    let f = GgufFile::from_bytes(reference).expect("parse");
    assert_eq!(f.architecture().unwrap(), "rustorch-test");
    assert_eq!(f.get_u32("general.alignment").unwrap(), 64);
    assert_eq!(f.get_u32("test.u8").unwrap(), 200);
    assert_eq!(f.get_u32("test.u32").unwrap(), 4_000_000_000);
    assert_eq!(f.get_u64("test.u64").unwrap(), u64::MAX);
    assert_eq!(f.get_i64("test.i64").unwrap(), i64::MIN);
    assert_eq!(f.get_i64("test.i8").unwrap(), -100);
    assert_eq!(f.get_f32("test.f32").unwrap(), 0.1f32);
    assert_eq!(f.get_f32("test.f64").unwrap(), std::f32::consts::PI);
    assert!(f.get_bool("test.bool.true").unwrap());
    assert!(!f.get_bool("test.bool.false").unwrap());
    assert!(f.get_str("test.string").unwrap().contains('\u{1F980}'));
    assert_eq!(
        f.get_string_array("test.array.string").unwrap(),
        ["a", "", "ñandú", "<|im_start|>", "Ġt"]
    );
    assert_eq!(
        f.get_f32_array("test.array.f32").unwrap()[..3],
        [0.5, -1.25, 1e-3]
    );
    assert_eq!(
        f.get_i64_array("test.array.i32").unwrap(),
        [1, -2, 3, i32::MAX as i64, i32::MIN as i64]
    );
    assert_eq!(f.get_i64_array("test.array.u8").unwrap(), [0, 1, 127, 255]);
    assert_eq!(
        f.get_i64_array("test.array.long").unwrap(),
        (0..20).collect::<Vec<_>>()
    );

    // Out of range or wrong type: the error names the key.
    let e = f.get_u32("test.u64").unwrap_err();
    assert!(
        matches!(e, GgufError::WrongType { ref key, .. } if key == "test.u64"),
        "{e}"
    );
    let e = f.get_u64("test.i64").unwrap_err();
    assert!(e.to_string().contains("test.i64"), "{e}");
    let e = f.get_string_array("test.array.i32").unwrap_err();
    assert!(
        matches!(e, GgufError::WrongType { .. }) && e.to_string().contains("test.array.i32"),
        "{e}"
    );
    let e = f.get_string_array("test.array.nested").unwrap_err();
    assert!(matches!(e, GgufError::WrongType { .. }), "{e}");
    let e = f.get_str("no.such.key").unwrap_err();
    assert!(
        matches!(e, GgufError::MissingKey { ref key } if key == "no.such.key"),
        "{e}"
    );
    let e = f.tensor("no.such.tensor").unwrap_err();
    assert!(
        matches!(e, GgufError::MissingTensor { ref name } if name == "no.such.tensor"),
        "{e}"
    );

    // Nested arrays keep their shape and inner element types.
    let nested = f
        .get("test.array.nested_mixed")
        .unwrap()
        .as_array()
        .unwrap();
    let inner: Vec<String> = nested.iter().map(Value::type_name).collect();
    assert_eq!(
        inner,
        [
            "ARRAY[INT32]",
            "ARRAY[STRING]",
            "ARRAY[BOOL]",
            "ARRAY[FLOAT32]"
        ]
    );
}

/// Reading any valid file and writing its content back gives the same bytes.
#[test]
fn read_then_write_round_trips() {
    for name in REFERENCES {
        let (_, reference) = load(name);
        let f = GgufFile::from_bytes(reference.clone()).expect("parse");
        let mut w = GgufWriter::new();
        for (k, v) in f.metadata() {
            w.add(k.clone(), v.clone());
        }
        for t in f.tensors() {
            w.add_tensor(t.name.clone(), t.ty, &t.dims, f.tensor_data(t).to_vec())
                .unwrap();
        }
        assert!(w.to_bytes().unwrap() == reference, "{name}");
    }
}

#[test]
fn written_file_opens_from_disk() {
    let (desc, reference) = load(REFERENCES[0]);
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("gguf_writer_roundtrip.gguf");
    let mut file = std::fs::File::create(&path).unwrap();
    build(&desc).write_to(&mut file).unwrap();
    drop(file);
    let f = GgufFile::open(&path).unwrap();
    assert!(f.bytes() == &reference[..]);
    assert_eq!(f.tensors().len(), 5);
    std::fs::remove_file(&path).ok();
}

#[test]
fn add_replaces_a_key_in_place() {
    let mut w = GgufWriter::new();
    w.add("a", Value::U32(1));
    w.add("b", Value::U32(2));
    w.add("a", Value::String("x".into()));
    let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    let keys: Vec<&str> = f.metadata().iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ["a", "b"]);
    assert_eq!(f.get_str("a").unwrap(), "x");
}

#[test]
fn writer_rejects_invalid_content() {
    let mut w = GgufWriter::new();
    let invalid = |e: GgufError| matches!(e, GgufError::InvalidWrite(_));

    // Data length must match the shape.
    assert!(invalid(
        w.add_tensor("t", GgmlType::F32, &[3], vec![0; 8])
            .unwrap_err()
    ));
    // Not a whole number of blocks.
    assert!(invalid(
        w.add_tensor("q", GgmlType::Q8_0, &[16], vec![0; 17])
            .unwrap_err()
    ));
    // More than four dimensions.
    assert!(invalid(
        w.add_tensor("t", GgmlType::F32, &[1, 1, 1, 1, 1], vec![0; 4])
            .unwrap_err()
    ));
    // An element count that overflows u64 is an error, not a panic.
    let e = w
        .add_tensor("big", GgmlType::F32, &[u64::MAX, 2], vec![])
        .unwrap_err();
    assert!(invalid(e));
    // Duplicate names.
    w.add_tensor("t", GgmlType::F32, &[1], vec![0; 4]).unwrap();
    let e = w
        .add_tensor("t", GgmlType::F32, &[1], vec![0; 4])
        .unwrap_err();
    assert!(e.to_string().contains("'t'"), "{e}");

    // Arrays must hold what their element type says.
    let mut w = GgufWriter::new();
    w.add(
        "mixed",
        Value::Array(ValueType::U32, vec![Value::U32(1), Value::I32(2)]),
    );
    assert!(invalid(w.to_bytes().unwrap_err()));

    // general.alignment must be a non-zero power of two.
    for bad in [Value::U32(0), Value::U32(48), Value::String("32".into())] {
        let mut w = GgufWriter::new();
        w.add("general.alignment", bad);
        assert!(matches!(
            w.to_bytes().unwrap_err(),
            GgufError::BadAlignment { .. }
        ));
    }
}

#[test]
fn empty_writer_is_a_valid_file() {
    let bytes = GgufWriter::new().to_bytes().unwrap();
    // magic, version, 0 tensors, 0 keys, padded to 32
    assert_eq!(bytes.len(), 32);
    assert_eq!(&bytes[..8], b"GGUF\x03\0\0\0");
    let f = GgufFile::from_bytes(bytes).unwrap();
    assert!(f.metadata().is_empty() && f.tensors().is_empty());
    assert_eq!(f.data_offset(), 32);
}

/// A file read into memory (`GgufFile::open_in_memory`) has exactly the file's bytes,
/// including the token embeddings, which stay a map of the file when an output matrix
/// exists (their page-aligned interior), and without one.
#[test]
fn in_memory_copy_equals_the_file() {
    for with_output in [true, false] {
        let mut w = GgufWriter::new();
        w.add("general.architecture", Value::String("llama".into()));
        let f32s = |n: usize, seed: u32| -> Vec<u8> {
            (0..n)
                .flat_map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed).to_le_bytes())
                .collect()
        };
        // 64 x 100 f32 = 25,600 bytes: several pages, starting inside one
        w.add_tensor("blk.0.attn_norm.weight", GgmlType::F32, &[3], f32s(3, 1))
            .unwrap();
        w.add_tensor(
            "token_embd.weight",
            GgmlType::F32,
            &[64, 100],
            f32s(6400, 2),
        )
        .unwrap();
        if with_output {
            w.add_tensor("output.weight", GgmlType::F32, &[64, 100], f32s(6400, 3))
                .unwrap();
        }
        let bytes = w.to_bytes().unwrap();
        let path = std::env::temp_dir().join(format!(
            "rustorch-in-memory-{}-{with_output}.gguf",
            std::process::id()
        ));
        std::fs::write(&path, &bytes).unwrap();
        let g = GgufFile::open_in_memory(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(g.bytes() == &bytes[..], "with output {with_output}");
        let (_, e) = g.tensor("token_embd.weight").unwrap();
        assert_eq!(e, &f32s(6400, 2)[..]);
    }
}
