"""``EngineArgs``: every engine setting in one frozen dataclass, validated on construction.

``LLM(...)``, the CLI and ``replaylm serve`` all build from it with the same names. Values the
engine derives at start-up (KV blocks, graph tiers, resolved dtype) live on the engine, never
written back here.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from dataclasses import dataclass, fields
from typing import Any, get_args

from replaylm.graphs.policy import GRAPH_MODES
from replaylm.speculative.config import SpecConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
ATTENTION_BACKENDS = ("auto", "torch", "torch_dense", "triton")
PDL_SETTINGS = ("auto", "on", "off")
ALL_REDUCE_BACKENDS = ("auto", "nccl", "symm_mem")
QUANTIZATIONS = ("fp8",)

_HELP: dict[str, str] = {
    "model": "Hugging Face model directory, or a named shape (default, qwen3-0.6b, "
    "llama3.2-1b, llama3-8b, qwen1.5-moe-a2.7b, qwen3-30b-a3b)",
    "tokenizer": "tokenizer directory (defaults to the model's)",
    "dtype": "weight and activation dtype; auto = bfloat16 on CUDA, float32 on CPU",
    "device": "auto, cpu or cuda[:N]",
    "seed": "engine seed: dummy weights and requests without their own seed",
    "max_model_len": "longest prompt + output per request (default: the model's limit, "
    "capped at 8192)",
    "max_num_seqs": "most requests running at once",
    "max_num_batched_tokens": "per-step token budget (prefill chunks + decodes)",
    "enable_chunked_prefill": "split long prompts over several steps, mixed with decodes",
    "max_mixed_prefill_tokens": "with chunked prefill, the most prompt tokens a step that "
    "also decodes may carry, so new requests' prefills spread over the decode steps instead "
    "of making a few steps much longer (a step with nothing to decode fills "
    "max_num_batched_tokens; 0 = no cap)",
    "gc_gen0_threshold": "Python's young-generation garbage-collection threshold, set for "
    "the whole process once the engine has started (steps at a few hundred requests make "
    "thousands of short-lived objects, and at the default of 700 the collector runs in nearly "
    "every step; 0 = leave Python's thresholds as they are)",
    "gpu_memory_utilization": "share of GPU memory the engine may use (weights + activations "
    "+ KV cache)",
    "num_kv_blocks": "fixed number of 16-token KV blocks (overrides the memory-based sizing)",
    "cpu_kv_cache_gib": "KV cache size on CPU, in GiB",
    "max_num_kv_blocks": "largest KV pool LLM.resize_kv_cache() may grow to, in 16-token "
    "blocks: its addresses are reserved at start-up and the pool lives in address-stable "
    "memory (CUDA virtual memory management); the start-up pool is capped at it (default: "
    "the start-up size with enable_sleep_mode, else the pool cannot be resized)",
    "enforce_eager": "never use CUDA graphs (wins over --cuda-graph-mode)",
    "cuda_graph_mode": f"one of {', '.join(GRAPH_MODES)} (default: eager on CPU)",
    "load_format": "auto (safetensors if present), safetensors, or dummy (random weights)",
    "quantization": "fp8 = the linear projections' weights (attention, MLP, MoE experts) in "
    "float8_e4m3fn with one float32 scale per output channel, quantized as they load; "
    "a compressed-tensors FP8 checkpoint is read as it is stored, with or without this "
    "setting (default: the checkpoint's own weights)",
    "quantize_lm_head": "with quantization fp8, hold the (untied) LM head in FP8 too",
    "skip_tokenizer_init": "run on token ids alone (no tokenizer)",
    "enable_prefix_caching": "reuse the KV blocks of repeated prompt prefixes (automatic "
    "prefix caching)",
    "max_logprobs": "largest logprobs / prompt_logprobs a request may ask for",
    "attention_backend": "auto (triton on CUDA when available, else torch), torch, "
    "torch_dense (graph-safe torch) or triton",
    "graph_tiers": "comma-separated graph tiers (e.g. 1,2,4,8,16), or auto:TRACE.json to fit "
    "them to a traffic trace",
    "max_graph_tokens": "largest token tier captured (steps above it run without a graph)",
    "max_graphs": "graph budget for --graph-tiers auto:TRACE.json",
    "graph_check": "every Nth graph step is also run eagerly on the same padded batch and "
    "compared bit for bit (0 = off)",
    "fused_kernels": "fused Triton kernels for norms, SiLU and rotary+KV write (CUDA with the "
    "triton attention backend)",
    "overlap_scheduling": "build and launch step N+1 while the GPU runs step N (samples reach "
    "the host one step late; stop checks lag one step); with speculative decoding, plain "
    "steps and pipelined verify steps (speculative_config 'pipeline')",
    "poison_padding": "debug: padded tokens carry NaN activations so a padding leak shows",
    "pdl": "programmatic dependent launch of the Triton kernels (each may start while the one "
    "before finishes): auto = on from compute capability 9.0",
    "shipped_tuning_table": "take the projection-kernel decisions this machine's tuning "
    "cache lacks from the table shipped for this GPU model (same torch, Triton, PDL mode and "
    "kernel sources only); --no-shipped-tuning-table times every shape here",
    "tuning_compile_threads": "threads that compile kernels ahead: the projection kernels' "
    "tile candidates before they are timed, and the compile plan's variants (0 = one per CPU "
    "core, at most 16; 1 = candidates compile when first timed)",
    "compile_ahead": "on CUDA, compile at start-up, on a thread pool, the kernel variants an "
    "earlier start with the same model shapes and settings compiled (its compile plan, "
    "kept in the cache directory; replaylm ships plans for some GPUs), and save this "
    "start's plan",
    "rope_in_attention_max_reqs": "decode steps of up to this many requests do q/k norm, "
    "rotary and the KV write inside the attention launch (fused kernels, modes that graph "
    "attention with the model); 0 = never",
    "moe_side_stream_max_tokens": "MoE models with a shared expert: graphs of up to this "
    "many tokens run the shared expert on a side stream beside the routed experts (CUDA); "
    "0 = inline",
    "max_stop_strings": "most stop strings a request may give",
    "max_stop_string_length": "longest stop string a request may give, in characters",
    "structured_outputs_any_whitespace": "JSON structured outputs (json schema, json_object) "
    "may carry any whitespace between tokens; by default they are compact (no free "
    "whitespace), as xgrammar's any_whitespace=False",
    "structured_outputs_compile_timeout_s": "longest a request's structured-output grammar may "
    "take to compile (seconds); past it the request is refused (a 400 in the server)",
    "structured_outputs_compile_threads": "threads that compile structured-output grammars "
    "(off the engine thread; compiled grammars are cached per process)",
    "data_parallel_size": "data-parallel ranks: one worker process per rank, each with its "
    "own engine (scheduler, KV pool, graphs); every step the ranks agree on one graph tier",
    "tensor_parallel_size": "tensor-parallel ranks: one worker process (one GPU) per rank, "
    "each holding its slice of the attention heads, the MLP (MoE: of every expert) and the "
    "vocabulary; with data_parallel_size M, M groups of N ranks",
    "all_reduce_backend": "how tensor-parallel ranks sum their partial results: nccl = "
    "torch.distributed's all-reduce (gloo on CPU); symm_mem = torch's symmetric-memory "
    "all-reduce (one-shot or two-shot, the faster measured at start-up per size) for messages "
    "up to 256 tokens x hidden size, NCCL above (CUDA, bfloat16 or float32); auto = measure "
    "NCCL and symmetric memory on decode-sized messages at start-up and use the fastest per "
    "size (NCCL or gloo where symmetric memory is unavailable); the choice is in graph_stats()",
    "enable_dp_attention": "data-parallel attention: each of the data_parallel_size ranks runs "
    "attention on its own requests (full heads, own KV pool) while the dense MLP is "
    "tensor-parallel across the ranks (tokens all-gathered, outputs reduce-scattered); needs "
    "data_parallel_size >= 2 and tensor_parallel_size 1",
    "distributed_timeout_s": "seconds the driver waits for a worker (start-up and every "
    "step) before it raises naming the rank; also the ranks' collective timeout",
    "enable_sleep_mode": "keep the weights and the KV pool in address-stable memory (CUDA "
    "virtual memory management), so LLM.sleep() can free it and wake_up() map it back without "
    "recapturing graphs",
    "sleep_pin_ahead": "with enable_sleep_mode, pin the host memory of sleep(level=1)'s copy "
    "of the weights on a background thread once start-up has captured its graphs, so the "
    "first sleep only copies (costs host memory the size of the weights from start-up on; "
    "off: pinned at the first sleep(level=1))",
    "enable_lora": "serve LoRA adapters (PEFT format) over the base model: requests pick one "
    "(or none) each, and every mix of adapters runs in one batch through the same graphs",
    "max_loras": "adapters resident on the device at once (the adapter slots every step can "
    "mix); a request whose adapter is not resident waits until a slot frees",
    "max_lora_rank": "largest adapter rank accepted; every slot is sized for it",
    "max_cpu_loras": "adapters kept loaded in host memory (least recently used evicted; "
    "default: max_loras); must be >= max_loras",
    "speculative_config": "speculative decoding, as JSON: {\"method\": \"ngram\", "
    "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4} or {\"method\": "
    "\"draft_model\", \"model\": DIR_OR_SHAPE, \"num_speculative_tokens\": 4, "
    "\"draft_confidence\": 0.3} (default: off)",
}


@dataclass(frozen=True)
class EngineArgs:
    """All engine settings. Unknown or out-of-range values raise ``ValueError`` naming the field."""

    model: str = "default"
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    # 256 decodes + 256 prompt tokens fill the largest default graph tier (max_graph_tokens).
    max_mixed_prefill_tokens: int = 256
    gc_gen0_threshold: int = 20_000
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    cpu_kv_cache_gib: float = 1.0
    max_num_kv_blocks: int | None = None
    enforce_eager: bool = False
    cuda_graph_mode: str | None = None
    load_format: str = "auto"
    quantization: str | None = None
    quantize_lm_head: bool = False
    skip_tokenizer_init: bool = False
    enable_prefix_caching: bool = True
    max_logprobs: int = 20
    attention_backend: str = "auto"
    graph_tiers: str | None = None
    max_graph_tokens: int = 512
    max_graphs: int | None = None
    graph_check: int = 0
    poison_padding: bool = False
    fused_kernels: bool = True
    overlap_scheduling: bool = True
    pdl: str = "auto"
    shipped_tuning_table: bool = True
    tuning_compile_threads: int = 0
    compile_ahead: bool = True
    rope_in_attention_max_reqs: int = 1
    # The largest measured size at which the side stream paid (docs/benchmarks.md, MoE).
    moe_side_stream_max_tokens: int = 64
    max_stop_strings: int = 32
    max_stop_string_length: int = 256
    structured_outputs_any_whitespace: bool = False
    structured_outputs_compile_timeout_s: float = 10.0
    structured_outputs_compile_threads: int = 2
    speculative_config: dict | None = None
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    all_reduce_backend: str = "auto"
    enable_dp_attention: bool = False
    distributed_timeout_s: float = 600.0
    enable_sleep_mode: bool = False
    sleep_pin_ahead: bool = True
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    @functools.cached_property
    def spec(self) -> SpecConfig | None:
        """``speculative_config`` parsed (``SpecConfig``), or None when speculation is off. The
        one place it is parsed: ``__post_init__`` reads it, so a bad dict fails here."""
        if self.speculative_config is None:
            return None
        return SpecConfig.from_dict(self.speculative_config)

    def __post_init__(self) -> None:
        _choice("dtype", self.dtype, DTYPES)
        _choice("load_format", self.load_format, LOAD_FORMATS)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _choice("pdl", self.pdl, PDL_SETTINGS)
        if self.quantization is not None:
            _choice("quantization", self.quantization, QUANTIZATIONS)
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError("EngineArgs.quantize_lm_head=True needs quantization='fp8' (it "
                             "says whether the LM head is quantized too)")
        if self.cuda_graph_mode is not None:
            _choice("cuda_graph_mode", self.cuda_graph_mode, GRAPH_MODES)
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ValueError(f"EngineArgs.device={self.device!r} is invalid: use auto, cpu or cuda[:N]")
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _non_negative("max_mixed_prefill_tokens", self.max_mixed_prefill_tokens)
        _non_negative("gc_gen0_threshold", self.gc_gen0_threshold)
        _non_negative("max_logprobs", self.max_logprobs)
        _positive("max_graph_tokens", self.max_graph_tokens)
        _positive("max_stop_strings", self.max_stop_strings)
        _positive("max_stop_string_length", self.max_stop_string_length)
        _positive("structured_outputs_compile_threads", self.structured_outputs_compile_threads)
        t = self.structured_outputs_compile_timeout_s
        if isinstance(t, bool) or not isinstance(t, int | float) or not t > 0:
            raise ValueError(f"EngineArgs.structured_outputs_compile_timeout_s={t!r} is "
                             "invalid: must be a number of seconds > 0")
        if self.max_graphs is not None:
            _positive("max_graphs", self.max_graphs)
        _non_negative("graph_check", self.graph_check)
        _non_negative("rope_in_attention_max_reqs", self.rope_in_attention_max_reqs)
        _non_negative("tuning_compile_threads", self.tuning_compile_threads)
        _non_negative("moe_side_stream_max_tokens", self.moe_side_stream_max_tokens)
        _ = self.spec  # parses (and so validates) speculative_config
        _positive("data_parallel_size", self.data_parallel_size)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if isinstance(self.distributed_timeout_s, bool) or not isinstance(
                self.distributed_timeout_s, int | float) or not self.distributed_timeout_s > 0:
            raise ValueError(f"EngineArgs.distributed_timeout_s={self.distributed_timeout_s!r} "
                             "is invalid: must be a number of seconds > 0")
        _check_all_reduce_backend(self)
        if self.enable_dp_attention:
            _check_dp_attention(self)
        _check_lora(self)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(
                f"EngineArgs.num_kv_blocks={self.num_kv_blocks} is invalid: must be >= 2 "
                "(block 0 is the reserved scratch block)"
            )
        if self.max_num_kv_blocks is not None:
            if self.max_num_kv_blocks < 2:
                raise ValueError(f"EngineArgs.max_num_kv_blocks={self.max_num_kv_blocks} is "
                                 "invalid: must be >= 2 (block 0 is the reserved scratch block)")
            if self.num_kv_blocks is not None and self.num_kv_blocks > self.max_num_kv_blocks:
                raise ValueError(f"EngineArgs.num_kv_blocks={self.num_kv_blocks} is invalid: "
                                 f"more than max_num_kv_blocks={self.max_num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"EngineArgs.gpu_memory_utilization={self.gpu_memory_utilization} is invalid: "
                "must be in (0, 1]"
            )
        if self.cpu_kv_cache_gib <= 0:
            raise ValueError(f"EngineArgs.cpu_kv_cache_gib={self.cpu_kv_cache_gib} must be > 0")
        if not self.enable_chunked_prefill and self.max_model_len is not None \
                and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"EngineArgs.max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_model_len={self.max_model_len} when chunked prefill is disabled"
            )

    def replace(self, **changes: Any) -> EngineArgs:
        return dataclasses.replace(self, **changes)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, **defaults: Any) -> argparse.ArgumentParser:
        """Add one ``--flag`` per field (``--max-num-seqs`` for ``max_num_seqs``)."""
        group = parser.add_argument_group("engine")
        for f in fields(EngineArgs):
            flag = "--" + f.name.replace("_", "-")
            default = defaults.get(f.name, f.default)
            help_ = _HELP.get(f.name, "")
            if f.type in ("bool", bool):
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                   help=help_)
                continue
            kind = _cli_type(f.type)
            choices = {"dtype": DTYPES, "load_format": LOAD_FORMATS,
                       "attention_backend": ATTENTION_BACKENDS, "pdl": PDL_SETTINGS,
                       "cuda_graph_mode": GRAPH_MODES,
                       "all_reduce_backend": ALL_REDUCE_BACKENDS,
                       "quantization": QUANTIZATIONS}.get(f.name)
            group.add_argument(flag, type=kind, default=default, choices=choices,
                               help=f"{help_} (default: {default})")
        return parser

    @staticmethod
    def from_cli_args(ns: argparse.Namespace) -> EngineArgs:
        return EngineArgs(**{f.name: getattr(ns, f.name) for f in fields(EngineArgs)})


def _json_dict(text: str) -> dict:
    """A CLI value given as a JSON object (``--speculative-config '{...}'``)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _cli_type(annotation: Any) -> Any:
    text = str(annotation)
    if "dict" in text:
        return _json_dict
    if "int" in text:
        return int
    if "float" in text:
        return float
    for arg in get_args(annotation):
        if arg in (int, float):
            return arg
    return str


def _check_dp_attention(args: EngineArgs) -> None:
    """Data-parallel attention spans the data-parallel ranks alone (the MLP's tensor-parallel
    group is theirs)."""
    field = "EngineArgs.enable_dp_attention=True"
    if args.data_parallel_size < 2:
        raise ValueError(f"{field} needs data_parallel_size >= 2 (got "
                         f"{args.data_parallel_size}): the MLP is split across those ranks")
    if args.tensor_parallel_size != 1:
        raise ValueError(f"{field} needs tensor_parallel_size=1 (got "
                         f"{args.tensor_parallel_size}): the data-parallel ranks form the "
                         "MLP's tensor-parallel group")


def _check_lora(args: EngineArgs) -> None:
    """The LoRA settings, and the engine features LoRA does not run with."""
    _positive("max_loras", args.max_loras)
    _positive("max_lora_rank", args.max_lora_rank)
    if args.max_cpu_loras is not None:
        _positive("max_cpu_loras", args.max_cpu_loras)
        if args.max_cpu_loras < args.max_loras:
            raise ValueError(f"EngineArgs.max_cpu_loras={args.max_cpu_loras} is invalid: must "
                             f"be >= max_loras={args.max_loras}")
    if args.enable_lora and args.enable_dp_attention:
        raise ValueError("EngineArgs.enable_lora=True is not supported with "
                         "enable_dp_attention (the MLP runs on every rank's rows)")


def _choice(name: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ValueError(f"EngineArgs.{name}={value!r} is invalid: choose one of {list(options)}")


def _check_all_reduce_backend(args: EngineArgs) -> None:
    """``symm_mem`` where the settings alone show it cannot work (the rest is checked at
    start-up, ``model.allreduce``)."""
    _choice("all_reduce_backend", args.all_reduce_backend, ALL_REDUCE_BACKENDS)
    if args.all_reduce_backend != "symm_mem":
        return
    field = "EngineArgs.all_reduce_backend='symm_mem'"
    if args.tensor_parallel_size == 1:
        raise ValueError(f"{field} needs tensor_parallel_size > 1 (one rank does no all-reduce)")
    if args.device == "cpu":
        raise ValueError(f"{field} needs CUDA (device='cpu' runs the all-reduce on gloo)")
    if args.dtype == "float16":
        raise ValueError(f"{field} needs dtype bfloat16 or float32 (torch's symmetric-memory "
                         "all-reduce has no float16 kernels)")


def _non_negative(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"EngineArgs.{name}={value!r} is invalid: must be an integer >= 0")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"EngineArgs.{name}={value!r} is invalid: must be an integer >= 1")
