#!/usr/bin/env python3
"""Dumps every f32 intermediate tensor of one llama.cpp forward pass (the prompt as one
batch, flash attention on, 2 threads: the parity fixtures' settings) to an .npz file,
named as llama-eval-callback names them ("attn_norm-0", ...). Used with the
`tensor_sums` example's RUSTORCH_DUMP_DIR output and `scripts/compare_tensors.py` to find
the first operation where rustorch and llama.cpp part, element by element.

LLAMA_CPP_LIB_PATH=~/.cache/rustorch/lcpp-build/bin PYTHONPATH=~/.cache/rustorch/llama_cpp_python-0.3.36 \
  python3 scripts/dump_llama_tensors.py MODEL OUT.npz ID [ID ...]
  python3 scripts/dump_llama_tensors.py MODEL OUT_DIR ID [ID ...]   # for `rustorch diff --b dir:OUT_DIR`
"""
import ctypes
import os
import sys

import numpy as np
import llama_cpp


class TensorHead(ctypes.Structure):
    # the leading fields of `struct ggml_tensor`
    _fields_ = [
        ("type", ctypes.c_int32),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
    ]


def main():
    model_path, out, ids = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3:]]
    base = ctypes.CDLL(os.path.join(os.environ["LLAMA_CPP_LIB_PATH"], "libggml-base.so"))
    base.ggml_get_name.restype = ctypes.c_char_p
    base.ggml_get_name.argtypes = [ctypes.c_void_p]
    base.ggml_get_data.restype = ctypes.c_void_p
    base.ggml_get_data.argtypes = [ctypes.c_void_p]
    base.ggml_is_contiguous.restype = ctypes.c_bool
    base.ggml_is_contiguous.argtypes = [ctypes.c_void_p]
    tensors = {}

    def cb(t, ask, _user):
        if ask:
            return True
        head = TensorHead.from_address(t)
        name = base.ggml_get_name(t).decode()
        if head.type != 0 or not base.ggml_is_contiguous(t):
            return True
        n = head.ne[0] * head.ne[1] * head.ne[2] * head.ne[3]
        data = base.ggml_get_data(t)
        if not data:
            return True
        arr = np.ctypeslib.as_array((ctypes.c_float * n).from_address(data)).copy()
        key = name
        k = 1
        while key in tensors:
            k += 1
            key = f"{name}#{k}"
        tensors[key] = arr.reshape(head.ne[3], head.ne[2], head.ne[1], head.ne[0])
        return True

    callback = llama_cpp.ggml_backend_sched_eval_callback(cb)
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), mparams)
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = 512
    cparams.n_batch = 512
    cparams.n_threads = 2
    cparams.n_threads_batch = 2
    cparams.flash_attn_type = 1
    cparams.cb_eval = callback
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    batch = llama_cpp.llama_batch_init(len(ids), 0, 1)
    for i, tok in enumerate(ids):
        batch.token[i] = tok
        batch.pos[i] = i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = os.environ.get("ALL_LOGITS", "1") == "1" or i == len(ids) - 1
    batch.n_tokens = len(ids)
    if llama_cpp.llama_decode(ctx, batch) != 0:
        sys.exit("llama_decode failed")
    if out.endswith(".npz"):
        np.savez(out, **tensors)
    else:
        # a folder of NAME.f32 files (little-endian), for `rustorch diff --b dir:OUT`
        os.makedirs(out, exist_ok=True)
        for name, arr in tensors.items():
            arr.astype("<f4").tofile(os.path.join(out, f"{name}.f32"))
    print(f"{len(tensors)} tensors -> {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
