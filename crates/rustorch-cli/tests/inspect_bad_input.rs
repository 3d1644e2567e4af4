//! `rustorch inspect` on malformed input: exit code 1, one `error: …` message that
//! names the problem, nothing on stdout, and never a panic.

use std::path::{Path, PathBuf};
use std::process::Command;

fn tmp(name: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(name)
}

fn reference() -> Vec<u8> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/gguf/writer-reference.gguf");
    std::fs::read(p).expect("committed fixture")
}

/// Header with no keys and no tensors, then `rest`.
fn image(version: u32, n_tensors: u64, n_kv: u64, rest: &[u8]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&version.to_le_bytes());
    b.extend_from_slice(&n_tensors.to_le_bytes());
    b.extend_from_slice(&n_kv.to_le_bytes());
    b.extend_from_slice(rest);
    b
}

fn gguf_str(s: &str) -> Vec<u8> {
    let mut b = (s.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(s.as_bytes());
    b
}

/// Runs `rustorch inspect PATH [extra]` and checks the failure; returns stderr.
#[track_caller]
fn fails(path: &Path, extra: &[&str], needles: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_rustorch"))
        .arg("inspect")
        .arg(path)
        .args(extra)
        .output()
        .expect("run rustorch");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}: exit status {:?}, stderr {stderr:?}",
        path.display(),
        out.status
    );
    assert!(
        out.stdout.is_empty(),
        "stdout: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(stderr.starts_with("error: "), "stderr {stderr:?}");
    assert!(!stderr.contains("panicked"), "stderr {stderr:?}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line: {stderr:?}");
    for n in needles {
        assert!(stderr.contains(n), "stderr {stderr:?} lacks {n:?}");
    }
    stderr
}

#[track_caller]
fn file_fails(name: &str, bytes: &[u8], needles: &[&str]) {
    let path = tmp(name);
    std::fs::write(&path, bytes).expect("write temp file");
    for extra in [&[][..], &["--json"], &["--full"]] {
        fails(&path, extra, needles);
    }
    std::fs::remove_file(&path).ok();
}

#[test]
fn missing_file() {
    let path = tmp("inspect_no_such_file.gguf");
    fails(&path, &[], &["inspect_no_such_file.gguf", "No such file"]);
}

#[test]
fn directory() {
    let dir = tmp("inspect_a_directory.gguf");
    std::fs::create_dir_all(&dir).unwrap();
    fails(
        &dir,
        &["--json"],
        &["inspect_a_directory.gguf", "is a directory"],
    );
}

#[test]
fn empty_file() {
    file_fails(
        "inspect_empty.gguf",
        b"",
        &["inspect_empty.gguf", "truncated", "magic", "offset 0"],
    );
}

#[test]
fn wrong_magic() {
    let mut b = reference();
    b[..4].copy_from_slice(b"GGML");
    file_fails("inspect_magic.gguf", &b, &["not a GGUF file", "offset 0"]);
}

#[test]
fn unsupported_version() {
    file_fails(
        "inspect_v1.gguf",
        &image(1, 0, 0, &[]),
        &["unsupported GGUF version 1"],
    );
    file_fails(
        "inspect_v4.gguf",
        &image(4, 0, 0, &[]),
        &["unsupported GGUF version 4"],
    );
}

#[test]
fn truncated_file() {
    let b = reference();
    // The key count no longer fits.
    file_fails(
        "inspect_trunc_count.gguf",
        &b[..200],
        &["metadata count", "offset 16"],
    );
    // Cut inside a string array: its length no longer fits.
    file_fails(
        "inspect_trunc_meta.gguf",
        &b[..1000],
        &["array 'test.array.string'", "offset 986"],
    );
    // Cut inside the tensor directory.
    file_fails(
        "inspect_trunc_infos.gguf",
        &b[..2400],
        &["truncated", "tensor", "offset"],
    );
    file_fails(
        "inspect_trunc_data.gguf",
        &b[..b.len() - 40],
        &["tensor.i32", "beyond the end of the file"],
    );
}

#[test]
fn huge_array_length() {
    let mut rest = gguf_str("tokenizer.ggml.tokens");
    rest.extend_from_slice(&9u32.to_le_bytes()); // ARRAY
    rest.extend_from_slice(&8u32.to_le_bytes()); // of STRING
    rest.extend_from_slice(&(1u64 << 62).to_le_bytes());
    rest.extend_from_slice(&[0; 32]);
    file_fails(
        "inspect_huge_array.gguf",
        &image(3, 0, 1, &rest),
        &["tokenizer.ggml.tokens", "4611686018427387904", "offset 61"],
    );
}

#[test]
fn unknown_tensor_type() {
    let mut rest = gguf_str("w");
    rest.extend_from_slice(&1u32.to_le_bytes());
    rest.extend_from_slice(&32u64.to_le_bytes());
    rest.extend_from_slice(&4u32.to_le_bytes()); // Q4_2, long gone
    rest.extend_from_slice(&0u64.to_le_bytes());
    rest.extend_from_slice(&[0; 64]);
    file_fails(
        "inspect_tensor_type.gguf",
        &image(3, 1, 0, &rest),
        &["'w'", "unknown tensor type 4"],
    );
}

#[test]
fn misaligned_tensor() {
    let mut rest = gguf_str("t");
    rest.extend_from_slice(&1u32.to_le_bytes());
    rest.extend_from_slice(&4u64.to_le_bytes());
    rest.extend_from_slice(&0u32.to_le_bytes()); // F32
    rest.extend_from_slice(&8u64.to_le_bytes());
    rest.extend_from_slice(&[0; 64]);
    file_fails(
        "inspect_misaligned.gguf",
        &image(3, 1, 0, &rest),
        &["'t'", "offset 8", "alignment 32"],
    );
}

#[test]
fn garbage() {
    // Pseudo-random bytes behind a valid magic and version.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut rest = Vec::new();
    for _ in 0..4096 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        rest.push(x as u8);
    }
    let mut b = b"GGUF\x03\0\0\0".to_vec();
    b.extend_from_slice(&rest);
    file_fails("inspect_garbage.gguf", &b, &["not a valid GGUF file"]);
}
