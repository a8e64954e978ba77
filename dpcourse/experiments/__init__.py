"""What the notebooks and the benchmark measure, apart from the lesson modules.

- ``timing``: the one way cases are timed (alternated round after round, slowest rank).
- ``simulated`` (chapter 05): LeNet's forward and backward with 1 or 2 threads.
- ``throughput`` (chapter 07): allreduce bandwidth, DDP variants, processes against threads.
- ``rank_demos`` (chapter 07): what the chapter runs on its ranks.
- ``performance`` (chapter 08): allreduce sweep and fits, anatomy of a step, buckets, scaling.
- ``zero_demos``, ``zero_memory`` (chapter 09): ZeRO checked and measured on ranks.
"""
