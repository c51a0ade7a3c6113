"""Worker settings: one validated model for both backends (embedded engine and `vllm serve`).

Field names mirror `vllm serve` flags (`max_num_seqs` <-> `--max-num-seqs`), so the CLI, the
embedded server and the vLLM argv builder all read the same object. Checkpoint folders are
checked here from their `config.json` alone (no torch), so a bad combination fails at start
with one line naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from engine.jsonfile import read_json_object
from engine.worker.portability import unportable
from wire.tracing import TracingSettings

ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny-coder"
BUNDLED_TARGET = ASSETS_DIR / "target"
BUNDLED_DRAFTER = ASSETS_DIR / "dflash"
BUNDLED_DFLASH2 = ASSETS_DIR / "dflash2"
# The same recipe on layers [1, 3, 4]: SGLang captures no last layer (engine/worker/portability.py).
BUNDLED_PORTABLE_DRAFTER = ASSETS_DIR / "dflash-portable"
BUNDLED_NAME = "tiny-coder"
DEFAULT_MAX_MODEL_LEN = 2048

Backend = Literal["embedded", "vllm", "sglang", "trtllm"]
# Backends that run another engine's server with these settings (all but the embedded one).
SERVER_BACKENDS = ("vllm", "sglang", "trtllm")
SpecMetricsLevel = Literal["none", "summary", "detailed"]
Dtype = Literal["auto", "float32", "float16", "bfloat16", "half", "float"]
# "dflash2" names a DFlash2 drafter outright; under "dflash" its config.json says which (as
# in vLLM, whose architecture decides: DFlash2DraftModel).
DFLASH_METHODS = ("dflash", "dflash2")
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
# Backends that serve DFlash2 drafters: vLLM >= 0.28 (qwen3_dflash2.py) and SGLang 0.5.23
# (`DFlash2DraftModel` in sglang/srt/models/dflash.py, under --speculative-algorithm DFLASH:
# the drafter's architecture decides, as in vLLM). TensorRT-LLM's DFlash has no selector at
# any release we can name (its public source at 2fc4bbb knows DFlash only).
DFLASH2_BACKENDS = ("embedded", "vllm", "sglang")


class ConfigError(ValueError):
    """Invalid worker settings; `str()` is one line naming the field."""


class SpeculativeConfig(BaseModel):
    """`--speculative-config` JSON. Extra keys pass through to vLLM untouched."""

    model_config = ConfigDict(extra="allow", frozen=True)

    method: str = "dflash"
    model: str
    num_speculative_tokens: int | None = Field(default=None, ge=1)

    def as_json(self, num_speculative_tokens: int | None) -> str:
        data = self.model_dump(exclude_none=True)
        if data["method"] == "dflash2":  # vLLM knows no such method: the drafter's config decides
            data["method"] = "dflash"
        if num_speculative_tokens is not None:
            data["num_speculative_tokens"] = num_speculative_tokens
        return json.dumps(data, separators=(",", ":"))


class WorkerSettings(BaseModel):
    """Everything a worker process needs, read once at the edge (the CLI)."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    backend: Backend = "embedded"
    model: str = str(BUNDLED_TARGET)
    served_model_name: str | None = None
    speculative_config: SpeculativeConfig | None = None
    max_num_seqs: int = Field(default=8, ge=1, le=1024)
    max_model_len: int | None = Field(default=None, ge=16)
    host: str = "127.0.0.1"
    port: int = Field(default=8001, ge=1, le=65535)
    seed: int = Field(default=0, ge=0)
    per_request_spec_decode_metrics: SpecMetricsLevel = "summary"
    tensor_parallel_size: int = Field(default=1, ge=1)
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    dtype: Dtype = "auto"
    # Keys a client may present (Bearer); several let a key be rotated without a gap.
    api_key: tuple[str, ...] = Field(default=(), repr=False)
    extra_args: tuple[str, ...] = ()
    # Where `vllm` is (vllm backend; default: PATH, then this repository's .venv-vllm-cpu).
    vllm_bin: str | None = None
    # vllm backend: a JSON {"costs": CostModel, "rates": per-position acceptance} (as
    # `dflash-bench engine --adaptive --json` writes `adaptive_costs` / `adaptive_rates`) from
    # which vLLM's num_speculative_tokens_per_batch_size schedule is derived.
    spec_cost_model: str | None = None
    # Embedded-only knobs (no `vllm serve` equivalent; never put into the vLLM argv); SGLang
    # takes `device` too, when given.
    device: str = "cpu"
    # adaptive: each step verifies the k in [0, num_speculative_tokens] that a start-up cost
    # model and the live acceptance favour (0 = plain decoding), so speculation never costs
    # throughput; fixed: every step verifies num_speculative_tokens drafts (vLLM's policy).
    # None: adaptive on the embedded backend, vLLM's own on the vllm backend (fixed, or its
    # num_speculative_tokens_per_batch_size table).
    speculation: Literal["fixed", "adaptive"] | None = None
    # The drafter's matmuls in int8 (CPU): faster drafts, outputs still the target's.
    drafter_int8: bool = False
    threads: int | None = Field(default=None, ge=1)  # torch threads; None: our CPUs less one
    max_waiting: int = Field(default=64, ge=0)
    drain_timeout: float = Field(default=30.0, ge=0.0)  # vLLM: --shutdown-timeout
    # Idle keep-alive of client connections (uvicorn's timeout_keep_alive), read from vLLM's
    # env VLLM_HTTP_TIMEOUT_KEEP_ALIVE: one knob for both backends. A gateway reuses idle
    # connections for less than this (DFLASH_GATEWAY_UPSTREAM_KEEPALIVE_S).
    http_keep_alive_s: int = Field(default=5, ge=1)
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    # vLLM's flag: usage on every stream chunk whatever the client asked. Off, as OpenAI
    # defines usage; the gateway asks workers for the usage chunk itself.
    enable_force_include_usage: bool = False
    # OpenTelemetry's own environment (OTEL_*; docs/tracing.md): the embedded worker traces
    # with it, and the vllm/sglang/trtllm backends pass it to the engine's own flags.
    tracing: TracingSettings = Field(default_factory=TracingSettings, repr=False)

    @model_validator(mode="before")
    @classmethod
    def _bundled_drafter_by_default(cls, data: Any) -> Any:
        # No MODEL and no --speculative-config: the bundled target with its DFlash drafter
        # (for SGLang, which cannot capture the last layer, the portable one).
        if isinstance(data, dict) and "model" not in data and "speculative_config" not in data:
            drafter = (
                BUNDLED_PORTABLE_DRAFTER if data.get("backend") == "sglang" else BUNDLED_DRAFTER
            )
            bundled = {"method": "dflash", "model": str(drafter)}
            return {**data, "speculative_config": bundled}
        return data

    @field_validator("api_key", mode="before")
    @classmethod
    def _one_or_more_keys(cls, value: Any) -> Any:
        if value is None:
            return ()
        return (value,) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> WorkerSettings:
        _check_backend_fields(self)
        _check_checkpoints(self)
        return self

    @property
    def model_name(self) -> str:
        """The name clients use: `--served-model-name`, else what vLLM would use (MODEL)."""
        if self.served_model_name:
            return self.served_model_name
        if Path(self.model).resolve() == BUNDLED_TARGET:
            return BUNDLED_NAME
        return self.model

    @property
    def speculative(self) -> bool:
        return self.speculative_config is not None

    @property
    def adaptive_speculation(self) -> bool:
        """Whether the embedded engine chooses k per step (see `speculation`)."""
        chosen = self.speculation or ("adaptive" if self.backend == "embedded" else "fixed")
        return self.speculative and chosen == "adaptive"

    def num_speculative_tokens(self) -> int | None:
        """K: as configured, else the drafter's block_size - 1 (when its config is local)."""
        spec = self.speculative_config
        if spec is None:
            return None
        if spec.num_speculative_tokens is not None:
            return spec.num_speculative_tokens
        drafter = _read_config(spec.model)
        block = drafter.get("block_size") if drafter else None
        return block - 1 if isinstance(block, int) and block > 1 else None

    def resolved_max_model_len(self) -> int:
        """Context length for the embedded engine: as set, else min(2048, the model's)."""
        if self.max_model_len is not None:
            return self.max_model_len
        target = _read_config(self.model) or {}
        limit = target.get("max_position_embeddings")
        if isinstance(limit, int):
            return min(DEFAULT_MAX_MODEL_LEN, limit)
        return DEFAULT_MAX_MODEL_LEN

    def torch_dtype_name(self) -> str:
        """dtype for the embedded engine. `auto` means what it means to vLLM: the dtype the
        checkpoint's config.json names (`dtype`, or the older `torch_dtype`), float32 when
        it names none."""
        aliases = {"float": "float32", "half": "float16"}
        if self.dtype != "auto":
            return aliases.get(self.dtype, self.dtype)
        config = _read_config(self.model) or {}
        named = config.get("dtype") or config.get("torch_dtype") or "float32"
        return aliases.get(str(named), str(named))


def _check_backend_fields(s: WorkerSettings) -> None:
    spec = s.speculative_config
    if spec is not None and spec.method == "dflash2" and s.backend not in DFLASH2_BACKENDS:
        raise ValueError(
            f"speculative_config.method: 'dflash2' is served by the "
            f"{' and '.join(DFLASH2_BACKENDS)} backends, not {s.backend}"
        )
    if s.backend != "embedded":
        if s.spec_cost_model is not None and s.backend != "vllm":
            raise ValueError("spec_cost_model: the vllm backend's (vLLM's batch-size table)")
        if s.vllm_bin is not None and s.backend != "vllm":
            raise ValueError(f"vllm_bin: the vllm backend's, not {s.backend}'s")
        if s.speculation == "adaptive":
            raise ValueError(
                "speculation: adaptive is the embedded engine's; give vLLM its batch-size "
                "table as speculative_config.num_speculative_tokens_per_batch_size"
            )
        if s.drafter_int8:
            raise ValueError(
                "drafter_int8: the embedded engine's (vLLM: a quantized draft checkpoint)"
            )
        if "device" in s.model_fields_set and s.backend != "sglang":
            raise ValueError(
                f"device: the embedded engine's and SGLang's (--device); {s.backend} picks "
                "its device from its build"
            )
        return
    if s.drafter_int8 and (spec is None or s.device != "cpu"):
        raise ValueError("drafter_int8: needs a drafter (speculative_config) on the CPU")
    if spec is not None and spec.method not in DFLASH_METHODS:
        raise ValueError(
            f"speculative_config.method: {spec.method!r} is not supported by the embedded "
            "backend (only 'dflash' and 'dflash2')"
        )
    if s.tensor_parallel_size != 1:
        raise ValueError("tensor_parallel_size: the embedded backend runs on one device (use 1)")
    if s.spec_cost_model is not None:
        raise ValueError(
            "spec_cost_model: for the vllm backend (the embedded engine measures "
            "its own: --speculation adaptive)"
        )
    if s.extra_args:
        raise ValueError(
            "extra_args: only a server backend (vllm, sglang, trtllm) accepts extra arguments"
        )


def _read_config(path: str) -> dict[str, Any] | None:
    """A checkpoint folder's config.json, or None when `path` is not a local folder."""
    file = Path(path) / "config.json"
    return read_json_object(file) if file.is_file() else None


def _is_local(path: str) -> bool:
    return path.startswith(("/", ".", "~")) or Path(path).exists()


def _check_checkpoints(s: WorkerSettings) -> None:
    # vLLM may take Hugging Face hub ids; only local folders can be checked here.
    must_be_local = s.backend == "embedded"
    target = _load_checked(s.model, "model", must_be_local)
    if target is not None and s.max_model_len is not None:
        limit = target.get("max_position_embeddings")
        if isinstance(limit, int) and s.max_model_len > limit:
            raise ValueError(
                f"max_model_len: {s.max_model_len} exceeds the model's "
                f"max_position_embeddings ({limit})"
            )
    spec = s.speculative_config
    if spec is None:
        return
    drafter = _load_checked(spec.model, "speculative_config.model", must_be_local)
    if drafter is not None and spec.method in DFLASH_METHODS:
        _check_drafter(drafter, target, spec, s.backend)
        why = unportable(s.backend, drafter, target)
        if why is not None:
            raise ValueError(why)


def _load_checked(path: str, field: str, must_be_local: bool) -> dict[str, Any] | None:
    if not (must_be_local or _is_local(path)):
        return None
    try:
        data = _read_config(path)
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from exc
    if data is None:
        raise ValueError(f"{field}: {path} is not a checkpoint folder (no config.json)")
    return data


def _check_drafter(
    drafter: dict[str, Any], target: dict[str, Any] | None, spec: SpeculativeConfig, backend: str
) -> None:
    field = "speculative_config.model"
    architectures = drafter.get("architectures") or []
    dflash2 = DFLASH2_ARCHITECTURE in architectures
    if spec.method == "dflash2" and not dflash2:
        raise ValueError(
            f"{field}: {spec.model} is not a DFlash2 drafter (architectures: "
            f"{DFLASH2_ARCHITECTURE}), as method 'dflash2' asks"
        )
    if not dflash2 and "DFlashDraftModel" not in architectures:
        raise ValueError(f"{field}: {spec.model} is not a DFlash drafter (architectures)")
    if dflash2 and backend not in DFLASH2_BACKENDS:
        raise ValueError(
            f"{field}: {spec.model} is a DFlash2 drafter, which the {backend} backend does "
            f"not serve (use {' or '.join(DFLASH2_BACKENDS)})"
        )
    block = drafter.get("block_size")
    if not isinstance(block, int) or block < 2:
        raise ValueError(f"{field}: drafter block_size must be an integer >= 2, got {block!r}")
    k = spec.num_speculative_tokens
    if k is not None and k > block - 1:
        raise ValueError(
            f"speculative_config.num_speculative_tokens: {k} exceeds the drafter's "
            f"block_size - 1 = {block - 1}"
        )
    if target is None:
        return
    for key in ("hidden_size", "vocab_size"):
        mine, theirs = drafter.get(key), target.get(key)
        if mine is not None and theirs is not None and mine != theirs:
            raise ValueError(f"{field}: drafter {key} {mine} does not match the target's {theirs}")


def format_validation_error(exc: ValidationError) -> str:
    """One line: `field: message` for the first error pydantic found."""
    err = exc.errors()[0]
    loc = ".".join(str(part) for part in err.get("loc", ()))
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{loc}: {msg}" if loc else msg


def load_settings(**values: Any) -> WorkerSettings:
    """Build settings, turning pydantic's report into a one-line ConfigError."""
    try:
        return WorkerSettings(**values)
    except ValidationError as exc:
        raise ConfigError(f"invalid worker setting {format_validation_error(exc)}") from None
