//! libFuzzer target: `cargo +nightly fuzz run gguf_reader` (from the repository root).
//! Parses the input with `GgufFile::from_bytes`; on success calls every accessor,
//! slices every tensor and round-trips the content through `GgufWriter`.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    rustorch_fuzz::fuzz_one(data);
});
