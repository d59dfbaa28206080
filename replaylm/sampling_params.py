"""Per-request sampling settings, validated on construction.

Every numeric field is checked against the range it can take where it lands: per-slot device
tensors hold temperature, top-p, min-p and the penalties as float32 and top-k, min_tokens and
seeds as int64, so a value that fits Python but not its tensor is refused here, naming the
field, rather than failing inside a step.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

# Penalties are kept in vLLM's accepted ranges: beyond them the distribution degenerates.
MAX_ABS_PRESENCE_FREQUENCY = 2.0
#: Temperatures below this are greedy (vLLM's rule): dividing logits by a smaller (or
#: subnormal) temperature overflows float32 and samples garbage instead of the argmax.
GREEDY_BELOW = 1e-5
#: The largest finite float32: per-slot float settings are stored in float32 tensors.
FLOAT32_MAX = 3.4028234663852886e38
#: The smallest normal float32: a positive divisor below it underflows to 0 or loses precision.
FLOAT32_TINY = 1.1754943508222875e-38
#: One past the largest int64: per-slot integer settings are stored in int64 tensors.
INT64_END = 2**63
#: Most choices per request (each is a request of its own in the scheduler).
MAX_N = 4096
#: Most ``logit_bias`` entries and ``stop_token_ids``: each request's list is a row of a
#: ``[max_num_seqs, width]`` device table as wide as the longest list in use.
MAX_TOKEN_LIST = 1024
_TOKEN_ID_KEY = re.compile(r"-?[0-9]+")


@dataclass
class SamplingParams:
    """How to sample one request's output (vLLM-compatible names).

    ``temperature=0`` is greedy, and so is any temperature below ``GREEDY_BELOW`` (1e-5).
    ``top_k=-1`` (or 0, or any value at least the vocabulary size) and ``top_p=1`` disable
    those filters.
    ``seed`` makes a request's samples reproducible whatever batch it lands in; with ``n > 1``
    sibling ``i`` samples from a stream derived from ``(seed, i)`` (sibling 0 uses ``seed``).

    Logit processing (all neutral by default, and then skipped entirely):
    ``presence_penalty`` / ``frequency_penalty`` follow OpenAI (subtracted once per seen output
    token / once per occurrence), ``repetition_penalty`` follows HF/vLLM (over prompt and output
    tokens: positive logits divided, negative multiplied), ``min_p`` keeps tokens whose
    probability is at least ``min_p`` times the top one's (after temperature), ``logit_bias``
    adds to chosen token ids' logits, and ``min_tokens`` masks EOS and ``stop_token_ids`` until
    that many tokens have been generated (a stop string counts only once more than that many
    tokens exist, as in vLLM).

    ``stop`` strings end the output when they appear in the text (the first to complete; the
    engine bounds their number and length, ``EngineArgs.max_stop_strings`` and
    ``max_stop_string_length``); the stop string itself is dropped unless
    ``include_stop_str_in_output``. ``logprobs=k`` returns, per generated token,
    its logprob and the top-``k`` alternatives; ``prompt_logprobs=k`` does the same for every
    prompt token after the first. Logprobs are of the raw model distribution (before penalties
    and temperature), like vLLM's default.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _int("n", self.n, 1, MAX_N)
        _check(
            self.best_of is None or self.best_of == self.n, "best_of", self.best_of,
            "must be None or equal to n (ranking best_of > n candidates is not supported)",
        )
        _float("temperature", self.temperature, 0.0, FLOAT32_MAX)
        _float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k", self.top_k,
               "must be -1 (off) or an integer >= 0")
        _float("min_p", self.min_p, 0.0, 1.0)
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, 1, INT64_END - 1,
                 "(or None for up to max_model_len)")
        _int("min_tokens", self.min_tokens, 0, INT64_END - 1)
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})",
        )
        if self.seed is not None:
            _int("seed", self.seed, 0, INT64_END - 1)
        if isinstance(self.stop_token_ids, str | bytes):
            _check(False, "stop_token_ids", self.stop_token_ids, "must be a list of token ids")
        self.stop_token_ids = list(self.stop_token_ids)
        _check(len(self.stop_token_ids) <= MAX_TOKEN_LIST, "stop_token_ids",
               f"<{len(self.stop_token_ids)} ids>", f"at most {MAX_TOKEN_LIST} ids")
        for t in self.stop_token_ids:
            _check(_is_int(t) and 0 <= t < INT64_END, "stop_token_ids", t,
                   "must be token ids (integers >= 0)")
        if self.top_k == 0:
            self.top_k = -1
        self._check_stop()
        self._check_penalties()
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None:
                _int(name, v, 0, INT64_END - 1, "(or None)")
        so = self.structured_outputs
        if isinstance(so, dict):  # JSON clients and vLLM users pass a mapping
            try:
                so = StructuredOutputsParams(**so)
            except TypeError as e:
                _check(False, "structured_outputs", so, f"unknown field ({e})")
        _check(so is None or isinstance(so, StructuredOutputsParams), "structured_outputs", so,
               "must be a StructuredOutputsParams (or a dict of its fields)")
        self.structured_outputs = so

    def _check_stop(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        for s in self.stop:
            _check(isinstance(s, str) and s != "", "stop", s, "must be non-empty strings")

    def _check_penalties(self) -> None:
        lim = MAX_ABS_PRESENCE_FREQUENCY
        for name in ("presence_penalty", "frequency_penalty"):
            _float(name, getattr(self, name), -lim, lim)
        _float("repetition_penalty", self.repetition_penalty, FLOAT32_TINY, FLOAT32_MAX,
               "(1 is off)")
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), "logit_bias", self.logit_bias,
                   "must be a mapping of token id to bias")
            _check(len(self.logit_bias) <= MAX_TOKEN_LIST, "logit_bias",
                   f"<{len(self.logit_bias)} entries>", f"at most {MAX_TOKEN_LIST} entries")
            bias = {}
            for k, v in self.logit_bias.items():
                # JSON clients send ids as strings: accept "42" like OpenAI does (ASCII digits
                # only: str.isdigit would also pass "²", which int() then refuses).
                tid = int(k) if isinstance(k, str) and _TOKEN_ID_KEY.fullmatch(k) else k
                _check(_is_int(tid) and 0 <= tid < INT64_END, "logit_bias", k,
                       "keys must be token ids (integers >= 0)")
                _check(_is_finite(v) and -100.0 <= v <= 100.0,
                       "logit_bias", v, "values must be numbers in [-100, 100]")
                bias[tid] = float(v)
            self.logit_bias = bias or None

    @property
    def greedy(self) -> bool:
        """Temperature 0, or below ``GREEDY_BELOW``: the argmax is taken."""
        return self.temperature < GREEDY_BELOW

    @property
    def uses_penalties(self) -> bool:
        """Whether presence/frequency/repetition penalties change anything."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )



#: The kinds of structured output, in ``StructuredOutputsParams`` field order.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output to a grammar (vLLM's ``StructuredOutputsParams`` names).

    Exactly one kind per request: ``json`` (a JSON schema, as a dict or its JSON text),
    ``regex`` (a regular expression the whole output matches), ``choice`` (one of these
    strings), ``grammar`` (an EBNF grammar, xgrammar's GBNF dialect, rule ``root`` first),
    ``json_object=True`` (any JSON object) or ``structural_tag`` (an xgrammar structural tag,
    as a dict or its JSON text: literal text and JSON-schema parts in sequence, as tool calls
    need). The engine compiles it (``replaylm.structured``);
    a spec that does not compile is a ``ValueError`` naming the field.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        where = "SamplingParams.structured_outputs"
        if len(given) != 1:
            got = " and ".join(given) if given else "none"
            raise ValueError(f"{where} is invalid: give exactly one of "
                             f"{', '.join(STRUCTURED_KINDS)} (got {got})")
        kind = given[0]
        value = getattr(self, kind)
        ok = {"json": isinstance(value, str | dict),
              "structural_tag": isinstance(value, str | dict), "regex": isinstance(value, str),
              "grammar": isinstance(value, str), "json_object": value is True,
              "choice": isinstance(value, list | tuple) and len(value) > 0
              and all(isinstance(c, str) and c for c in value)}[kind]
        rule = {"json": "a JSON schema (dict or JSON text)",
                "structural_tag": "a structural tag (dict or JSON text)", "regex": "a string",
                "grammar": "an EBNF grammar (a string)", "json_object": "True",
                "choice": "a non-empty list of non-empty strings"}[kind]
        if not ok:
            raise ValueError(f"{where}.{kind}={value!r} is invalid: must be {rule}")
        if kind == "choice":
            object.__setattr__(self, "choice", tuple(value))

    @property
    def kind(self) -> str:
        """The one kind given: json, regex, choice, grammar, json_object or structural_tag."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: {rule}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite(v: object) -> bool:
    """A finite int or float (not a bool); a huge int is finite (and compared exactly)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    return isinstance(v, int) or math.isfinite(v)


def _int(name: str, value: object, lo: int, hi: int, note: str = "") -> None:
    """An integer (not a bool) in ``[lo, hi]``."""
    top = "2**63 - 1" if hi == INT64_END - 1 else str(hi)
    _check(_is_int(value) and lo <= value <= hi, name, value,
           f"must be an integer in [{lo}, {top}]" + (f" {note}" if note else ""))


def _float(name: str, value: object, lo: float, hi: float, note: str = "",
           low_open: bool = False) -> None:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``low_open``)."""
    ok = _is_finite(value) and (lo < value if low_open else lo <= value) and value <= hi
    top = "3.4e38 (float32)" if hi == FLOAT32_MAX else f"{hi:g}"
    bottom = "1.2e-38" if lo == FLOAT32_TINY else f"{lo:g}"
    _check(ok, name, value, f"must be a finite number in {'(' if low_open else '['}{bottom}, "
           f"{top}]" + (f" {note}" if note else ""))


def sibling_seed(seed: int, index: int) -> int:
    """Sibling ``index``'s seed among ``n`` samples of one request: sibling 0 keeps the
    request's seed (so ``n=1`` and the first of ``n`` agree); the others get distinct streams
    derived from ``(seed, index)``. A negative seed is returned as it is, for
    ``SamplingParams`` to reject by name."""
    if index == 0 or seed < 0:
        return seed
    return (seed + index * 0x9E3779B97F4A7C15) % 2**63
