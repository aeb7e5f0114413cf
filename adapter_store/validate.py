"""Every check an adapter passes before the store keeps it: one function each, one error type.

Each failure raises loraserve.errors.StatusError with a message naming the file, tensor or
field at fault: INVALID_ARGUMENT for a bad file, FAILED_PRECONDITION for an adapter made
for another base model or above the server's maximum rank.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as st_load

from loraserve.errors import invalid, precondition

from .base_model import FUSED_NAMES, BaseModelSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ALLOWED_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}  # F64 is cast to float32 (cast_float64)
PREFIX = "base_model.model."
TENSOR_RE = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|lora_embedding_A|lora_embedding_B)$")
MAX_CONFIG_BYTES = 1 << 20
# PEFT saves the frozen base weights of targeted embeddings/lm_head (save_embedding_layers);
# they equal the base model's and are not served.
SAVED_EMBEDDING_RE = re.compile(r"^base_model\.model\.(.*\.)?(embed_tokens|lm_head|wte|embed_in|embed_out)\.base_layer\.weight$")


@dataclass(frozen=True)
class Limits:
    max_rank: int = 256
    max_adapter_bytes: int = 2 << 30
    max_header_bytes: int = 16 << 20
    max_tensors: int = 100_000
    allow_pickle: bool = False


@dataclass(frozen=True)
class LoraSettings:
    r: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    base_model: str
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    target_parameters: tuple[str, ...] = ()
    # canonical per-expert module -> the name the adapter file gave it (a fused expert parameter,
    # or Mixtral's old per-expert name): rank_pattern / alpha_pattern keys match the latter.
    module_sources: dict = field(default_factory=dict)
    use_dora: bool = False  # DoRA: a magnitude vector per module (adapter_store/dora.py)
    tokens_only: bool = False  # peft_type TRAINABLE_TOKENS: token rows, no LoRA (r is 0; adapter_store/trainable_tokens.py)

    def module_rank(self, module: str) -> int:
        return int(_pattern_value(self.rank_pattern, self.module_sources.get(module, module), self.r))

    def module_scale(self, module: str) -> float:
        """LoRA scaling: alpha / r, or alpha / sqrt(r) with rsLoRA (per-module patterns honoured)."""
        r = self.module_rank(module)
        alpha = float(_pattern_value(self.alpha_pattern, self.module_sources.get(module, module), self.alpha))
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern matching: a key matches the module name or its suffix."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def check_name(name: str) -> None:
    if not NAME_RE.match(name or ""):
        raise invalid(
            f"adapter name {name!r} is invalid: use 1-128 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit"
        )


def read_config(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise invalid(f"{CONFIG_FILE} is missing")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise invalid(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        cfg = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise invalid(f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise invalid(f"{CONFIG_FILE} must hold a JSON object")
    return cfg


def check_config(cfg: dict, spec: BaseModelSpec | None, limits: Limits) -> LoraSettings:
    """The config is a plain PEFT LoRA config this server can apply, or a TRAINABLE_TOKENS one
    (token rows alone: settings with r 0, tokens_only)."""
    if cfg.get("peft_type") == "TRAINABLE_TOKENS":
        return LoraSettings(0, 0.0, False, (), _base_model(cfg, spec), tokens_only=True)
    if cfg.get("peft_type") != "LORA":
        raise invalid(
            f"{CONFIG_FILE}: peft_type is {cfg.get('peft_type')!r}, only 'LORA' and 'TRAINABLE_TOKENS' adapters are served"
        )
    _refuse_features(cfg)
    check_init(cfg.get("init_lora_weights", True))
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise invalid(f"{CONFIG_FILE}: r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise invalid(f"{CONFIG_FILE}: lora_alpha must be a positive number, got {alpha!r}")
    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    if not isinstance(rank_pattern, dict) or not isinstance(alpha_pattern, dict):
        raise invalid(f"{CONFIG_FILE}: rank_pattern and alpha_pattern must be objects")
    ranks = [r, *rank_pattern.values()]
    if any(not isinstance(x, int) or x < 1 for x in ranks):
        raise invalid(f"{CONFIG_FILE}: rank_pattern values must be positive integers")
    if not rank_pattern and r > limits.max_rank:  # every module takes r: refused before the weights are read
        raise precondition(f"adapter rank {r} is above this store's maximum rank {limits.max_rank}")
    targets = cfg.get("target_modules") or ()
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    base = _base_model(cfg, spec)
    params = cfg.get("target_parameters") or ()
    params = (params,) if isinstance(params, str) else tuple(params)
    if not all(isinstance(p, str) for p in params):
        raise invalid(f"{CONFIG_FILE}: target_parameters must be a list of parameter names")
    return LoraSettings(
        r,
        float(alpha),
        bool(cfg.get("use_rslora")),
        targets,
        base,
        rank_pattern,
        alpha_pattern,
        params,
        use_dora=bool(cfg.get("use_dora")),
    )


def _base_model(cfg: dict, spec: BaseModelSpec | None) -> str:
    """The config's base_model_name_or_path ("" if unset), which must name the store's base model."""
    base = cfg.get("base_model_name_or_path") or ""
    if spec is not None and base and not spec.matches(base):
        raise precondition(f"adapter was made for base model {base!r}, this store serves {spec.name!r}")
    return base


def _refuse_features(cfg: dict) -> None:
    if cfg.get("use_dora") and cfg.get("target_parameters"):
        raise invalid(f"{CONFIG_FILE}: DoRA (use_dora: true) on target_parameters (MoE expert parameters) is not served")
    if cfg.get("modules_to_save"):
        raise invalid(
            f"{CONFIG_FILE}: modules_to_save {cfg['modules_to_save']} is not supported: only LoRA A/B weights are served"
        )
    if cfg.get("bias", "none") != "none":
        raise invalid(f"{CONFIG_FILE}: bias {cfg['bias']!r} is not supported (only 'none')")
    # LoRA variants whose forward or saved tensors differ from plain LoRA's (BD-LoRA's block-diagonal
    # factors, KaSA's truncated base weight and singular values, MonteCLoRA's and VeLoRA's extra
    # tensors, Arrow's routing over several adapters)
    variants = ("use_bdlora", "kasa_config", "monteclora_config", "velora_config", "arrow_config")
    for key in ("lora_bias", "layer_replication", "use_qalora", "alora_invocation_tokens", *variants):
        if cfg.get(key):
            raise invalid(f"{CONFIG_FILE}: {key} is not supported")


# init_lora_weights values whose PEFT init rewrites the base weight (W - B A, or LoftQ's quantized W):
# such an adapter applies to that changed weight, not to the base model the executor serves.
# PiSSA, CorDA, Astra, OLoRA and LoRA-GA adapters saved with
# save_pretrained(path_initial_model_for_weight_conversion=...) are plain LoRA (init_lora_weights true).
_BASE_CHANGING_INITS = ("pissa", "corda", "astra", "olora", "lora_ga")


def check_init(init) -> None:
    """INVALID_ARGUMENT for an init_lora_weights whose PEFT init changed the base weight the adapter
    was trained on (PiSSA, CorDA, Astra, OLoRA, LoRA-GA, LoftQ); inits that leave the base weight
    alone (true, false, "gaussian", "eva", "orthogonal", "mica", "nora") load as plain LoRA."""
    if not isinstance(init, str):
        return
    value = init.lower()
    if value == "loftq":
        raise invalid(
            f"{CONFIG_FILE}: init_lora_weights 'loftq' is not served: the adapter applies to LoftQ's quantized base "
            "weights, not to the base model this server serves"
        )
    if value.startswith(_BASE_CHANGING_INITS):
        raise invalid(
            f"{CONFIG_FILE}: init_lora_weights {init!r} is not served: its init changed the base weights the adapter "
            "applies to; convert it to a plain LoRA adapter of the original base with PEFT's "
            "save_pretrained(..., path_initial_model_for_weight_conversion=<the initial adapter>) and register that"
        )


def check_weights_file(directory: Path, limits: Limits) -> Path:
    """The weights file to read: safetensors, or pickled .bin only when explicitly allowed."""
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        if (directory / PICKLE_FILE).is_file():
            if not limits.allow_pickle:
                raise invalid(
                    f"{PICKLE_FILE} holds pickled weights, refused by default; convert it to "
                    f"{WEIGHTS_FILE} or start the store with --allow-pickle"
                )
            return directory / PICKLE_FILE
        raise invalid(f"{WEIGHTS_FILE} is missing")
    size = path.stat().st_size
    if size > limits.max_adapter_bytes:
        raise invalid(f"{WEIGHTS_FILE} is {size} bytes, above the limit of {limits.max_adapter_bytes} bytes")
    return path


def check_safetensors_header(data: bytes, limits: Limits) -> dict:
    """Parses and checks a safetensors header before any tensor is built from the bytes."""
    if len(data) < 8:
        raise invalid(f"{WEIGHTS_FILE}: {len(data)} bytes is too short for a safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > limits.max_header_bytes or 8 + n > len(data):
        raise invalid(f"{WEIGHTS_FILE}: header length {n} exceeds the file ({len(data)} bytes) or the limit")
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise invalid(f"{WEIGHTS_FILE}: header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise invalid(f"{WEIGHTS_FILE}: header must be a JSON object")
    header.pop("__metadata__", None)
    if len(header) > limits.max_tensors:
        raise invalid(f"{WEIGHTS_FILE}: {len(header)} tensors, above the limit of {limits.max_tensors}")
    _check_offsets(header, len(data) - 8 - n)
    return header


def _check_offsets(header: dict, data_bytes: int) -> None:
    spans = []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise invalid(f"{WEIGHTS_FILE}: tensor {name!r} has a malformed header entry")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in ALLOWED_DTYPES:
            raise invalid(f"{WEIGHTS_FILE}: tensor {name!r} has dtype {dtype!r}; allowed: {sorted(ALLOWED_DTYPES)}")
        if not isinstance(shape, list) or any(not isinstance(d, int) or d < 0 for d in shape):
            raise invalid(f"{WEIGHTS_FILE}: tensor {name!r} has a malformed shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise invalid(f"{WEIGHTS_FILE}: tensor {name!r} has malformed data_offsets {offsets!r}")
        begin, end = offsets
        if not 0 <= begin <= end <= data_bytes:
            raise invalid(
                f"{WEIGHTS_FILE}: tensor {name!r} data_offsets {offsets} fall outside the file's {data_bytes} data bytes"
            )
        if end - begin != math.prod(shape) * ALLOWED_DTYPES[dtype]:
            raise invalid(
                f"{WEIGHTS_FILE}: tensor {name!r} spans {end - begin} bytes, its shape {shape} {dtype} needs {math.prod(shape) * ALLOWED_DTYPES[dtype]}"
            )
        spans.append((begin, end, name))
    spans.sort()
    for (_, end, name), (begin, _, other) in zip(spans, spans[1:]):
        if begin < end:
            raise invalid(f"{WEIGHTS_FILE}: tensors {name!r} and {other!r} overlap")


def load_tensors(path: Path, limits: Limits) -> dict[str, torch.Tensor]:
    if path.name == PICKLE_FILE:  # only reached with allow_pickle; still no arbitrary objects
        try:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise invalid(f"{PICKLE_FILE} could not be read: {e}") from None
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise invalid(f"{PICKLE_FILE} must hold a dict of tensors")
        return tensors
    data = path.read_bytes()
    check_safetensors_header(data, limits)
    try:
        return st_load(data)
    except Exception as e:
        raise invalid(f"{WEIGHTS_FILE} could not be read: {e}") from None


def group_modules(
    tensors: dict[str, torch.Tensor], settings: LoraSettings, spec: BaseModelSpec | None
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Maps every tensor to a module's (A, B) and checks the shapes against r and the base model.

    Linear: A [r, in], B [out, r]. Embedding: A [r, vocab], B [dim, r] (PEFT's names). A
    TRAINABLE_TOKENS adapter has none ({}) and may hold no other tensor.
    """
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        if SAVED_EMBEDDING_RE.match(name):
            continue
        if settings.tokens_only:
            raise invalid(f"tensor {name!r}: a TRAINABLE_TOKENS adapter holds only trainable_tokens_delta rows")
        m = TENSOR_RE.match(name)
        if not m or not name.startswith(PREFIX):
            raise invalid(f"tensor {name!r} is not a LoRA A/B weight of a known module")
        parts.setdefault(m["module"][len(PREFIX) :], {})[m["part"]] = t
    if not parts:
        if settings.tokens_only:
            return {}
        raise invalid(f"{WEIGHTS_FILE} holds no LoRA tensors")
    modules = {}
    for module, p in sorted(parts.items()):
        a = p.get("lora_A.weight", p.get("lora_embedding_A"))
        b = p.get("lora_B.weight", p.get("lora_embedding_B"))
        if a is None or b is None or len(p) != 2:
            raise invalid(f"module {module!r} needs exactly one lora_A and one lora_B tensor, has {sorted(p)}")
        _check_shapes(module, a, b, settings.module_rank(module), spec, settings.module_sources.get(module))
        modules[module] = (a, b)
    return modules


def check_rank(tensors: dict[str, torch.Tensor], settings: LoraSettings, limits: Limits, spec: BaseModelSpec | None) -> None:
    """The rank of each module the adapter's LoRA tensors name (r, or its rank_pattern value) is at most
    the store's maximum: FAILED_PRECONDITION. Run on the tensors that are served (after vision-tower
    modules are dropped and expert modules renamed), before their shapes are checked against the rank.
    A module the base model (spec) lacks is not counted: group_modules refuses it, naming it."""
    modules = {m["module"][len(PREFIX) :] for n in tensors if (m := TENSOR_RE.match(n)) and n.startswith(PREFIX)}
    served = (m for m in modules if spec is None or spec.module_shape(m) is not None)
    rank = max((settings.module_rank(m) for m in served), default=0)
    if rank > limits.max_rank:
        raise precondition(f"adapter rank {rank} is above this store's maximum rank {limits.max_rank}")


def embedding_modules(tensors: dict[str, torch.Tensor]) -> frozenset[str]:
    """The modules whose LoRA tensors are PEFT's embedding ones (lora_embedding_A / B)."""
    suffix = ".lora_embedding_A"
    return frozenset(n[len(PREFIX) : -len(suffix)] for n in tensors if n.startswith(PREFIX) and n.endswith(suffix))


def _check_shapes(
    module: str, a: torch.Tensor, b: torch.Tensor, r: int, spec: BaseModelSpec | None, source: str | None = None
) -> None:
    """source: the adapter file's name for an expert module the store renamed (adapter_store/experts.py)."""
    if a.dim() != 2 or b.dim() != 2:
        raise invalid(f"module {module!r}: lora_A and lora_B must be 2-D, got {list(a.shape)} and {list(b.shape)}")
    if a.shape[0] != r or b.shape[1] != r:
        raise invalid(f"module {module!r}: lora_A {list(a.shape)} / lora_B {list(b.shape)} disagree with r={r}")
    if spec is None:
        return
    shape = spec.module_shape(module)
    if shape is None:
        parent, _, proj = module.rpartition(".")
        fused = f"{parent}.{FUSED_NAMES.get(proj)}"
        if spec.module_shape(fused) is not None:
            raise invalid(
                f"module {module!r} does not exist in base model {spec.name!r}: it fuses {proj} into {fused!r}, "
                f"the module its PEFT adapters target"
            )
        raise invalid(f"module {module!r} does not exist in base model {spec.name!r}")
    if (a.shape[1], b.shape[0]) != shape:
        named = f"module {module!r}" + (f" (the file's {source!r})" if source and source != module else "")
        raise invalid(
            f"{named}: adapter maps {a.shape[1]} -> {b.shape[0]} features, base model {spec.name!r} has {shape[0]} -> {shape[1]}"
        )


def check_finite(modules: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    for module, (a, b) in modules.items():
        for part, t in (("lora_A", a), ("lora_B", b)):
            if not torch.isfinite(t).all():
                raise invalid(f"module {module!r}: {part} holds NaN or Inf values")


def cast_float64(
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], str]:
    """float64 weights (PEFT saves them; other servers accept them) cast to float32, after
    check_finite; returns (modules, "float64 -> float32") or (modules, "") when none was float64.
    A value beyond float32's range is refused: it would be served as Inf."""
    if not any(t.dtype == torch.float64 for pair in modules.values() for t in pair):
        return modules, ""
    out = {}
    for module, pair in modules.items():
        cast = []
        for part, t in zip(("lora_A", "lora_B"), pair):
            if t.dtype == torch.float64:
                t = t.to(torch.float32)
                if not torch.isfinite(t).all():
                    raise invalid(f"module {module!r}: {part} holds float64 values beyond float32's range")
            cast.append(t)
        out[module] = (cast[0], cast[1])
    return out, "float64 -> float32"
