"""The sampler's distributions: softmax at a temperature, top-k, top-p and both together,
against exact references by chi-square, and the filters' support under random inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replaylm.sampling_params import SamplingParams
from tests.sampling.sampler_helpers import chi_square, draws

# chi-square 99.99% quantiles by degrees of freedom; draws are deterministic (counter-based),
# so these bounds cannot flake, and a wrong distribution overshoots them by orders of magnitude.
_CHI2_LIMIT = {1: 15.2, 2: 18.5, 3: 21.2, 4: 23.6, 5: 25.8, 6: 27.9, 7: 29.9}


LOGITS8 = torch.tensor([1.5, -0.5, 0.3, 2.0, -1.0, 0.9, 0.0, -2.2])


# --- distributions ----------------------------------------------------------------------------


def _renormalised(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum()


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
def test_distribution_matches_softmax(temperature: float) -> None:
    tokens = draws(LOGITS8, SamplingParams(temperature=temperature), 40000)
    probs = torch.softmax(LOGITS8.double() / temperature, dim=-1)
    assert chi_square(tokens, probs) < _CHI2_LIMIT[7]


def test_distribution_check_can_fail() -> None:
    """Guard on the statistic itself: the wrong temperature must be rejected."""
    tokens = draws(LOGITS8, SamplingParams(temperature=1.0), 40000)
    probs = torch.softmax(LOGITS8.double() / 1.2, dim=-1)
    assert chi_square(tokens, probs) > _CHI2_LIMIT[7]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_top_k_support_and_distribution(k: int) -> None:
    temperature = 0.8
    tokens = draws(LOGITS8, SamplingParams(temperature=temperature, top_k=k), 30000)
    probs = torch.softmax(LOGITS8.double() / temperature, dim=-1)
    keep = torch.zeros(8, dtype=torch.bool)
    keep[LOGITS8.topk(k).indices] = True
    assert keep[tokens].all()
    if k > 1:
        assert chi_square(tokens, _renormalised(probs, keep)) < _CHI2_LIMIT[k - 1]
    else:
        assert (tokens == LOGITS8.argmax()).all()


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Reference nucleus: the shortest sorted-descending prefix whose mass reaches top_p."""
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for idx in order.tolist():
        keep[idx] = True
        mass += float(probs[idx])
        if mass >= top_p:
            break
    return keep


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 0.5), (1.0, 0.8), (0.7, 0.9),
                                                    (1.5, 0.3), (1.0, 0.01)])
def test_top_p_support_and_distribution(temperature: float, top_p: float) -> None:
    tokens = draws(LOGITS8, SamplingParams(temperature=temperature, top_p=top_p), 30000)
    probs = torch.softmax(LOGITS8.double() / temperature, dim=-1)
    keep = _nucleus(probs, top_p)
    assert keep[tokens].all(), "sampled outside the nucleus"
    size = int(keep.sum())
    if size > 1:
        assert chi_square(tokens, _renormalised(probs, keep)) < _CHI2_LIMIT[size - 1]
        assert tokens.unique().numel() == size  # and every nucleus token does get drawn
    else:
        assert (tokens == LOGITS8.argmax()).all()  # the top token is always kept


def test_top_k_then_top_p() -> None:
    """Top-p applies to the distribution renormalised over the top-k set."""
    temperature, k, top_p = 1.0, 4, 0.75
    tokens = draws(LOGITS8, SamplingParams(temperature=temperature, top_k=k, top_p=top_p), 30000)
    probs = torch.softmax(LOGITS8.double() / temperature, dim=-1)
    in_k = torch.zeros(8, dtype=torch.bool)
    in_k[LOGITS8.topk(k).indices] = True
    keep = _nucleus(_renormalised(probs, in_k), top_p)
    # The renormalisation matters here: over all 8 tokens the nucleus would be larger.
    assert int(keep.sum()) < int(_nucleus(probs, top_p).sum())
    assert keep[tokens].all()
    assert chi_square(tokens, _renormalised(probs, keep)) < _CHI2_LIMIT[int(keep.sum()) - 1]


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(2, 40),
    temperature=st.floats(0.05, 3.0),
    k=st.integers(0, 45),
    top_p=st.floats(0.02, 1.0),
    data=st.data(),
)
def test_filters_never_leave_their_support(
    vocab: int, temperature: float, k: int, top_p: float, data: st.DataObject
) -> None:
    values = data.draw(st.lists(st.floats(-8, 8, width=32), min_size=vocab, max_size=vocab))
    logits = torch.tensor(values, dtype=torch.float32)
    params = SamplingParams(temperature=temperature, top_k=k, top_p=top_p)
    tokens = draws(logits, params, 64, seed=data.draw(st.integers(0, 2**63 - 1)))
    # The sampler divides in fp32 (per-slot fp32 temperatures): compare in the same precision,
    # or two logits one denormal apart tie there but not here.
    scaled = (logits / torch.tensor(temperature, dtype=torch.float32)).double()
    probs = torch.softmax(scaled, dim=-1)
    k_eff = k if 0 < k <= vocab else vocab
    kth = scaled.sort(descending=True).values[k_eff - 1]
    in_k = scaled >= kth
    renorm = _renormalised(probs, in_k)
    for t in tokens.tolist():
        above = scaled > scaled[t]
        assert int(above.sum()) < k_eff, "left the top-k set"
        # Mass strictly above the token, within top-k, must be short of p (fp slack only).
        assert float(renorm[above].sum()) < top_p + 1e-5, "left the nucleus"
