"""On-device, graph-capturable token sampling."""

from replaylm.sampling.sampler import SamplingState, sample

__all__ = ["SamplingState", "sample"]
