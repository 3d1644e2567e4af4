#!/usr/bin/env python3
"""Run llama-quantize and `rustorch quantize` on the same model and compare the outputs.

    scripts/compare-quantize.py MODEL TYPE [TYPE ...] [--threads N] [--out DIR] [--reuse]
                                [--all] [--record FILE] [--extra ARG ...]
                                [--imatrix TEXT [--imatrix-args "ARGS"] [--record-imatrix DIR]]

For each llama.cpp file type (Q4_K_M, Q6_K, IQ4_XS, ...) both tools run with
`--allow-requantize MODEL OUT TYPE THREADS`; then the two GGUF files are compared tensor by
tensor (order, name, shape, type, data bytes) and key by key (order, type, value bytes), and the
whole files byte for byte. Prints one table per type (only the tensors that differ unless --all)
and a summary table; exit status 1 if anything differs.

--reuse keeps an existing llama-quantize output in DIR instead of running it again (the
1.5B-parameter models take a while on two cores). --record FILE writes the llama-quantize
output's tensor list (name, type, shape, SHA-256 of the data) as JSON, the fixture format of
crates/rustorch-cli/tests/quantize_cli.rs (only with one TYPE).

--imatrix TEXT: importance-matrix quantization. First each tool computes an importance matrix of
MODEL over TEXT (llama-imatrix and `rustorch imatrix`, both with `-m MODEL -f TEXT -o
imatrix.gguf -t THREADS` and --imatrix-args, default "-c 128 -ub 32 --chunks 8"), each in its own
directory DIR/llama and DIR/rustorch with a copy of TEXT, so that both files name the same text
(its file name) and both quantized models the same imatrix file; the two matrices are compared entry by entry (counts, and the sums:
how many values differ, largest and median relative difference) and their perplexity lines. Then
for each TYPE llama-quantize quantizes with llama-imatrix's matrix and rustorch with its own, and
the outputs are compared as above. --reuse also keeps llama-imatrix's matrix.
--record-imatrix DIR (with --imatrix) copies llama-imatrix's matrix and text there and writes
DIR/<model>.json: the commands, llama-imatrix's perplexity output, and per TYPE llama-quantize's
file SHA-256 and tensor list (the fixture of crates/rustorch-cli/tests/imatrix_cli.rs).

Binaries: $LLAMA_QUANTIZE (default ~/.cache/rustorch/lcpp-build/bin/llama-quantize, built by
scripts/build-llama-cpp.sh), $LLAMA_IMATRIX (default the llama-imatrix beside it) and $RUSTORCH
(default target/release/rustorch).
No dependencies beyond the Python standard library.
"""

import argparse
import array
import hashlib
import json
import mmap
import os
import shlex
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

GGML_TYPES = {
    0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 9: "q8_1",
    10: "q2_K", 11: "q3_K", 12: "q4_K", 13: "q5_K", 14: "q6_K", 15: "q8_K", 16: "iq2_xxs",
    17: "iq2_xs", 18: "iq3_xxs", 19: "iq1_s", 20: "iq4_nl", 21: "iq3_s", 22: "iq2_s",
    23: "iq4_xs", 24: "i8", 25: "i16", 26: "i32", 27: "i64", 28: "f64", 29: "iq1_m",
    30: "bf16", 34: "tq1_0", 35: "tq2_0", 39: "mxfp4", 40: "nvfp4", 41: "q1_0", 42: "q2_0",
}
# (block size, bytes per block)
GGML_SIZES = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
    9: (32, 36), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210),
    15: (256, 292), 16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18),
    21: (256, 110), 22: (256, 82), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4),
    27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66),
    39: (32, 17), 40: (64, 36), 41: (128, 18), 42: (64, 18),
}
SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class Gguf:
    """A GGUF file: metadata as raw value bytes in file order, tensor infos, data views."""

    def __init__(self, path):
        self.path = Path(path)
        f = open(path, "rb")
        self.buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.pos = 0
        if self.buf[:4] != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        self.pos = 4
        self.version, n_tensors, n_kv = self.unpack("<IQQ")
        self.kv = []  # (key, type, raw bytes of the value)
        for _ in range(n_kv):
            key = self.string()
            (vtype,) = self.unpack("<I")
            start = self.pos
            self.skip_value(vtype)
            self.kv.append((key, vtype, bytes(self.buf[start:self.pos])))
        self.alignment = 32
        for key, vtype, raw in self.kv:
            if key == "general.alignment" and vtype == 4:
                self.alignment = struct.unpack("<I", raw)[0]
        self.tensors = []
        for _ in range(n_tensors):
            name = self.string()
            (nd,) = self.unpack("<I")
            dims = list(self.unpack(f"<{nd}Q"))
            ty, offset = self.unpack("<IQ")
            n = 1
            for d in dims:
                n *= d
            bs, ts = GGML_SIZES[ty]
            self.tensors.append({"name": name, "dims": dims, "type": ty, "offset": offset,
                                 "nbytes": n // bs * ts})
        self.header_end = self.pos
        self.data_start = (self.pos + self.alignment - 1) // self.alignment * self.alignment

    def unpack(self, fmt):
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self):
        (n,) = self.unpack("<Q")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", "replace")
        self.pos += n
        return s

    def skip_value(self, vtype):
        if vtype == 8:
            (n,) = self.unpack("<Q")
            self.pos += n
        elif vtype == 9:
            etype, n = self.unpack("<IQ")
            if etype in SCALAR:
                self.pos += n * struct.calcsize("<" + SCALAR[etype])
            else:
                for _ in range(n):
                    self.skip_value(etype)
        else:
            self.pos += struct.calcsize("<" + SCALAR[vtype])

    def data(self, t):
        o = self.data_start + t["offset"]
        return self.buf[o:o + t["nbytes"]]

    def value(self, key):
        for k, vtype, raw in self.kv:
            if k == key:
                if vtype in SCALAR:
                    return struct.unpack("<" + SCALAR[vtype], raw)[0]
                if vtype == 8:
                    return raw[8:].decode("utf-8", "replace")
                return f"<{len(raw)} bytes>"
        return None


def run(cmd, log, cwd=None, stdout=None):
    """Runs cmd with its output in log (stdout alone in the file `stdout` when given)."""
    t0 = time.time()
    with open(log, "w") as f:
        if stdout is None:
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd)
        else:
            with open(stdout, "w") as o:
                r = subprocess.run(cmd, stdout=o, stderr=f, cwd=cwd)
    dt = time.time() - t0
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(map(str, cmd))}\n  see {log}")
    return dt


def ppl_lines(path):
    """The perplexity lines of an imatrix run's stdout ([1]...,[2]..., Final estimate)."""
    lines = Path(path).read_text().splitlines()
    return [l.strip() for l in lines if l.startswith("[") or l.startswith("Final estimate")]


def compare_imatrix(ref, ours):
    """Entry-by-entry comparison of two GGUF imatrix files; returns a summary dict."""
    def values(g):
        out = {}
        for t in g.tensors:
            a = array.array("f")
            a.frombytes(bytes(g.data(t)))
            out[t["name"]] = a
        return out
    rv, ov = values(ref), values(ours)
    s = {"entries": sum(n.endswith(".in_sum2") for n in rv), "same_names": set(rv) == set(ov),
         "counts": True, "values": 0, "differ": 0, "max_rel": 0.0, "worst": "", "rels": []}
    for name in sorted(set(rv) & set(ov)):
        a, b = rv[name], ov[name]
        if name.endswith(".counts"):
            s["counts"] &= list(a) == list(b)
            continue
        if len(a) != len(b):
            s["differ"] += max(len(a), len(b))
            continue
        for x, y in zip(a, b):
            s["values"] += 1
            if x != y:
                s["differ"] += 1
                r = abs(x - y) / max(abs(x), 1e-30)
                s["rels"].append(r)
                if r > s["max_rel"]:
                    s["max_rel"], s["worst"] = r, name
    rels = sorted(s.pop("rels"))
    s["median_rel"] = rels[len(rels) // 2] if rels else 0.0
    s["kv"] = ref.kv == ours.kv
    s["file"] = len(ref.buf) == len(ours.buf) and ref.buf[:] == ours.buf[:]
    return s


def imatrix_step(a, out, lq):
    """Computes both importance matrices; returns (llama dir, rustorch dir, summary)."""
    li = os.environ.get("LLAMA_IMATRIX", str(Path(lq).with_name("llama-imatrix")))
    rt = os.environ.get("RUSTORCH", str(ROOT / "target/release/rustorch"))
    text = Path(a.imatrix).name
    model = str(Path(a.model).resolve())
    extra = shlex.split(a.imatrix_args)
    dirs = {"llama": out / "llama", "rustorch": out / "rustorch"}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
        # the text beside each matrix, named as the matrix records it (its file name)
        shutil.copy(a.imatrix, d / text)
    common = ["-m", model, "-f", text, "-o", "imatrix.gguf", "-t", str(a.threads), *extra]
    times = {}
    if a.reuse and (dirs["llama"] / "imatrix.gguf").is_file():
        times["llama"] = float("nan")
    else:
        times["llama"] = run([li, *common], dirs["llama"] / "imatrix.log", cwd=dirs["llama"],
                             stdout=dirs["llama"] / "imatrix.out")
    times["rustorch"] = run([rt, "imatrix", *common], dirs["rustorch"] / "imatrix.log",
                            cwd=dirs["rustorch"], stdout=dirs["rustorch"] / "imatrix.out")
    ref = Gguf(dirs["llama"] / "imatrix.gguf")
    ours = Gguf(dirs["rustorch"] / "imatrix.gguf")
    s = compare_imatrix(ref, ours)
    s["ppl_ref"] = ppl_lines(dirs["llama"] / "imatrix.out")
    s["ppl_our"] = ppl_lines(dirs["rustorch"] / "imatrix.out")
    s["t_ref"], s["t_our"] = times["llama"], times["rustorch"]
    print(f"== imatrix of {Path(a.model).name} over {Path(a.imatrix).name} ({a.imatrix_args}): "
          f"{s['entries']} entries, {s['values']} values")
    print(f"  names {'same' if s['same_names'] else 'DIFF'}, counts {'same' if s['counts'] else 'DIFF'}, "
          f"metadata {'same' if s['kv'] else 'DIFF'}, values differing {s['differ']}, "
          f"max rel {s['max_rel']:.3e} {s['worst']}, median rel (of differing) {s['median_rel']:.3e}, "
          f"file {'identical' if s['file'] else 'DIFFERENT'}")
    same_ppl = s["ppl_ref"] == s["ppl_our"]
    print(f"  perplexity output {'same' if same_ppl else 'DIFFERENT'}")
    if not same_ppl:
        print(f"    llama-imatrix: {s['ppl_ref']}\n    rustorch:      {s['ppl_our']}")
    print(f"  time: llama-imatrix {times['llama']:.1f} s, rustorch imatrix {times['rustorch']:.1f} s")
    return dirs, s


def shape(dims):
    return "x".join(str(d) for d in dims)


def compare(ref, ours, show_all):
    """Prints the per-tensor table; returns a summary dict."""
    s = {"tensors": len(ref.tensors), "types": 0, "bytes": 0, "order": True}
    if [t["name"] for t in ref.tensors] != [t["name"] for t in ours.tensors]:
        s["order"] = False
    by_name = {t["name"]: t for t in ours.tensors}
    rows = []
    for i, rt in enumerate(ref.tensors):
        ot = by_name.get(rt["name"])
        if ot is None:
            rows.append((i, rt["name"], shape(rt["dims"]), GGML_TYPES[rt["type"]], "missing", "", "no"))
            continue
        same_shape = rt["dims"] == ot["dims"]
        same_type = rt["type"] == ot["type"]
        same_bytes = same_type and same_shape and rt["nbytes"] == ot["nbytes"] and \
            ref.data(rt) == ours.data(ot)
        s["types"] += same_type and same_shape
        s["bytes"] += same_bytes
        if show_all or not same_bytes:
            rows.append((i, rt["name"], shape(rt["dims"]) + ("" if same_shape else " / " + shape(ot["dims"])),
                         GGML_TYPES[rt["type"]], GGML_TYPES[ot["type"]],
                         "=" if same_type else "DIFF", "yes" if same_bytes else "NO"))
    extra = set(by_name) - {t["name"] for t in ref.tensors}
    for name in sorted(extra):
        rows.append(("-", name, "", "missing", GGML_TYPES[by_name[name]["type"]], "", "no"))
    if rows:
        print(f"  {'#':>4}  {'tensor':<34} {'shape':<16} {'llama-quantize':<14} {'rustorch':<9} {'type':<5} bytes")
        for r in rows:
            print(f"  {r[0]:>4}  {r[1]:<34} {r[2]:<16} {r[3]:<14} {r[4]:<9} {r[5]:<5} {r[6]}")
    # metadata: same keys, order, types and value bytes
    s["kv"] = ref.kv == ours.kv
    if not s["kv"]:
        rk = [(k, t) for k, t, _ in ref.kv]
        ok = [(k, t) for k, t, _ in ours.kv]
        if rk != ok:
            print(f"  metadata keys differ:\n    llama-quantize {rk}\n    rustorch       {ok}")
        for (k, t, v), (k2, t2, v2) in zip(ref.kv, ours.kv):
            if k == k2 and v != v2:
                print(f"  metadata value differs: {k}: {ref.value(k)!r} vs {ours.value(k)!r}")
    s["header"] = ref.buf[:ref.data_start] == ours.buf[:ours.data_start]
    s["file"] = len(ref.buf) == len(ours.buf) and ref.buf[:] == ours.buf[:]
    return s


def tensor_list(g):
    return [{"name": t["name"], "type": GGML_TYPES[t["type"]], "shape": t["dims"],
             "sha256": hashlib.sha256(g.data(t)).hexdigest()} for t in g.tensors]


def record_imatrix(a, dirs, files):
    """Writes the imatrix fixture (see --record-imatrix)."""
    rec = Path(a.record_imatrix)
    rec.mkdir(parents=True, exist_ok=True)
    stem = Path(a.model).name.removesuffix(".gguf")
    shutil.copy(dirs["llama"] / "imatrix.gguf", rec / f"{stem}.imatrix.gguf")
    if not (rec / Path(a.imatrix).name).exists() or not (rec / Path(a.imatrix).name).samefile(a.imatrix):
        shutil.copy(a.imatrix, rec / Path(a.imatrix).name)
    doc = {
        "source": "llama-imatrix and llama-quantize (llama.cpp 0.3.36), recorded by "
                  "scripts/compare-quantize.py --record-imatrix",
        "model": Path(a.model).name,
        "text": Path(a.imatrix).name,
        "imatrix_args": a.imatrix_args,
        "imatrix_sha256": hashlib.sha256((dirs["llama"] / "imatrix.gguf").read_bytes()).hexdigest(),
        "ppl": ppl_lines(dirs["llama"] / "imatrix.out"),
        "quantized": {},
    }
    for ty, g in files:
        doc["quantized"][ty] = {
            "file_size": len(g.buf),
            "file_sha256": hashlib.sha256(g.buf[:]).hexdigest(),
            "tensors": [[t["name"], t["type"], t["sha256"][:16]] for t in tensor_list(g)],
        }
    head = json.dumps({k: v for k, v in doc.items() if k != "quantized"}, indent=1)[:-2]
    parts = []
    for ty, q in doc["quantized"].items():
        rows = ",\n".join("    " + json.dumps(t) for t in q["tensors"])
        parts.append(f'  "{ty}": {{"file_size": {q["file_size"]}, "file_sha256": "{q["file_sha256"]}", '
                     f'"tensors": [\n{rows}\n  ]}}')
    path = rec / f"{stem}.json"
    path.write_text(f'{head},\n "quantized": {{\n' + ",\n".join(parts) + "\n }\n}\n")
    json.loads(path.read_text())
    print(f"recorded {path} and {rec / (stem + '.imatrix.gguf')}")


def record(ref, path, model, ftype):
    out = {
        "source": "llama-quantize (llama.cpp 0.3.36) --allow-requantize, recorded by scripts/compare-quantize.py",
        "model": model,
        "ftype": ftype,
        "file_type": ref.value("general.file_type"),
        "file_size": len(ref.buf),
        "file_sha256": hashlib.sha256(ref.buf[:]).hexdigest(),
        "tensors": [
            {"name": t["name"], "type": GGML_TYPES[t["type"]], "shape": t["dims"],
             "sha256": hashlib.sha256(ref.data(t)).hexdigest()}
            for t in ref.tensors
        ],
    }
    head = json.dumps({k: v for k, v in out.items() if k != "tensors"}, indent=1)[:-2]
    rows = ",\n".join("  " + json.dumps(t) for t in out["tensors"])
    Path(path).write_text(f'{head},\n "tensors": [\n{rows}\n ]\n}}\n')
    json.loads(Path(path).read_text())
    print(f"recorded {len(out['tensors'])} tensors -> {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("types", nargs="+")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="/tmp/compare-quantize")
    ap.add_argument("--reuse", action="store_true", help="keep existing llama-quantize outputs")
    ap.add_argument("--all", action="store_true", help="list every tensor, not only differences")
    ap.add_argument("--record", help="write the llama-quantize tensor list as a JSON fixture")
    ap.add_argument("--keep", action="store_true", help="keep the rustorch outputs")
    ap.add_argument("--extra", action="append", default=[],
                    help="an extra flag for both tools (e.g. --extra=--pure)")
    ap.add_argument("--imatrix", metavar="TEXT",
                    help="compute an importance matrix over TEXT with each tool and quantize with it")
    ap.add_argument("--imatrix-args", default="-c 128 -ub 32 --chunks 8",
                    help="flags for both imatrix tools (default: %(default)s)")
    ap.add_argument("--record-imatrix", metavar="DIR",
                    help="record llama.cpp's imatrix and quantized tensor lists as a fixture")
    a = ap.parse_args()

    lq = os.environ.get("LLAMA_QUANTIZE", str(Path.home() / ".cache/rustorch/lcpp-build/bin/llama-quantize"))
    rt = os.environ.get("RUSTORCH", str(ROOT / "target/release/rustorch"))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = Path(a.model).name.removesuffix(".gguf")
    tag = "".join(a.extra).replace("-", "")
    summary = []
    im = None
    if a.imatrix:
        dirs, im = imatrix_step(a, out, lq)
        tag += ".imatrix"
    recorded = []
    for ty in a.types:
        ref_path = out / f"{stem}.{ty}{tag}.llama-quantize.gguf"
        our_path = out / f"{stem}.{ty}{tag}.rustorch.gguf"
        model = str(Path(a.model).resolve())
        args = ["--allow-requantize", *a.extra]
        # with an imatrix each tool runs in its own directory, naming "imatrix.gguf" there
        cwd = {"llama": None, "rustorch": None}
        if a.imatrix:
            args += ["--imatrix", "imatrix.gguf"]
            cwd = {k: str(d) for k, d in dirs.items()}
            ref_path, our_path = ref_path.resolve(), our_path.resolve()
        args.append(model)
        if a.reuse and ref_path.is_file():
            t_ref = float("nan")
        else:
            t_ref = run([lq, *args, ref_path, ty, str(a.threads)], out / f"{ref_path.name}.log",
                        cwd=cwd["llama"])
        t_our = run([rt, "quantize", *args, our_path, ty, str(a.threads)], out / f"{our_path.name}.log",
                    cwd=cwd["rustorch"])
        ref, ours = Gguf(ref_path), Gguf(our_path)
        if a.record_imatrix:
            recorded.append((ty, ref))
        print(f"== {stem} -> {ty}: {len(ref.tensors)} tensors")
        s = compare(ref, ours, a.all)
        s.update(type=ty, t_ref=t_ref, t_our=t_our, size=len(ref.buf))
        summary.append(s)
        if a.record:
            record(ref, a.record, Path(a.model).name, ty)
        if not a.keep:
            our_path.unlink()
    if a.record_imatrix:
        record_imatrix(a, dirs, recorded)

    print()
    print(f"{'model':<40} {'ftype':<8} {'tensors':>7} {'types =':>8} {'bytes =':>8} {'order':>6} "
          f"{'metadata':>8} {'file =':>7} {'MiB':>8} {'llama-q s':>9} {'rustorch s':>10}")
    ok = True
    if im is not None:
        ok &= im["file"] and im["ppl_ref"] == im["ppl_our"]
        print(f"{'imatrix':<40} {'':<8} {im['entries']:>7} {'':>8} {im['values'] - im['differ']:>8} "
              f"{'same' if im['same_names'] else 'DIFF':>6} {'same' if im['kv'] else 'DIFF':>8} "
              f"{'yes' if im['file'] else 'NO':>7} {'':>8} {im['t_ref']:>9.1f} {im['t_our']:>10.1f}")
    for s in summary:
        good = s["file"]
        ok &= good
        print(f"{stem:<40} {s['type']:<8} {s['tensors']:>7} {s['types']:>8} {s['bytes']:>8} "
              f"{'same' if s['order'] else 'DIFF':>6} {'same' if s['kv'] else 'DIFF':>8} "
              f"{'yes' if s['file'] else 'NO':>7} {s['size'] / 2**20:>8.1f} {s['t_ref']:>9.1f} {s['t_our']:>10.1f}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
