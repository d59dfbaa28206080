"""What users call, above the engines: ``LLM`` (the offline API) and ``make_engine``, which
builds the engine a configuration asks for (one ``EngineCore``, or the driver of worker
processes for data or tensor parallelism). The server and the benchmarks build theirs here."""

from replaylm.entrypoints.factory import make_engine
from replaylm.entrypoints.llm import LLM

__all__ = ["LLM", "make_engine"]
