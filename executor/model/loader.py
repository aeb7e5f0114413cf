"""Base-model weights into LlamaForCausalLM: from an HF checkpoint dir (safetensors only) or a GGUF file.

Both paths name each tensor the HF way, then `_WeightSink` maps q/k/v and gate/up into the fused
parameters and checks that every parameter was filled exactly once. Pickled .bin files are never read.
Under tensor parallelism each rank reads only its rows or columns of each tensor (safetensors
slices lazily; a GGUF rank dequantizes only its rows, or, for a column cut, one tensor at a time
before cutting it), never the whole model. Under expert parallelism each rank reads only its
block of experts (per-expert tensors of other experts are skipped, fused [E, ...] ones sliced).
FP8 checkpoints (executor/model/fp8.py) are checked, scales included, before any weight is read;
their weights reach `_WeightSink` with their scales cut to the rank's part (an expert-parallel
rank's experts with their scales), and go into FP8 linear layers and experts as they are (block
scales requantized per output row) or dequantized into the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import re
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from ..parallel import TPGroup
from ..shard_tensors import safetensors_nbytes
from ..slot_layout import LoraSpec
from . import fp8, fp8_scheme, kv_scales
from .checkpoint_names import is_vision_name, text_model_name
from .config import ModelConfig
from .llama import LlamaForCausalLM
from .moe import build_causal_lm

log = logging.getLogger(__name__)

# (dim, slice) of a checkpoint tensor that one TP rank keeps; None: all of it
Cut = tuple[int, slice] | None


def load_model(
    path,
    dtype=torch.float32,
    device="cpu",
    lora: LoraSpec | None = None,
    tp: TPGroup | None = None,
    ep: TPGroup | None = None,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """A .gguf file, or a directory with config.json + safetensors (or with exactly one .gguf).
    ep: the expert-parallel group of an MoE model (safetensors only; GGUF models are dense).
    quantization: "fp8" to hold the linear layers in FP8 (fp8.plan: FP8 hardware only); an FP8
    checkpoint's layers are held in FP8 where the device computes in it, dequantized elsewhere."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return load_gguf(p, dtype, device, lora, tp, ep, quantization)
    if (p / "config.json").is_file():
        return load_hf_checkpoint(p, dtype, device, lora, tp, ep, quantization)
    ggufs = sorted(p.glob("*.gguf")) if p.is_dir() else []
    if len(ggufs) == 1:
        return load_gguf(ggufs[0], dtype, device, lora, tp, ep, quantization)
    raise FileNotFoundError(f"{p}: neither a .gguf file nor a directory with config.json or one .gguf")


# per-expert projection names (transformers' and Mixtral's w1/w3/w2) -> ours
_EXPERT_PROJ = {
    "gate_proj": "gate_proj",
    "w1": "gate_proj",
    "up_proj": "up_proj",
    "w3": "up_proj",
    "down_proj": "down_proj",
    "w2": "down_proj",
}


class _WeightSink:
    """Copies HF-named tensors into the model's (fused) parameters and tracks which rows were filled."""

    def __init__(self, model: LlamaForCausalLM):
        self.cfg, self.tp = model.cfg, model.tp
        self.experts = model.ep.part(self.cfg.num_experts)  # the block of experts this rank keeps
        # tied lm_head appears once, as embed_tokens; experts' [E, N, in] weights are filled as [E * N, in] rows
        self.params = {n: p.data.flatten(0, -2) if p.dim() == 3 else p.data for n, p in model.named_parameters()}
        # FP8 linear layers and experts: their weight's per-output-row scales, filled row for row with it
        # (experts' [E, N] scales as the [E * N] rows of their flattened weight)
        self.row_scales = {
            f"{n}.weight": m.weight_scale.data.view(-1)
            for n, m in model.named_modules()
            if getattr(m, "weight_scale", None) is not None
        }
        self.rows_filled = {name: 0 for name in self.params}
        c, tp = self.cfg, self.tp
        q_rows, kv_rows, _ = tp.qkv_rows(c)
        i_rows, vocab_rows = tp.part(c.intermediate_size), tp.part(c.vocab_size)
        q_local, kv_local, i_local = q_rows.stop - q_rows.start, kv_rows.stop - kv_rows.start, i_rows.stop - i_rows.start
        # proj -> (fused parameter, first row in it, rows this rank keeps)
        self.fused = {
            "q": ("self_attn.qkv_proj", 0, q_rows),
            "k": ("self_attn.qkv_proj", q_local, kv_rows),
            "v": ("self_attn.qkv_proj", q_local + kv_local, kv_rows),
            "gate": ("mlp.gate_up_proj", 0, i_rows),
            "up": ("mlp.gate_up_proj", i_local, i_rows),
        }
        self.row_parallel = {"o": tp.part(c.q_size), "down": i_rows}  # input columns this rank keeps
        self.vocab_rows = vocab_rows

    def reads(self, hf_name: str, rows: int) -> list[tuple[str, Cut]]:
        """What to read of checkpoint tensor hf_name (`rows` rows): [(the HF name to put it as, the part
        of the tensor to read)], empty for tensors we drop. A fused q|k|v (`self_attn.qkv_proj`) or
        gate|up (`mlp.gate_up_proj`) tensor, as Phi-3 checkpoints store them, is read as its q, k, v
        or gate, up rows, each cut for this rank as the unfused tensor would be."""
        m = re.fullmatch(r"(model\.layers\.\d+\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|bias)", hf_name)
        if m is None:
            target = self.target(hf_name)
            return [] if target is None else [(hf_name, target[2])]
        prefix, fused, kind = m.groups()
        c = self.cfg
        if fused == "mlp.gate_up_proj":
            parts = [("mlp.gate", c.intermediate_size), ("mlp.up", c.intermediate_size)]
        else:
            parts = [("self_attn.q", c.q_size), ("self_attn.k", c.kv_size), ("self_attn.v", c.kv_size)]
        if rows != sum(n for _, n in parts):
            sizes = " + ".join(f"{n} ({p.split('.')[-1]})" for p, n in parts)
            raise ValueError(f"checkpoint tensor {hf_name!r} has {rows} rows, expected {sizes}")
        out, start = [], 0
        for part, n in parts:
            name = f"{prefix}{part}_proj.{kind}"
            cut = self.target(name)[2]
            keep = slice(0, n) if cut is None else cut[1]
            out.append((name, (0, slice(start + keep.start, start + keep.stop))))
            start += n
        return out

    def target(self, hf_name: str) -> tuple[str, int, Cut] | None:
        """(our parameter, first row, the part of the tensor this rank keeps) for an HF tensor name;
        None for tensors we drop."""
        c, whole = self.cfg, self.tp.size == 1
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            return None  # some checkpoints store the tied copy too
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None  # recomputed from the config
        if is_vision_name(hf_name):  # a multimodal Gemma 3 checkpoint's are skipped before (_language_model_only)
            raise ValueError(
                f"checkpoint tensor {hf_name!r} belongs to a vision tower, but config.json's model_type is "
                f'{c.model_type!r}: only Gemma 3 ("gemma3") multimodal checkpoints are served (their language model)'
            )
        # a multimodal checkpoint's language model (Gemma 3): transformers 5 and 4 names -> the text model's
        hf_name = text_model_name(hf_name)
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            return None
        hf_name = re.sub(r"^(model\.layers\.\d+\.)block_sparse_moe\.", r"\1mlp.", hf_name)  # Mixtral's old block name
        if (expert := self._expert_target(hf_name)) is not None:
            return expert or None  # (): another expert-parallel rank's expert, dropped
        m = re.fullmatch(r"(model\.layers\.\d+\.)(self_attn|mlp|mlp\.shared_expert)\.(\w+)_proj\.(weight|bias)", hf_name)
        if m:
            prefix, block, proj, kind = m.groups()
            if block.endswith("shared_expert"):  # MoE families run on one rank: nothing is cut
                up = {"gate": 0, "up": c.shared_expert_intermediate_size}.get(proj)
                if up is not None:
                    return f"{prefix}{block}.gate_up_proj.{kind}", up, None
                return hf_name, 0, None
            if proj in self.fused:
                param, row, rows = self.fused[proj]
                return f"{prefix}{param}.{kind}", row, None if whole else (0, rows)
            if proj in self.row_parallel and kind == "weight" and not whole:
                return hf_name, 0, (1, self.row_parallel[proj])  # the bias is whole: added after the reduce
        if hf_name in ("model.embed_tokens.weight", "lm_head.weight") and not whole:
            return hf_name, 0, (0, self.vocab_rows)
        return hf_name, 0, None

    def _expert_target(self, hf_name: str) -> tuple[str, int, Cut] | tuple[()] | None:
        """Experts, per expert (`experts.3.gate_proj.weight`, Mixtral's `experts.3.w1.weight`) or
        already fused as transformers 5 holds them (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`).
        None: not an expert tensor; (): an expert this rank does not hold."""
        c = self.cfg
        m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts\.)(?:(\d+)\.(\w+)\.weight|(gate_up_proj|down_proj))", hf_name)
        if m is None:
            return None
        prefix, expert, proj, fused = m.groups()
        mine = self.experts
        if fused:  # [E, N, in]: this rank's experts are rows of dim 0
            return f"{prefix}{fused}.weight", 0, None if mine.stop - mine.start == c.num_experts else (0, mine)
        e, i = int(expert), c.moe_intermediate_size
        if proj not in _EXPERT_PROJ or e >= c.num_experts:
            return hf_name, 0, None  # no such parameter: put() names it
        if not mine.start <= e < mine.stop:
            return ()  # another expert-parallel rank's
        e -= mine.start  # rows of this rank's [E / ep, N, in] experts
        param, row = {
            "gate_proj": ("gate_up_proj", 2 * i * e),
            "up_proj": ("gate_up_proj", 2 * i * e + i),
            "down_proj": ("down_proj", c.hidden_size * e),
        }[_EXPERT_PROJ[proj]]
        return f"{prefix}{param}.weight", row, None

    def put(self, hf_name: str, tensor: torch.Tensor | fp8.Quantized) -> None:
        """tensor: the checkpoint's tensor, already cut to this rank's part (`target`); an FP8 one
        (fp8.Quantized) goes into an FP8 layer with its scales, else dequantized to the model's dtype.
        Float weights of an FP8 layer are quantized per output row."""
        target = self.target(hf_name)
        if target is None:
            return
        name, row, _ = target
        param = self.params.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model (as {name!r})")
        scales = None
        if name in self.row_scales:
            tensor, scales = fp8.to_rows(tensor)
            scales = scales.reshape(-1)  # fused experts' [E, N]: the rows of [E * N, in]
        elif isinstance(tensor, fp8.Quantized):
            tensor = tensor.dequantize(param.dtype)
        if tensor.dim() == 3 and param.dim() == 2:  # fused experts [E, N, in] into our flattened rows
            tensor = tensor.flatten(0, 1)
        dst = param[row : row + tensor.shape[0]]
        if dst.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {hf_name!r} is {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        if scales is not None:
            self.row_scales[name][row : row + tensor.shape[0]].copy_(scales)
        self.rows_filled[name] += tensor.shape[0]

    def check_complete(self) -> None:
        wrong = [n for n, rows in self.rows_filled.items() if rows != self.params[n].shape[0]]
        if wrong:
            raise ValueError(f"checkpoint leaves parameters unfilled or filled twice: {wrong[:8]}")


# ---------------------------------------------------------------- HF checkpoint (safetensors)


def load_hf_checkpoint(
    model_dir,
    dtype=torch.float32,
    device="cpu",
    lora: LoraSpec | None = None,
    tp: TPGroup | None = None,
    ep: TPGroup | None = None,
    quantization: str | None = None,
):
    model_dir = Path(model_dir)
    hf_config = json.loads((model_dir / "config.json").read_text())
    cfg = ModelConfig.from_hf_config(hf_config)
    scheme = fp8_scheme.checkpoint_scheme(hf_config)  # an unsupported quantization_config is refused here
    with contextlib.ExitStack() as files:
        opened = [files.enter_context(safe_open(str(f), framework="pt", device="cpu")) for f in _safetensors_files(model_dir)]
        where = {}  # tensor -> its file
        for f in opened:
            for name in f.keys():
                if name in where:
                    raise ValueError(f"checkpoint tensor {name!r} is in two of the model's safetensors files")
                where[name] = f
        if hf_config.get("model_type") == "gemma3":
            where = _language_model_only(where)
        meta = {name: (f.get_slice(name).get_dtype(), f.get_slice(name).get_shape()) for name, f in where.items()}
        scales = _kv_cache_scales(hf_config, cfg, meta, lambda name: where[name].get_tensor(name), tp)
        fp8_linears = fp8.plan(scheme, quantization, device, dtype, str(model_dir), experts=cfg.num_experts > 0)
        checkpoint = None
        if scheme is not None:  # every scale checked before any weight is read
            checkpoint = fp8.Fp8Checkpoint(scheme, meta, lambda name: where[name].get_tensor(name))
        elif (fp8_name := next((n for n, (d, _) in meta.items() if d.startswith("F8_")), None)) is not None:
            why = "quantizes no weights" if hf_config.get("quantization_config") else "is missing"  # e.g. kv_cache_scheme only
            raise ValueError(f"checkpoint tensor {fp8_name!r} is {meta[fp8_name][0]} but config.json's quantization_config {why}")
        cfg = dataclasses.replace(cfg, fp8_linears=fp8_linears, fp8_checkpoint=scheme.describe() if scheme else "")
        model = build_causal_lm(cfg, lora, dtype, device, tp, ep)
        model.kv_scales = scales
        sink = _WeightSink(model)
        for name, f in where.items():
            if (checkpoint is not None and checkpoint.is_scale(name)) or (scales is not None and kv_scales.is_kv_scale(name)):
                continue

            def read(cut: Cut, name=name, f=f) -> torch.Tensor:
                if cut is None:
                    return f.get_tensor(name)
                part = f.get_slice(name)  # reads only this rank's rows or columns from the file
                return part[cut[1]] if cut[0] == 0 else part[:, cut[1]]

            # a fused q|k|v or gate|up tensor (Phi-3) is read as its parts, each with its rows' scales
            for part_name, cut in sink.reads(name, (meta[name][1] or [0])[0]):
                if checkpoint is not None and checkpoint.is_quantized(name):
                    sink.put(part_name, checkpoint.read(name, meta[name][1], read, cut))
                else:
                    sink.put(part_name, read(cut))
    sink.check_complete()
    return model.eval()


def _language_model_only(where: dict) -> dict:
    """A multimodal Gemma 3 checkpoint's tensors (name -> its file) without its vision tower and
    multi-modal projector: the executor serves the language model, to text-only requests."""
    skipped = [(name, f.get_slice(name)) for name, f in where.items() if is_vision_name(name)]
    if skipped:
        size = sum(safetensors_nbytes(s.get_dtype(), math.prod(s.get_shape())) or 0 for _, s in skipped)
        log.info(
            "multimodal Gemma 3 checkpoint: serving its language model only (text-only requests); "
            "skipped %d vision-tower and projector tensors (%d bytes)",
            len(skipped),
            size,
        )
    return {name: f for name, f in where.items() if not is_vision_name(name)}


def check_quantization_config(path) -> None:
    """ValueError for an HF checkpoint whose config.json has a quantization_config the loader refuses
    (fp8_scheme.checkpoint_scheme, kv_scales.kv_cache_scheme), from config.json alone; nothing for a GGUF."""
    p = Path(path)
    if (p / "config.json").is_file():
        q = json.loads((p / "config.json").read_text()).get("quantization_config")
        fp8_scheme.checkpoint_scheme({"quantization_config": q})
        kv_scales.kv_cache_scheme(q)


def _kv_cache_scales(hf_config: dict, cfg: ModelConfig, meta, read_tensor, tp: TPGroup | None) -> torch.Tensor | None:
    """The checkpoint's KV cache scales (kv_scales.read_kv_scales), this rank's kv heads of each layer,
    checked before any weight is read; None where the checkpoint has no kv_cache_scheme."""
    if not kv_scales.kv_cache_scheme(hf_config.get("quantization_config")):
        return None
    rows = tp.qkv_rows(cfg)[1] if tp is not None else slice(0, cfg.kv_size)  # this rank's k_proj rows: whole heads
    heads = slice(rows.start // cfg.head_dim, rows.stop // cfg.head_dim)
    return kv_scales.read_kv_scales(meta, read_tensor, cfg.num_layers, cfg.num_kv_heads, heads)


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [(model_dir / n).resolve() for n in names]
        root = model_dir.resolve()
        outside = [str(f) for f in files if root not in f.parents]
        if outside:
            raise ValueError(f"{index}: weight files outside the model directory: {outside}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    if list(model_dir.glob("*.bin")):
        raise ValueError(f"{model_dir}: only pickled .bin weights; convert them to safetensors (never unpickled)")
    raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


# ---------------------------------------------------------------- GGUF


# llama.cpp tensor names -> HF names ({i} = layer index)
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",  # phi3: fused q|k|v
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 2/3's norms around attention and MLP: their ffn_norm is the pre-feed-forward norm, not
# the post-attention norm it is in the Llama block
_GGUF_SANDWICH_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
GGUF_ARCHS = ("llama", "qwen2", "qwen3", "phi3", *_GGUF_GEMMA_ARCHS)
_GGUF_ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")  # phi3's LongRoPE: read into the config


def load_gguf(
    path,
    dtype=torch.float32,
    device="cpu",
    lora: LoraSpec | None = None,
    tp: TPGroup | None = None,
    ep: TPGroup | None = None,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """Dequantizes every tensor (Q4_0/1, Q8_0, K-quants, F16, F32, ... as gguf.quants supports) to dtype
    (quantization "fp8": the linear layers' weights then to FP8 per output row). Gemma's norm weights
    are stored as (1 + weight), as its RMSNorm scales: 1 is taken off them for our (1 + weight) norm."""
    import gguf

    fp8_linears = fp8.plan(None, quantization, device, dtype, str(path))
    reader = gguf.GGUFReader(str(path))
    cfg = dataclasses.replace(gguf_config(reader), fp8_linears=fp8_linears)
    model = build_causal_lm(cfg, lora, dtype, device, tp, ep)  # GGUF models are dense: ep > 1 is refused
    sink = _WeightSink(model)
    permute = _gguf_field(reader, "general.architecture") == "llama"
    for t in reader.tensors:
        if t.name in _GGUF_ROPE_FACTORS:
            continue
        full_shape = tuple(reversed(t.shape.tolist()))
        for hf_name, cut in sink.reads(_hf_name(t.name, cfg.fused_projections, cfg.sandwich_norms), full_shape[0]):
            data, shape = t.data, full_shape  # data: [rows, bytes of a row] when quantized, a row = whole blocks
            if cut is not None and cut[0] == 0:  # this rank's rows, cut before dequantizing (most of the work)
                data = data[cut[1]]
                shape = (data.shape[0], *shape[1:])
            w = gguf.quants.dequantize(data, t.tensor_type).reshape(shape)
            if permute and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                # Per head: a rank's rows are whole heads, so unpermuting them alone is the same.
                w = _unpermute_rope(w, w.shape[0] // cfg.head_dim)
            if cut is not None and cut[0] == 1:  # this rank's columns
                w = w[:, cut[1]]
            if cfg.norm_unit_offset and t.name.endswith("norm.weight"):
                # llama.cpp's Gemma converters add 1 to every norm weight. In float32 1 + (s - 1) is s
                # exactly for a stored s in [0.5, 2] (Sterbenz): our norm's 1 + weight is the file's value
                w = np.asarray(w, dtype=np.float32) - 1.0
            w = np.ascontiguousarray(w, dtype=np.float32)
            sink.put(hf_name, torch.from_numpy(w if w.flags.writeable else w.copy()))  # F32 data is a read-only memmap
    sink.check_complete()
    return model.eval()


def gguf_config(reader) -> ModelConfig:
    """ModelConfig from GGUF metadata (`<arch>.*` keys, token ids from `tokenizer.ggml.*`) as llama.cpp's
    converter writes it. phi3: fused attn_qkv and ffn_up (gate|up), rope.dimension_count the rotary
    dims (partial RoPE), LongRoPE's factors as the rope_factors_short / rope_factors_long tensors.
    gemma, gemma2, gemma3: see _gemma_from_gguf. ValueError for a GGUF without the keys every model needs."""
    arch = _gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHS)}")
    tensors = {t.name: t for t in reader.tensors}
    tensor_names = set(tensors)
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF with rope_freqs (Llama 3.1 rope scaling) is not supported yet")

    def get(key, default=None):
        return _gguf_field(reader, f"{arch}.{key}", default)

    required = ["embedding_length", "block_count", "feed_forward_length", "attention.head_count"]
    if arch in _GGUF_GEMMA_ARCHS:
        required.append("attention.layer_norm_rms_epsilon")  # llama.cpp requires it of these archs
    missing = [f"{arch}.{k}" for k in required if get(k) is None]
    if missing:
        raise ValueError(f"GGUF ({arch}) lacks metadata the model needs: {', '.join(missing)}")
    hidden, heads = get("embedding_length"), get("attention.head_count")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size") or (len(tokens.data) if tokens is not None else None)
    if vocab is None:
        raise ValueError(f"GGUF ({arch}) has neither {arch}.vocab_size nor tokenizer.ggml.tokens: its vocabulary size is unknown")
    scaling_type = get("rope.scaling.type", "none")
    if scaling_type not in ("none", "linear"):
        raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}")
    rope_scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")} if scaling_type == "linear" else None
    head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // heads
    rotary_dim, window = head_dim, None
    if arch == "phi3":
        head_dim = get("attention.key_length") or hidden // heads
        rotary_dim, window = get("rope.dimension_count") or head_dim, get("attention.sliding_window") or None
    if _GGUF_ROPE_FACTORS[1] in tensor_names:
        short, long = (np.asarray(tensors[n].data, dtype=np.float32).tolist() for n in _GGUF_ROPE_FACTORS)
        rope_scaling = {
            "rope_type": "longrope", "short_factor": short, "long_factor": long,
            "original_max_position_embeddings": get("rope.scaling.original_context_length") or get("context_length"),
            "attention_factor": get("rope.scaling.attn_factor"),
        }  # fmt: skip
    gemma = {}
    if arch in _GGUF_GEMMA_ARCHS:
        gemma = _gemma_from_gguf(arch, get, hidden, heads, head_dim)  # gemma3's rope_scaling: its global layers'
    eos = [_gguf_field(reader, k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    return ModelConfig(
        model_type="gemma3_text" if arch == "gemma3" else arch,  # as from_hf_config names Gemma 3's language model
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_layers=get("block_count"),
        num_heads=heads,
        num_kv_heads=get("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=get("rope.freq_base", 10000.0),
        rope_scaling=rope_scaling,
        max_position_embeddings=get("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        sliding_window=window,
        qk_norm=arch == "gemma3" or "blk.0.attn_q_norm.weight" in tensor_names,  # a gemma3 without them is refused
        fused_projections=arch == "phi3",
        partial_rotary_factor=rotary_dim / head_dim,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(e for e in eos if e is not None)),
        **gemma,
    )


# llama.cpp's layer counts of the 27B models (Gemma 2, Gemma 3): the one size whose attention scale is
# (hidden / heads) ** -0.5, not head_dim ** -0.5 (their query_pre_attn_scalar: 144, 168)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_from_gguf(arch: str, get, hidden: int, heads: int, head_dim: int) -> dict:
    """The Gemma fields of ModelConfig from a llama.cpp GGUF. Where a key is absent, llama.cpp's default:
    - query_pre_attn_scalar: never written; llama.cpp derives it from the layer count (_GEMMA_27B_LAYERS),
      head_dim for every other size, as Gemma's configs have it;
    - gemma2: every other layer local from layer 0, window 4096, soft-caps 50 (attention) and 30 (logits);
    - gemma3: no sliding_window (or 0): every layer global; else one global layer of each
      attention.sliding_window_pattern (6; an array of per-layer bools, true = local), the local
      layers' RoPE base rope.freq_base_swa (10000, unscaled), no final soft-cap; no attention soft-cap.
    Gemma 1: no windows, no soft-caps, head_dim as the scalar."""
    fields: dict = dict(hidden_act="gelu_tanh", norm_unit_offset=True, scale_embeddings=True)
    if arch == "gemma":
        return fields
    layers = get("block_count")
    scalar = hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim
    fields.update(sandwich_norms=True, query_pre_attn_scalar=scalar)
    if arch == "gemma2":
        window = get("attention.sliding_window", 4096)
        return dict(
            fields,
            attn_logit_softcap=get("attn_logit_softcapping", 50.0) or None,
            final_logit_softcap=get("final_logit_softcapping", 30.0) or None,
            layer_windows=tuple(window if i % 2 == 0 else None for i in range(layers)),
        )
    window = get("attention.sliding_window") or None
    pattern = get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"gemma3.attention.sliding_window_pattern names {len(pattern)} layers, the model has {layers}")
        local = [bool(p) for p in pattern]
    elif not isinstance(pattern, int) or pattern < 1:
        raise ValueError(f"gemma3.attention.sliding_window_pattern {pattern!r}: a positive period or one bool per layer")
    else:
        local = [i % pattern < pattern - 1 for i in range(layers)]  # llama.cpp's set_swa_pattern: the last of each period global
    return dict(
        fields,
        final_logit_softcap=get("final_logit_softcapping") or None,
        layer_windows=tuple(window if is_local and window else None for is_local in local),
        rope_local_theta=float(get("rope.freq_base_swa", 10000.0)),
    )


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _hf_name(gguf_name: str, fused: bool = False, sandwich: bool = False) -> str:
    """fused: phi3, whose ffn_up holds gate|up (HF's mlp.gate_up_proj); sandwich: Gemma 2/3's four norms a layer."""
    base, _, kind = gguf_name.rpartition(".")  # kind: weight | bias
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    names = {**_GGUF_LAYER_NAMES, **_GGUF_SANDWICH_NAMES} if sandwich else _GGUF_LAYER_NAMES
    if m and m.group(2) in names:
        module = "mlp.gate_up_proj" if fused and m.group(2) == "ffn_up" else names[m.group(2)]
        return f"model.layers.{m.group(1)}.{module}.{kind}"
    if base in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[base]}.{kind}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}")


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert: it interleaves each head's two rotary halves for its own RoPE kernel."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
