"""Launch: the torchrun command line, Slurm scripts, the supervised process tree, each rank's
process-group start-up (``dist``) and the collectives the runtime issues (``collectives``).
"""
