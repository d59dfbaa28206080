"""replaylm: a CUDA-graph-centred LLM inference engine for Llama/Qwen-family models."""

from replaylm.config import EngineArgs
from replaylm.engine.outputs import CompletionOutput, RequestOutput
from replaylm.entrypoints import LLM
from replaylm.lora import LoRARequest
from replaylm.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "EngineArgs", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput"]
__version__ = "0.1.0"
