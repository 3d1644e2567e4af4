#!/usr/bin/env python3
"""Record the GGUF fixtures that rustorch's GGUF tests compare against.

Two kinds of fixture land in tests/fixtures/gguf/:

1. `<model>.json` for every real model in models/ and every vocab GGUF in
   models/vocab/, read with gguf-py's `GGUFReader` (the reference reader, the one
   behind `gguf-dump`). Each holds the header numbers (version, tensor count,
   metadata key count, alignment, data offset) and, per tensor, only its name,
   type and shape (ggml order, `ne[0]` first). crates/rustorch-cli/tests/
   inspect_models.rs runs `rustorch inspect --json` on the same files and
   compares.

2. `writer-reference.gguf` and `writer-reference-align64.gguf`, written with
   gguf-py's `GGUFWriter`, plus a `.json` description of each file's content:
   every metadata value type (nested arrays included), string arrays, bools,
   f64, and F32 / F16 / Q8_0 / I32 tensors of odd byte sizes, so that padding
   matters. crates/rustorch-core/tests/gguf_writer.rs rebuilds each file from its
   description with `rustorch_core::gguf::GgufWriter` and asserts the bytes are
   identical.

Usage (from the repository root):

    python3 scripts/record_gguf_fixtures.py              # everything present
    python3 scripts/record_gguf_fixtures.py --writer-only

Needs numpy and gguf (llama.cpp's gguf-py, 0.19 was used). Models that are absent
are skipped with a note; their committed fixtures are left as they are.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np

import gguf
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

ROOT = Path(__file__).resolve().parent.parent
MODELS = [
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen2.5-coder-0.5b-instruct-q4km.gguf",
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "gemma-3-270m-q4_k_m.gguf",
]


# ---------------------------------------------------------------------------
# 1. Model and vocab fixtures, via GGUFReader
# ---------------------------------------------------------------------------


def header_int(reader: GGUFReader, name: str) -> int:
    return int(reader.fields[name].parts[-1][0])


def record_model(path: Path, out_dir: Path) -> Path:
    reader = GGUFReader(path, "r")
    tensors = [
        {
            "name": t.name,
            "type": t.tensor_type.name,
            "shape": [int(d) for d in t.shape],
        }
        for t in reader.tensors
    ]
    # reader.fields holds three pseudo-fields for the header (GGUF.version,
    # GGUF.tensor_count, GGUF.kv_count) before the real key/value pairs.
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    kv_count = header_int(reader, "GGUF.kv_count")
    assert kv_count == len(keys), (path, kv_count, len(keys))
    fixture = {
        "file": path.name,
        "recorded_with": f"gguf-py {gguf_version()} GGUFReader",
        "version": header_int(reader, "GGUF.version"),
        "tensor_count": header_int(reader, "GGUF.tensor_count"),
        "kv_count": kv_count,
        "alignment": int(reader.alignment),
        "data_offset": int(reader.data_offset),
        "tensors": tensors,
    }
    out = out_dir / (path.name.removesuffix(".gguf") + ".json")
    write_json(out, fixture, compact_tensors=True)
    return out


# ---------------------------------------------------------------------------
# 2. Writer reference files, via GGUFWriter
# ---------------------------------------------------------------------------


def f32_node(x: float) -> dict[str, Any]:
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    value = struct.unpack("<f", struct.pack("<f", x))[0]
    return {"type": "FLOAT32", "value": json_float(value), "bits": f"{bits:08x}"}


def f64_node(x: float) -> dict[str, Any]:
    bits = struct.unpack("<Q", struct.pack("<d", x))[0]
    return {"type": "FLOAT64", "value": json_float(x), "bits": f"{bits:016x}"}


def json_float(x: float) -> Any:
    # JSON has no NaN or infinity; "bits" is what the test uses anyway.
    return x if math.isfinite(x) else str(x)


def node(vtype: GGUFValueType, value: Any, sub_type: GGUFValueType | None = None) -> dict[str, Any]:
    """Describes a value the way gguf-py's _pack_val will encode it."""
    if vtype == GGUFValueType.ARRAY:
        elem = sub_type if sub_type is not None else GGUFValueType.get_type(value[0])
        return {
            "type": "ARRAY",
            "elem_type": elem.name,
            "value": [node(elem, v) for v in value],
        }
    if vtype == GGUFValueType.FLOAT32:
        return f32_node(value)
    if vtype == GGUFValueType.FLOAT64:
        return f64_node(value)
    return {"type": vtype.name, "value": value}


# (key, type, value, array sub-type) in the order they are added. gguf-py's
# get_type() gives INT32 for ints, FLOAT32 for floats, BOOL, STRING, ARRAY; other
# element types need an explicit sub_type.
T = GGUFValueType
METADATA: list[tuple[str, GGUFValueType, Any, GGUFValueType | None]] = [
    ("general.name", T.STRING, "writer reference", None),
    ("test.u8", T.UINT8, 200, None),
    ("test.i8", T.INT8, -100, None),
    ("test.u16", T.UINT16, 65000, None),
    ("test.i16", T.INT16, -32000, None),
    ("test.u32", T.UINT32, 4_000_000_000, None),
    ("test.i32", T.INT32, -2_000_000_000, None),
    ("test.f32", T.FLOAT32, 0.1, None),
    ("test.f32.neg_zero", T.FLOAT32, -0.0, None),
    ("test.f32.inf", T.FLOAT32, float("inf"), None),
    ("test.u64", T.UINT64, 2**64 - 1, None),
    ("test.i64", T.INT64, -(2**63), None),
    ("test.f64", T.FLOAT64, math.pi, None),
    ("test.f64.tiny", T.FLOAT64, 5e-324, None),
    ("test.bool.true", T.BOOL, True, None),
    ("test.bool.false", T.BOOL, False, None),
    ("test.string", T.STRING, "h\u00e9llo, w\u00f6rld \u2713 \U0001f980 \"quoted\"\n\ttab", None),
    ("test.string.long", T.STRING, "{% for m in messages %}" + "x" * 300 + "{% endfor %}", None),
    ("test.array.string", T.ARRAY, ["a", "", "\u00f1and\u00fa", "<|im_start|>", "\u0120t"], None),
    ("test.array.i32", T.ARRAY, [1, -2, 3, 2_147_483_647, -2_147_483_648], None),
    ("test.array.f32", T.ARRAY, [0.5, -1.25, 1e-3, 3.4e38], None),
    ("test.array.bool", T.ARRAY, [True, False, True], None),
    ("test.array.u8", T.ARRAY, [0, 1, 127, 255], T.UINT8),
    ("test.array.i8", T.ARRAY, [-128, 0, 127], T.INT8),
    ("test.array.u16", T.ARRAY, [0, 65535], T.UINT16),
    ("test.array.i16", T.ARRAY, [-32768, 32767], T.INT16),
    ("test.array.u32", T.ARRAY, [0, 4_294_967_295], T.UINT32),
    ("test.array.u64", T.ARRAY, [0, 2**64 - 1, 2**40], T.UINT64),
    ("test.array.i64", T.ARRAY, [-(2**63), 2**63 - 1], T.INT64),
    ("test.array.f64", T.ARRAY, [2.5, -1e300, 1e-300], T.FLOAT64),
    ("test.array.long", T.ARRAY, list(range(20)), None),
    ("test.array.nested", T.ARRAY, [[1, 2], [3], [4, 5, 6]], None),
    ("test.array.nested_mixed", T.ARRAY, [[1, 2], ["x", "y"], [True], [0.25]], None),
    ("test.array.nested3", T.ARRAY, [[["a"], ["b", "c"]], [["d"]]], None),
    ("tokenizer.chat_template", T.STRING, "{{ bos_token }}{% for message in messages %}"
        "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}", None),
]


def tensors(rng: np.random.Generator) -> list[dict[str, Any]]:
    """Tensors with odd byte sizes, numpy shapes (row length last)."""
    q8_rows, q8_blocks = 3, 2  # 3 rows of 64 elements = 3 * 2 blocks of 34 bytes
    q8 = rng.integers(0, 256, size=(q8_rows, q8_blocks * 34), dtype=np.uint8)
    return [
        # 60 bytes: 4 bytes of padding follow
        {"name": "tensor.f32", "array": (np.arange(15, dtype=np.float32) * 0.5 - 3).reshape(3, 5),
         "raw_dtype": None},
        # 14 bytes
        {"name": "tensor.f16", "array": np.array([1, -2, 0.5, 65504, -0.0, 1e-4, 3.14], dtype=np.float16),
         "raw_dtype": None},
        # 204 bytes, passed as raw bytes: gguf-py turns the byte shape (3, 68) into (3, 64)
        {"name": "tensor.q8_0", "array": q8, "raw_dtype": GGMLQuantizationType.Q8_0},
        # 4-D, 12 bytes
        {"name": "blk.0.tensor.f16.4d",
         "array": rng.standard_normal((2, 1, 3, 1)).astype(np.float16), "raw_dtype": None},
        # 4 bytes
        {"name": "tensor.i32", "array": np.array([-7], dtype=np.int32), "raw_dtype": None},
    ]


def write_reference(out_dir: Path, name: str, alignment: int | None) -> Path:
    path = out_dir / f"{name}.gguf"
    arch = "rustorch-test"
    w = GGUFWriter(path, arch)  # adds general.architecture itself, first
    described: list[dict[str, Any]] = [{"key": "general.architecture", **node(T.STRING, arch)}]
    if alignment is not None:
        w.add_custom_alignment(alignment)  # adds general.alignment as UINT32
        described.append({"key": "general.alignment", **node(T.UINT32, alignment)})
    for key, vtype, value, sub_type in METADATA:
        w.add_key_value(key, value, vtype, sub_type=sub_type)
        described.append({"key": key, **node(vtype, value, sub_type)})

    rng = np.random.default_rng(20240607)
    described_tensors = []
    for t in tensors(rng):
        arr = t["array"]
        w.add_tensor(t["name"], arr, raw_dtype=t["raw_dtype"])
        info = w.tensors[-1][t["name"]]
        ggml_shape = [int(d) for d in reversed(info.shape)]
        described_tensors.append({
            "name": t["name"],
            "type": GGMLQuantizationType(info.dtype).name,
            "shape": ggml_shape,
            "n_bytes": int(arr.nbytes),
            "data_hex": arr.tobytes().hex(),
        })

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    # Cross-check with the reference reader before committing anything.
    reader = GGUFReader(path, "r")
    assert [t.name for t in reader.tensors] == [t["name"] for t in described_tensors]
    for rt, dt in zip(reader.tensors, described_tensors):
        assert [int(d) for d in rt.shape] == dt["shape"], (rt.name, rt.shape, dt["shape"])
        assert rt.tensor_type.name == dt["type"]
        start = rt.data_offset
        assert path.read_bytes()[start:start + rt.n_bytes].hex() == dt["data_hex"]
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert keys == [d["key"] for d in described], keys

    data = path.read_bytes()
    description = {
        "file": path.name,
        "written_with": f"gguf-py {gguf_version()} GGUFWriter",
        "version": 3,
        "alignment": alignment if alignment is not None else 32,
        "data_offset": int(reader.data_offset),
        "size": len(data),
        "metadata": described,
        "tensors": described_tensors,
    }
    write_json(out_dir / f"{name}.json", description, compact_tensors=False)
    return path


# ---------------------------------------------------------------------------


def gguf_version() -> str:
    try:
        from importlib.metadata import version

        return version("gguf")
    except Exception:  # pragma: no cover
        return getattr(gguf, "__version__", "?")


def write_json(path: Path, obj: Any, compact_tensors: bool) -> None:
    if compact_tensors:
        # One tensor per line keeps the files small and diffs readable.
        head = {k: v for k, v in obj.items() if k != "tensors"}
        text = json.dumps(head, indent=1, ensure_ascii=False)[:-2]
        lines = [json.dumps(t, ensure_ascii=False, separators=(",", ":")) for t in obj["tensors"]]
        text += ',\n "tensors": [' + ("\n  " + ",\n  ".join(lines) + "\n ]" if lines else "]") + "\n}\n"
        json.loads(text)  # stays valid JSON
        path.write_text(text, encoding="utf-8")
    else:
        path.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=Path, default=ROOT / "models")
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "gguf")
    ap.add_argument("--writer-only", action="store_true", help="only the GGUFWriter reference files")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    for name, alignment in (("writer-reference", None), ("writer-reference-align64", 64)):
        p = write_reference(args.out, name, alignment)
        print(f"wrote {p.relative_to(ROOT)} ({p.stat().st_size} bytes)")

    if args.writer_only:
        return 0

    paths = [args.models / m for m in MODELS] + sorted((args.models / "vocab").glob("*.gguf"))
    for p in paths:
        if not p.is_file():
            print(f"skip {p}: not present (scripts/fetch-models.sh --all fetches it)", file=sys.stderr)
            continue
        out = record_model(p, args.out)
        print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
