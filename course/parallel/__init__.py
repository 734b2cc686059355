"""The parallelism a student builds, each module the finished version of a notebook's exercises:
collectives by hand (10), DDP from scratch (10), ZeRO and FSDP (11), tensor (12), pipeline (13),
context (14) and expert (15) parallelism, pipeline schedules (16), 3-D parallelism and its planner (17), SyncBatchNorm (06).
May import ``course.observe`` and ``course.runtime``."""
