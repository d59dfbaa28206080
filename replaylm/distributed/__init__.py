"""Data and tensor parallelism: one worker process per rank, each with its own ``EngineCore``
(a data-parallel rank's leader) or model shard (a tensor-parallel follower).

- ``agreement``: the ranks' torch.distributed (gloo) process group and the per-step tier
  agreement: every step each rank all-reduces its dispatch inputs (max tokens, max requests,
  min uniform decode, min can-use-graph) and dispatches the agreed values, so all ranks
  replay the same graph; a rank with no work replays it on an all-padding batch.
- ``worker``: the worker process: its engine and its end of the control pipe.
- ``driver``: ``MultiProcessEngine``, what ``LLM(..., data_parallel_size=N)`` or
  ``tensor_parallel_size=N`` drives:
  places requests on the least-loaded rank, routes aborts, steps every rank in lockstep
  (one message per rank per step), aggregates the statistics, ends the workers.
- ``torchrun``: the same ranks started by torchrun, one per process, on several hosts: rank
  0 drives (``TorchrunEngine``), the others run the worker loop.
- ``channel``: ``RankChannel``, the driver's and the leaders' messages over a gloo group
  (what pipes carry on one host).
"""
