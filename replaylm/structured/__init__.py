"""Structured outputs: grammars compiled by xgrammar, their token masks filled per step.

``compiler`` turns a request's ``StructuredOutputsParams`` into a compiled grammar off the
engine thread (a small pool, a cache, a time limit); ``masks`` keeps each constrained
request's matcher, fills its next-token bitmask on the host before a step that samples it and
advances it by the tokens the step accepted. Applying the mask on the device is
``sampling.bitmask``'s (inside the captured step, ``graphs.whole``). A layer between the
engine and the graphs; see docs/structured_outputs.md.
"""
