"""What the ranks train: CIFAR-10-format data made without a network, the reference experiment
of notebook 01, the one DDP training script every launcher runs, checkpoints and the crash
experiments that test them. May import ``course.observe`` and ``course.runtime``."""
