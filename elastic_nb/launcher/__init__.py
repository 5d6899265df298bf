"""The launcher process: one per job, running torchelastic's `elastic_launch` on its main thread.

It is a fork of the zygote the supervisor starts as ``python -m elastic_nb.launcher FD``
(zygote.py: torch imported once, for every launcher), reads its job from stdin, reports what the
agent does over its stdout pipe, and writes everything torch logs into the run directory.
Nothing here is imported by the kernel or the supervisor.
"""
