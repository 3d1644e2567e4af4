#!/usr/bin/env python3
"""Build small random-weight GGUF models for parity tests against llama.cpp.

Usage (from the repository root):

    python3 scripts/make-synthetic-models.py OUTDIR [ARCH ...]

writes OUTDIR/synthetic-<arch>.gguf for each ARCH (default: all of them) and prints
each file's size and sha256. Architectures: llama (Llama-3 `rope_freqs` factors),
qwen3 (Q/K norm), qwen3moe (router + top-k experts), gemma2 (attention and
final-logit soft-capping, alternating sliding window, tied output), phi3 (fused
attn_qkv, gate+up fused in ffn_up), gemma3 (Q/K norm, five sliding layers and one
global, separate RoPE base for the sliding ones, tied Q8_0 output) and gpt-oss
(attention sinks, YaRN RoPE, biases everywhere, alternating sliding window, biased
MoE with MXFP4 experts and clamped SwiGLU).

Every model is a pure function of its architecture's seed, the vocab GGUF and the
versions of numpy (Generator stream) and gguf-py (writer layout, Q8_0 rounding): the
same inputs give byte-identical files, so a test can rebuild a model and compare its
sha256 with the one recorded in tests/fixtures/synthetic/<arch>.json. numpy 2.4.6 and
gguf 0.19.0 were used.

Metadata keys and tensor names and shapes are those the llama.cpp of
llama-cpp-python 0.3.36 loads (src/models/<arch>.cpp, src/llama-model.cpp
load_hparams; key and tensor names from gguf-py's constants). Keys the converter
(convert_hf_to_gguf.py) writes for the architecture are written even where llama.cpp
treats them as optional, so the files look like converted ones; nothing else.

Tokenizer: every `tokenizer.*` key is copied, with its value types, from
models/vocab/ggml-vocab-deepseek-coder.gguf (BPE, pre-tokenizer `deepseek-coder`,
32256 tokens, the smallest BPE vocab there), checked against scripts/vocab.sha256.
n_vocab is that token count.

Shapes: n_embd 128, 4 query heads and 2 KV heads of 32, n_ff 256, context 2048,
4 layers (gemma3: 6, so that its default sliding-window pattern has a global layer).
Weights are Gaussian with per-tensor scales chosen so the model is not numerically
degenerate (N(0, 0.02) everywhere would give near-uniform attention, which would hide
RoPE, masking and soft-capping errors, and logits so flat that most greedy steps
would be near-ties): query/key projections give attention scores of a few units,
value/output/FFN projections keep activations O(1), and the output matrix gives
logits with a standard deviation of about 4. Norm weights are 1 + N(0, 0.1) in F32.
Matrices are F16 or Q8_0 per architecture (see SPECS); the MoE router stays F32, as
llama.cpp's quantizer leaves it.

To add an architecture, write one function `build_<name>(m: Model)` that sets its
hyper-parameters and tensors with the Model helpers, and register it with
`@architecture("<name>", seed=..., file_type=...)`.
"""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from gguf import MODEL_TENSOR as T

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = os.path.join(ROOT, "models", "vocab", "ggml-vocab-deepseek-coder.gguf")
VOCAB_SHA256 = os.path.join(ROOT, "scripts", "vocab.sha256")

# Shapes shared by every architecture.
N_CTX = 2048
N_EMBD = 128
N_HEAD = 4
N_HEAD_KV = 2
HEAD_DIM = 32
N_FF = 256
N_LAYER = 4

# Target spreads (standard deviations) of the quantities the weights produce.
LOGIT_STD = 4.0  # output logits before any soft-capping
SCORE_STD = 2.0  # attention scores q.k/sqrt(head_dim) (without Q/K norm)
ROUTER_STD = 2.0  # MoE router logits
NORM_NOISE = 0.1  # norm weights are 1 + N(0, NORM_NOISE)


# ----------------------------------------------------------------------------
# Tokenizer metadata


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def expected_vocab_sha256(name: str) -> str | None:
    with open(VOCAB_SHA256) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 2 and parts[1] == name:
                return parts[0]
    return None


@dataclass
class KeyValue:
    key: str
    value: object
    vtype: VT
    sub_type: VT | None = None


def read_tokenizer(path: str) -> list[KeyValue]:
    """All `tokenizer.*` keys of a vocab GGUF, in file order, with their GGUF types.
    Strings stay raw bytes so they are written back exactly."""
    want = expected_vocab_sha256(os.path.basename(path))
    got = file_sha256(path)
    if want is not None and want != got:
        sys.exit(f"{path}: sha256 {got} does not match scripts/vocab.sha256 ({want})")
    reader = gguf.GGUFReader(path)
    out = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == VT.ARRAY:
            sub = field.types[1]
            if sub == VT.ARRAY:
                raise ValueError(f"{key}: nested arrays are not expected in a vocab")
            if sub == VT.STRING:
                value = [bytes(field.parts[i]) for i in field.data]
            else:
                value = [field.parts[i][0].item() for i in field.data]
            out.append(KeyValue(key, value, vtype, sub))
        elif vtype == VT.STRING:
            out.append(KeyValue(key, bytes(field.parts[field.data[0]]), vtype))
        else:
            out.append(KeyValue(key, field.parts[field.data[0]][0].item(), vtype))
    return out


def token_count(tokenizer: list[KeyValue]) -> int:
    for kv in tokenizer:
        if kv.key == gguf.Keys.Tokenizer.LIST:
            return len(kv.value)
    raise ValueError("vocab has no tokenizer.ggml.tokens")


# ----------------------------------------------------------------------------
# Model writer


class Model:
    """One synthetic model: metadata and tensors in the order they are added, all
    random numbers drawn from one seeded Generator in that order."""

    def __init__(self, arch: str, seed: int, file_type: int, tokenizer: list[KeyValue]):
        self.arch = arch
        self.model_arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
        self.allowed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[self.model_arch]}
        self.rng = np.random.default_rng(seed)
        self.tokenizer = tokenizer
        self.n_vocab = token_count(tokenizer)
        # general.name leaves out the architecture: llama.cpp sets special-token
        # attributes by name ("phi3" or "phi-3" in it makes the vocab loader look up
        # Phi-3's "</s>", "<unk>", ... and fail on this vocab).
        self.kv: list[KeyValue] = [
            KeyValue(gguf.Keys.General.NAME, f"rustorch synthetic model, seed {seed}", VT.STRING),
            KeyValue(gguf.Keys.General.FILE_TYPE, file_type, VT.UINT32),
        ]
        self.tensors: list[tuple[str, np.ndarray, QT]] = []

    # metadata ---------------------------------------------------------------

    def key(self, template: str, value, vtype: VT) -> None:
        """A `{arch}.…` key from gguf.Keys.LLM / .Attention / .Rope."""
        self.kv.append(KeyValue(template.format(arch=self.arch), value, vtype))

    def u32(self, template: str, value: int) -> None:
        self.key(template, int(value), VT.UINT32)

    def f32(self, template: str, value: float) -> None:
        self.key(template, float(value), VT.FLOAT32)

    def common_hparams(self, *, rms_eps: float, rope_base: float, n_layer: int = N_LAYER,
                       n_ctx: int = N_CTX, n_ff: int = N_FF, n_head: int = N_HEAD) -> None:
        K = gguf.Keys
        self.u32(K.LLM.CONTEXT_LENGTH, n_ctx)
        self.u32(K.LLM.EMBEDDING_LENGTH, N_EMBD)
        self.u32(K.LLM.BLOCK_COUNT, n_layer)
        self.u32(K.LLM.FEED_FORWARD_LENGTH, n_ff)
        self.u32(K.Attention.HEAD_COUNT, n_head)
        self.u32(K.Attention.HEAD_COUNT_KV, N_HEAD_KV)
        self.f32(K.Rope.FREQ_BASE, rope_base)
        self.f32(K.Attention.LAYERNORM_RMS_EPS, rms_eps)

    # tensors ----------------------------------------------------------------

    def name(self, tensor: T, bid: int | None = None, suffix: str = "weight") -> str:
        base = gguf.TENSOR_NAMES[tensor]
        assert base in self.allowed, f"{base} is not a {self.arch} tensor in gguf-py"
        return (base.format(bid=bid) if bid is not None else base) + "." + suffix

    def normal(self, shape: tuple[int, ...], std: float) -> np.ndarray:
        return self.rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    def add(self, tensor: T, bid: int | None, data: np.ndarray, qtype: QT, suffix: str = "weight") -> None:
        """data in numpy order (rows last-but-one, columns last: ggml ne = reversed)."""
        data = np.ascontiguousarray(data, dtype=np.float32)
        self.tensors.append((self.name(tensor, bid, suffix), gguf.quants.quantize(data, qtype), qtype))

    def matrix(self, tensor: T, bid: int | None, rows: int, cols: int, std: float, qtype: QT) -> None:
        """A weight that maps `cols` inputs to `rows` outputs (ggml shape [cols, rows])."""
        self.add(tensor, bid, self.normal((rows, cols), std), qtype)

    def norm(self, tensor: T, bid: int | None, n: int = N_EMBD, center: float = 1.0) -> None:
        self.add(tensor, bid, center * (1.0 + self.normal((n,), NORM_NOISE)), QT.F32)

    def embeddings(self, qtype: QT, std: float = 1.0) -> None:
        self.matrix(T.TOKEN_EMBD, None, self.n_vocab, N_EMBD, std, qtype)

    def output(self, qtype: QT) -> None:
        self.norm(T.OUTPUT_NORM, None)
        self.matrix(T.OUTPUT, None, self.n_vocab, N_EMBD, LOGIT_STD / math.sqrt(N_EMBD), qtype)

    def attention(self, bid: int, qtype: QT, qk_std: float | None = None) -> None:
        """attn_q/k/v/output for n_head query heads and n_head_kv KV heads."""
        q_std = qk_std if qk_std is not None else qk_input_std(SCORE_STD)
        self.matrix(T.ATTN_Q, bid, N_HEAD * HEAD_DIM, N_EMBD, q_std, qtype)
        self.matrix(T.ATTN_K, bid, N_HEAD_KV * HEAD_DIM, N_EMBD, q_std, qtype)
        self.matrix(T.ATTN_V, bid, N_HEAD_KV * HEAD_DIM, N_EMBD, 1 / math.sqrt(N_EMBD), qtype)
        self.matrix(T.ATTN_OUT, bid, N_EMBD, N_HEAD * HEAD_DIM, 1 / math.sqrt(N_HEAD * HEAD_DIM), qtype)

    def gated_ffn(self, bid: int, qtype: QT) -> None:
        """ffn_gate, ffn_up, ffn_down (SwiGLU or GeGLU: the architecture decides)."""
        self.matrix(T.FFN_GATE, bid, N_FF, N_EMBD, 1 / math.sqrt(N_EMBD), qtype)
        self.matrix(T.FFN_UP, bid, N_FF, N_EMBD, 1 / math.sqrt(N_EMBD), qtype)
        self.matrix(T.FFN_DOWN, bid, N_EMBD, N_FF, 1 / math.sqrt(N_FF), qtype)

    # output -----------------------------------------------------------------

    def write(self, path: str) -> None:
        w = gguf.GGUFWriter(None, self.arch)
        for kv in self.kv + self.tokenizer:
            w.add_key_value(kv.key, kv.value, kv.vtype, kv.sub_type)
        for name, data, qtype in self.tensors:
            w.add_tensor(name, data, raw_dtype=qtype)
        # one temporary file per process, so two builders of the same model never share one
        tmp = f"{path}.{os.getpid()}.tmp"
        w.write_header_to_file(path=tmp)
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)


def qk_input_std(score_std: float) -> float:
    """Std of W_q and W_k entries that gives attention scores q.k/sqrt(head_dim) of
    std `score_std` for unit-RMS inputs: each q, k element has variance
    n_embd * std^2, so the score's variance is (n_embd * std^2)^2."""
    return math.sqrt(score_std / N_EMBD)


# ----------------------------------------------------------------------------
# Architectures


@dataclass
class Spec:
    build: Callable[[Model], None]
    seed: int
    file_type: int


SPECS: dict[str, Spec] = {}


def architecture(name: str, *, seed: int, file_type: int):
    def register(fn: Callable[[Model], None]):
        SPECS[name] = Spec(fn, seed, file_type)
        return fn

    return register


@architecture("llama", seed=1001, file_type=gguf.LlamaFileType.MOSTLY_Q8_0)
def build_llama(m: Model) -> None:
    """Llama 3: GQA, SwiGLU, NORM RoPE with frequency factors in `rope_freqs.weight`.

    The factors follow convert_hf_to_gguf's llama3 formula (factor 8, low/high
    frequency factors 1 and 4) but with original_max_position_embeddings 64 instead
    of 8192, so that at the short positions of a test they change the rotation of
    several dimension pairs noticeably (wavelengths 6 and 14: factor 1; 32: smooth;
    longer: factor 8)."""
    K = gguf.Keys
    rope_base = 500000.0
    m.common_hparams(rms_eps=1e-5, rope_base=rope_base)
    m.u32(K.LLM.VOCAB_SIZE, m.n_vocab)
    m.u32(K.Rope.DIMENSION_COUNT, HEAD_DIM)
    q = QT.Q8_0
    m.embeddings(q)
    m.add(T.ROPE_FREQS, None, llama3_rope_factors(rope_base, HEAD_DIM, 8.0, 1.0, 4.0, 64), QT.F32)
    for i in range(N_LAYER):
        m.norm(T.ATTN_NORM, i)
        m.attention(i, q)
        m.norm(T.FFN_NORM, i)
        m.gated_ffn(i, q)
    m.output(q)


def llama3_rope_factors(base: float, dim: int, factor: float, low_freq_factor: float,
                        high_freq_factor: float, old_context_len: int) -> np.ndarray:
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(1.0)
        elif wavelen > low_freq_wavelen:
            out.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@architecture("qwen3", seed=1002, file_type=gguf.LlamaFileType.MOSTLY_F16)
def build_qwen3(m: Model) -> None:
    """Qwen3: per-head RMS norm of Q and K before NEOX RoPE, explicit head_dim keys,
    untied output. F16 layer matrices, Q8_0 embedding and output."""
    K = gguf.Keys
    m.common_hparams(rms_eps=1e-6, rope_base=1000000.0)
    m.u32(K.Attention.KEY_LENGTH, HEAD_DIM)
    m.u32(K.Attention.VALUE_LENGTH, HEAD_DIM)
    m.embeddings(QT.Q8_0)
    for i in range(N_LAYER):
        m.norm(T.ATTN_NORM, i)
        m.attention(i, QT.F16)
        m.norm(T.ATTN_Q_NORM, i, HEAD_DIM)
        m.norm(T.ATTN_K_NORM, i, HEAD_DIM)
        m.norm(T.FFN_NORM, i)
        m.gated_ffn(i, QT.F16)
    m.output(QT.Q8_0)


@architecture("qwen3moe", seed=1003, file_type=gguf.LlamaFileType.MOSTLY_Q8_0)
def build_qwen3moe(m: Model) -> None:
    """Qwen3-MoE: Qwen3 attention; FFN is a softmax router over 8 experts, top 2,
    weights renormalized over the chosen ones (llama.cpp hard-codes that for
    qwen3moe), expert FFN 64. feed_forward_length is written too (the converter
    writes intermediate_size) but differs from the expert length on purpose."""
    K = gguf.Keys
    n_expert, n_used, n_ff_exp = 8, 2, 64
    m.common_hparams(rms_eps=1e-6, rope_base=1000000.0)
    m.u32(K.LLM.EXPERT_COUNT, n_expert)
    m.u32(K.LLM.EXPERT_USED_COUNT, n_used)
    m.u32(K.Attention.KEY_LENGTH, HEAD_DIM)
    m.u32(K.Attention.VALUE_LENGTH, HEAD_DIM)
    m.u32(K.LLM.EXPERT_FEED_FORWARD_LENGTH, n_ff_exp)
    q = QT.Q8_0
    m.embeddings(q)
    for i in range(N_LAYER):
        m.norm(T.ATTN_NORM, i)
        m.attention(i, q)
        m.norm(T.ATTN_Q_NORM, i, HEAD_DIM)
        m.norm(T.ATTN_K_NORM, i, HEAD_DIM)
        m.norm(T.FFN_NORM, i)
        m.matrix(T.FFN_GATE_INP, i, n_expert, N_EMBD, ROUTER_STD / math.sqrt(N_EMBD), QT.F32)
        m.add(T.FFN_GATE_EXP, i, m.normal((n_expert, n_ff_exp, N_EMBD), 1 / math.sqrt(N_EMBD)), q)
        m.add(T.FFN_DOWN_EXP, i, m.normal((n_expert, N_EMBD, n_ff_exp), 1 / math.sqrt(n_ff_exp)), q)
        m.add(T.FFN_UP_EXP, i, m.normal((n_expert, n_ff_exp, N_EMBD), 1 / math.sqrt(N_EMBD)), q)
    m.output(q)


@architecture("gemma2", seed=1004, file_type=gguf.LlamaFileType.MOSTLY_F16)
def build_gemma2(m: Model) -> None:
    """Gemma 2: embeddings scaled by sqrt(n_embd), GELU FFN, post-attention and
    post-FFN norms, NEOX RoPE, output tied to token_embd (no output.weight).
    Even layers use a sliding window of 16 tokens and odd layers full attention
    (llama.cpp's default pattern 2 for gemma2; no pattern key is written, as the
    converter writes none). Attention scores are soft-capped at 10 (real models: 50,
    which would barely touch scores of this size) and final logits at 30.
    Norm weights are stored as used (the converter has already added 1); the
    post-norms are scaled up (see below). All F16."""
    K = gguf.Keys
    m.common_hparams(rms_eps=1e-6, rope_base=10000.0)
    m.u32(K.Attention.KEY_LENGTH, HEAD_DIM)
    m.u32(K.Attention.VALUE_LENGTH, HEAD_DIM)
    m.f32(K.LLM.ATTN_LOGIT_SOFTCAPPING, 10.0)
    m.f32(K.LLM.FINAL_LOGIT_SOFTCAPPING, 30.0)
    m.u32(K.Attention.SLIDING_WINDOW, 16)
    # Post-attention and post-FFN norm weights around 8: with the output tied to the
    # sqrt(n_embd)-scaled embedding, a residual stream dominated by the input row
    # predicts the input token again at every step ("is is is ..."); the layers'
    # outputs must outweigh it.
    post_norm = 8.0
    q = QT.F16
    # Tied: the embedding is also the output matrix, and gemma scales the input rows
    # by sqrt(n_embd), so one scale serves both.
    m.embeddings(q, std=LOGIT_STD / math.sqrt(N_EMBD))
    for i in range(N_LAYER):
        m.norm(T.ATTN_NORM, i)
        m.attention(i, q, qk_std=qk_input_std(3.0))
        m.norm(T.ATTN_POST_NORM, i, center=post_norm)
        m.norm(T.FFN_NORM, i)
        m.gated_ffn(i, q)
        m.norm(T.FFN_POST_NORM, i, center=post_norm)
    m.norm(T.OUTPUT_NORM, None)


@architecture("phi3", seed=1005, file_type=gguf.LlamaFileType.MOSTLY_F16)
def build_phi3(m: Model) -> None:
    """Phi-3: one fused attn_qkv (rows: Q, then K, then V; GQA 4/2), ffn_up holding
    gate (first n_ff rows) and up (last n_ff rows) for SwiGLU, NEOX RoPE over the whole
    head, no rope factors. The converter's keys: rope.dimension_count,
    rope.scaling.original_context_length, sliding_window 0 (llama.cpp ignores Phi
    SWA anyway). F16 layer matrices, Q8_0 embedding and output."""
    K = gguf.Keys
    m.common_hparams(rms_eps=1e-5, rope_base=10000.0)
    m.u32(K.Rope.SCALING_ORIG_CTX_LEN, N_CTX)
    m.u32(K.Rope.DIMENSION_COUNT, HEAD_DIM)
    m.u32(K.Attention.SLIDING_WINDOW, 0)
    q = QT.F16
    m.embeddings(QT.Q8_0)
    qk_std = qk_input_std(SCORE_STD)
    for i in range(N_LAYER):
        m.norm(T.ATTN_NORM, i)
        qkv = np.concatenate([
            m.normal((N_HEAD * HEAD_DIM, N_EMBD), qk_std),
            m.normal((N_HEAD_KV * HEAD_DIM, N_EMBD), qk_std),
            m.normal((N_HEAD_KV * HEAD_DIM, N_EMBD), 1 / math.sqrt(N_EMBD)),
        ])
        m.add(T.ATTN_QKV, i, qkv, q)
        m.matrix(T.ATTN_OUT, i, N_EMBD, N_EMBD, 1 / math.sqrt(N_EMBD), q)
        m.norm(T.FFN_NORM, i)
        m.matrix(T.FFN_UP, i, 2 * N_FF, N_EMBD, 1 / math.sqrt(N_EMBD), q)
        m.matrix(T.FFN_DOWN, i, N_EMBD, N_FF, 1 / math.sqrt(N_FF), q)
    m.output(QT.Q8_0)


@architecture("gemma3", seed=1006, file_type=gguf.LlamaFileType.MOSTLY_F16)
def build_gemma3(m: Model) -> None:
    """Gemma 3: Gemma 2's layout (embeddings scaled by sqrt(n_embd), GELU FFN,
    post-attention and post-FFN norms, NEOX RoPE, output tied to token_embd) without
    attention soft-capping, plus a per-head RMS norm of Q and K before RoPE
    (attn_q_norm, attn_k_norm, [head_dim]). 6 layers, not 4: with llama.cpp's default
    pattern of 6 for gemma3 (no pattern key is written, as the converter writes none)
    layers 0-4 use a sliding window of 16 tokens and layer 5 full attention; 4 layers
    would have no global one. RoPE base 1e6 on the global layer, rope.freq_base_swa
    10000 on the sliding ones (the converter writes it from rope_parameters'
    sliding_attention; llama.cpp reads it, default also 10000). No final soft-capping
    (llama.cpp's default for gemma3 is none; no key written). The attention scale is
    1/sqrt(head_dim) (llama.cpp: every size but 27B).
    Q/K norm weights are centred on sqrt(3): after the norm each q and k element has
    unit RMS, so scores q.k/sqrt(head_dim) would have a std of about 1 (attention
    near uniform over the window); centring both norms on c gives about c^2 = 3, as
    gemma2's projections do. Post-norms around 8 as in gemma2 (same reason: tied,
    scaled embedding). F16 matrices, Q8_0 embedding (and so output)."""
    K = gguf.Keys
    n_layer = 6
    m.common_hparams(rms_eps=1e-6, rope_base=1000000.0, n_layer=n_layer)
    m.u32(K.Attention.KEY_LENGTH, HEAD_DIM)
    m.u32(K.Attention.VALUE_LENGTH, HEAD_DIM)
    m.u32(K.Attention.SLIDING_WINDOW, 16)
    m.f32(K.Rope.FREQ_BASE_SWA, 10000.0)
    post_norm = 8.0
    qk_norm = math.sqrt(3.0)
    q = QT.F16
    m.embeddings(QT.Q8_0, std=LOGIT_STD / math.sqrt(N_EMBD))
    for i in range(n_layer):
        m.norm(T.ATTN_NORM, i)
        m.attention(i, q)
        m.norm(T.ATTN_Q_NORM, i, HEAD_DIM, center=qk_norm)
        m.norm(T.ATTN_K_NORM, i, HEAD_DIM, center=qk_norm)
        m.norm(T.ATTN_POST_NORM, i, center=post_norm)
        m.norm(T.FFN_NORM, i)
        m.gated_ffn(i, q)
        m.norm(T.FFN_POST_NORM, i, center=post_norm)
    m.norm(T.OUTPUT_NORM, None)


@architecture("gpt-oss", seed=1007, file_type=gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
def build_gpt_oss(m: Model) -> None:
    """gpt-oss: Q/K/V and output projections with biases, a learned attention-sink
    logit per query head (attn_sinks, [n_head]), YaRN RoPE (NEOX), alternating
    sliding-window (even layers, 16 tokens; llama.cpp's default pattern 2, no pattern
    key, as the converter writes none) and full attention, a post-attention norm
    before a biased mixture of experts: router with bias, top 4 of 8 experts by router
    logit, their weights the softmax of the 4 chosen logits, each expert
    swiglu_oai(h·Wgate + bg, h·Wup + bu) (llama.cpp's alpha 1.702, limit 7) then
    ·Wdown + bd, with MXFP4 expert matrices; separate output matrix.

    Shapes as gpt-oss has them, scaled down: 8 query heads over 2 KV heads of 32 (so the
    query width, 256, differs from n_embd, 128), experts of 64. RoPE as gpt-oss-20b's
    config: base 150000, YaRN factor 32 over an original context of 4096 (context length
    131072); with 16 dimension pairs the YaRN ramp runs from pair 4 to pair 9, so
    extrapolated, mixed and interpolated angles all occur, and cos/sin carry YaRN's
    magnitude factor 1 + 0.1 ln 32. The converter's keys are written (feed_forward_length,
    yarn_beta_fast/slow, which llama.cpp does not read: its defaults 32 and 1 are the
    same). Sinks are N(2, 1.5), so that a sink beats every score in some heads and rows
    and not in others; Q/K projections give scores of std about 2 after the YaRN factor.
    Gate and up pre-activations have a std of about 3, so the clamps at 7 act on 1-2 percent
    of them. F16 attention matrices, F32 router, norms, sinks and biases, Q8_0
    embedding and output."""
    K = gguf.Keys
    n_head, n_expert, n_used, n_ff_exp = 8, 8, 4, 64
    factor, orig_ctx = 32.0, 4096
    m.common_hparams(rms_eps=1e-5, rope_base=150000.0, n_ctx=int(factor) * orig_ctx,
                     n_ff=n_ff_exp, n_head=n_head)
    m.u32(K.LLM.EXPERT_COUNT, n_expert)
    m.u32(K.LLM.EXPERT_USED_COUNT, n_used)
    m.u32(K.Attention.KEY_LENGTH, HEAD_DIM)
    m.u32(K.Attention.VALUE_LENGTH, HEAD_DIM)
    m.key(K.Rope.SCALING_TYPE, gguf.RopeScalingType.YARN.value, VT.STRING)
    m.f32(K.Rope.SCALING_FACTOR, factor)
    m.u32(K.Rope.SCALING_ORIG_CTX_LEN, orig_ctx)
    m.f32(K.Rope.SCALING_YARN_BETA_FAST, 32.0)
    m.f32(K.Rope.SCALING_YARN_BETA_SLOW, 1.0)
    m.u32(K.Attention.SLIDING_WINDOW, 16)
    m.u32(K.LLM.EXPERT_FEED_FORWARD_LENGTH, n_ff_exp)
    mscale = 1.0 + 0.1 * math.log(factor)
    q_dim, kv_dim = n_head * HEAD_DIM, N_HEAD_KV * HEAD_DIM
    qk_std = qk_input_std(SCORE_STD / mscale**2)
    act_std = 3.0  # gate and up pre-activations
    # swiglu_oai of N(0, 3) gate and up values has an RMS of about 6.4 (numerically)
    down_std = 1.0 / (6.4 * math.sqrt(n_ff_exp))
    f16, mx = QT.F16, QT.MXFP4
    m.embeddings(QT.Q8_0)
    for i in range(N_LAYER):
        m.norm(T.ATTN_NORM, i)
        m.norm(T.ATTN_POST_NORM, i)
        m.matrix(T.ATTN_Q, i, q_dim, N_EMBD, qk_std, f16)
        m.add(T.ATTN_Q, i, m.normal((q_dim,), 0.5), QT.F32, suffix="bias")
        m.matrix(T.ATTN_K, i, kv_dim, N_EMBD, qk_std, f16)
        m.add(T.ATTN_K, i, m.normal((kv_dim,), 0.5), QT.F32, suffix="bias")
        m.matrix(T.ATTN_V, i, kv_dim, N_EMBD, 1 / math.sqrt(N_EMBD), f16)
        m.add(T.ATTN_V, i, m.normal((kv_dim,), 0.2), QT.F32, suffix="bias")
        m.matrix(T.ATTN_OUT, i, N_EMBD, q_dim, 1 / math.sqrt(q_dim), f16)
        m.add(T.ATTN_OUT, i, m.normal((N_EMBD,), 0.2), QT.F32, suffix="bias")
        m.add(T.ATTN_SINKS, i, 2.0 + m.normal((n_head,), 1.5), QT.F32)
        m.matrix(T.FFN_GATE_INP, i, n_expert, N_EMBD, ROUTER_STD / math.sqrt(N_EMBD), QT.F32)
        m.add(T.FFN_GATE_INP, i, m.normal((n_expert,), 0.5), QT.F32, suffix="bias")
        m.add(T.FFN_GATE_EXP, i, m.normal((n_expert, n_ff_exp, N_EMBD), act_std / math.sqrt(N_EMBD)), mx)
        m.add(T.FFN_GATE_EXP, i, m.normal((n_expert, n_ff_exp), 1.0), QT.F32, suffix="bias")
        m.add(T.FFN_DOWN_EXP, i, m.normal((n_expert, N_EMBD, n_ff_exp), down_std), mx)
        m.add(T.FFN_DOWN_EXP, i, m.normal((n_expert, N_EMBD), 0.2), QT.F32, suffix="bias")
        m.add(T.FFN_UP_EXP, i, m.normal((n_expert, n_ff_exp, N_EMBD), act_std / math.sqrt(N_EMBD)), mx)
        m.add(T.FFN_UP_EXP, i, m.normal((n_expert, n_ff_exp), 1.0), QT.F32, suffix="bias")
    m.output(QT.Q8_0)


# ----------------------------------------------------------------------------


def build(arch: str, out_dir: str, tokenizer: list[KeyValue] | None = None) -> str:
    """Write OUT_DIR/synthetic-<arch>.gguf and return its path."""
    spec = SPECS[arch]
    if tokenizer is None:
        tokenizer = read_tokenizer(VOCAB)
    m = Model(arch, spec.seed, int(spec.file_type), tokenizer)
    spec.build(m)
    path = os.path.join(out_dir, f"synthetic-{arch}.gguf")
    m.write(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", metavar="OUTDIR")
    ap.add_argument("archs", metavar="ARCH", nargs="*", help=f"default: all of {', '.join(SPECS)}")
    args = ap.parse_args()
    unknown = [a for a in args.archs if a not in SPECS]
    if unknown:
        ap.error(f"unknown architecture(s) {', '.join(unknown)}; known: {', '.join(SPECS)}")
    os.makedirs(args.out_dir, exist_ok=True)
    tokenizer = read_tokenizer(VOCAB)
    for arch in args.archs or list(SPECS):
        path = build(arch, args.out_dir, tokenizer)
        print(f"{path}  {os.path.getsize(path)} bytes  sha256 {file_sha256(path)}")


if __name__ == "__main__":
    main()
