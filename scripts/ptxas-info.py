#!/usr/bin/env python3
"""Registers, spills and shared memory per kernel as ptxas reports them for sm_90, through
NVRTC (no GPU needed): the kernel sources compiled as rustorch compiles them (common.cuh
first, then the .cu files in crates/rustorch-cuda/src/device.rs's order, with the defines
of a default run).

  scripts/ptxas-info.py [--nvrtc PATH/libnvrtc.so.13] [-D NAME[=VALUE]]... [FILTER]

FILTER keeps kernels whose name starts with it (e.g. mmvd_q4_k). -D adds a define as
RUSTORCH_CUDA_DEFS does (e.g. -D MMVD_Q4K_MINB=8). Each line ends with the kernel's machine
code size (its .text section in the cubin). --cubin FILE keeps the cubin, e.g. for
`cuobjdump -sass FILE` (the nvidia-cuda-cuobjdump wheel has one)."""
import argparse
import ctypes
import os
import re
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K = os.path.join(ROOT, "crates", "rustorch-cuda", "kernels")
FILES = ["common.cuh", "quant.cu", "exact.cu", "ops.cu", "attn.cu"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nvrtc", default=os.environ.get("RUSTORCH_NVRTC", "libnvrtc.so.13"))
    ap.add_argument("-D", action="append", default=[], dest="defs")
    ap.add_argument("--cubin", help="also write the cubin there (for cuobjdump -sass)")
    ap.add_argument("filter", nargs="?", default="")
    a = ap.parse_args()
    lib = ctypes.CDLL(a.nvrtc)
    # the defaults' defines (device.rs kernel_source: weight prefetch on, 8 attention warps)
    src = "#define RT_PDL_PREFETCH\n#define ATTN_WARPS 8\n"
    for d in a.defs:
        k, _, v = d.partition("=")
        src += f"#define {k} {v}\n"
    for f in FILES:
        with open(os.path.join(K, f)) as fh:
            src += f"// ---- {f}\n" + fh.read() + "\n"
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"kernels.cu", 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    opts = [b"--std=c++17", b"--device-as-default-execution-space",
            b"--gpu-architecture=sm_90", b"--ptxas-options=-v"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, buf)
    log = buf.value.decode(errors="replace")
    if rc:
        sys.exit(log)
    sizes = text_sizes(lib, prog, a.cubin)
    cur, spill = None, ""
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            cur, spill = m.group(1), ""
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            spill = f", spills {m.group(1)} B stored / {m.group(2)} B loaded"
            continue
        m = re.search(r"Used (\d+) registers(.*)", line)
        if m and cur and cur.startswith(a.filter):
            code = f", {sizes[cur]} B of code" if cur in sizes else ""
            print(f"{cur}: {m.group(1)} registers{m.group(2)}{spill}{code}")


def text_sizes(lib, prog, path=None):
    """Bytes of each kernel's `.text.NAME` section in the program's cubin (64-bit ELF),
    which is written to `path` if given."""
    n = ctypes.c_size_t()
    if lib.nvrtcGetCUBINSize(prog, ctypes.byref(n)):
        return {}
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, buf)
    elf = buf.raw
    if path:
        with open(path, "wb") as fh:
            fh.write(elf)
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    secs = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    stroff = secs[shstrndx][4]
    out = {}
    for name_off, _, _, _, _, size in secs:
        end = elf.index(b"\0", stroff + name_off)
        name = elf[stroff + name_off:end].decode()
        if name.startswith(".text."):
            out[name[6:]] = size
    return out


if __name__ == "__main__":
    main()
