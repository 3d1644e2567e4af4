#!/usr/bin/env python3
"""Generate crates/rustorch-core/src/quant/grids.rs from llama.cpp's ggml-common.h.

The low-bit formats (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, MXFP4) decode through
fixed lookup tables that ggml defines in ggml/src/ggml-common.h with GGML_TABLE_BEGIN(type, name,
size) ... GGML_TABLE_END(). This script copies those tables, value for value, into a Rust source
file instead of anyone typing them: it reads each table's C element type, name and size (a number
or a #define such as NGRID_IQ1S), parses the integer literals between the two macros, checks the
count against the declared size, and writes them back in the same notation (hex stays hex).
The generated file names the header and its SHA-256.

How to run (re-runnable; the output is deterministic):

  python3 scripts/gen_quant_grids.py \
      [--header ~/.cache/rustorch/llama_cpp_python-0.3.36/vendor/llama.cpp/ggml/src/ggml-common.h] \
      [--out crates/rustorch-core/src/quant/grids.rs] [--check]

--check compares instead of writing and exits 1 if the committed file differs. The tables carry
#[rustfmt::skip], so `cargo fmt` leaves the generated layout alone.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

DEFAULT_HEADER = (
    Path.home() / ".cache/rustorch/llama_cpp_python-0.3.36/vendor/llama.cpp/ggml/src/ggml-common.h"
)

# (C name, Rust name, doc line). Order is the order in the generated file.
TABLES = [
    ("kmask_iq2xs", "KMASK_IQ2XS", "Bit `j` of a sign byte: `1 << j`."),
    (
        "ksigns_iq2xs",
        "KSIGNS_IQ2XS",
        "Sign byte of 7 stored sign bits: the 8th bit makes the number of minus signs even.",
    ),
    ("iq2xxs_grid", "IQ2XXS_GRID", "IQ2_XXS: 256 groups of 8 magnitudes (bytes, little-endian)."),
    ("iq2xs_grid", "IQ2XS_GRID", "IQ2_XS: 512 groups of 8 magnitudes (bytes, little-endian)."),
    ("iq2s_grid", "IQ2S_GRID", "IQ2_S: 1024 groups of 8 magnitudes (bytes, little-endian)."),
    ("iq3xxs_grid", "IQ3XXS_GRID", "IQ3_XXS: 256 groups of 4 magnitudes (bytes, little-endian)."),
    ("iq3s_grid", "IQ3S_GRID", "IQ3_S: 512 groups of 4 magnitudes (bytes, little-endian)."),
    (
        "iq1s_grid",
        "IQ1S_GRID",
        "IQ1_S / IQ1_M: 2048 groups of 8 values in {-1, 0, 1} (signed bytes, little-endian).",
    ),
    ("kvalues_fp4", "KVALUES_MXFP4", "MXFP4: the E2M1 values doubled (`kvalues_mxfp4`)."),
]

C_TO_RUST = {"uint8_t": "u8", "int8_t": "i8", "uint16_t": "u16", "uint32_t": "u32", "uint64_t": "u64"}
BITS = {"u8": 8, "i8": 8, "u16": 16, "u32": 32, "u64": 64}

BEGIN = re.compile(r"^GGML_TABLE_BEGIN\(\s*(\w+)\s*,\s*(\w+)\s*,\s*(\w+)\s*\)", re.M)


def parse(text: str) -> dict[str, tuple[str, list[str]]]:
    defines = dict(re.findall(r"^#define\s+(\w+)\s+(\d+)\s*$", text, re.M))
    tables = {}
    for m in BEGIN.finditer(text):  # at a line start: not the #define lines
        ctype, name, size = m.groups()
        end = text.index("GGML_TABLE_END()", m.end())
        body = re.sub(r"//[^\n]*", "", text[m.end() : end])
        items = [t.strip() for t in body.split(",") if t.strip()]
        n = int(defines.get(size, size))
        if len(items) != n:
            raise SystemExit(f"{name}: {len(items)} values, declared {n}")
        for t in items:
            if not re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", t):
                raise SystemExit(f"{name}: unexpected literal {t!r}")
        if name in tables:
            raise SystemExit(f"{name} defined twice")
        tables[name] = (ctype, items)
    return tables


def rust_table(rust_name: str, doc: str, c_name: str, ctype: str, items: list[str]) -> str:
    rty = C_TO_RUST[ctype]
    for t in items:
        v = int(t, 0)
        lo, hi = (-(1 << 7), (1 << 7) - 1) if rty == "i8" else (0, (1 << BITS[rty]) - 1)
        if not lo <= v <= hi:
            raise SystemExit(f"{c_name}: {t} does not fit {rty}")
    hexa = items[0].lower().startswith("0x")
    if hexa:
        width = max(len(t) for t in items)
        lits = [t.lower().rjust(width) for t in items]
        per_line = max(1, 96 // (width + 2))
    else:
        lits = items
        per_line = 16
    lines = []
    for i in range(0, len(lits), per_line):
        lines.append("    " + ", ".join(lits[i : i + per_line]) + ",")
    body = "\n".join(lines)
    return (
        f"/// {doc}\n/// ggml: `{c_name}` ({ctype}[{len(items)}]).\n"
        f"#[rustfmt::skip]\npub static {rust_name}: [{rty}; {len(items)}] = [\n{body}\n];\n"
    )


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--header", default=str(DEFAULT_HEADER))
    ap.add_argument("--out", default=str(root / "crates/rustorch-core/src/quant/grids.rs"))
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()

    raw = Path(args.header).read_bytes()
    tables = parse(raw.decode())
    out = [
        "//! Lookup tables of ggml's low-bit formats, generated by `scripts/gen_quant_grids.py` from",
        "//! llama.cpp's `ggml/src/ggml-common.h` (the tree vendored in llama-cpp-python 0.3.36,",
        f"//! SHA-256 {hashlib.sha256(raw).hexdigest()}).",
        "//! Do not edit by hand: rerun the script. Values are in ggml's order and notation; a",
        "//! `u64`/`u32` grid entry holds its 8/4 byte-sized values little-endian (value `j` is",
        "//! `(entry >> 8j) as u8`), which is how ggml reads them through a byte pointer.",
        "",
    ]
    for c_name, rust_name, doc in TABLES:
        ctype, items = tables[c_name]
        out.append(rust_table(rust_name, doc, c_name, ctype, items))
    text = "\n".join(out)
    dest = Path(args.out)
    if args.check:
        same = dest.exists() and dest.read_text() == text
        print(f"{dest}: {'up to date' if same else 'DIFFERS from the header'}")
        return 0 if same else 1
    dest.write_text(text)
    print(f"wrote {dest} ({len(text)} bytes, {len(TABLES)} tables)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
