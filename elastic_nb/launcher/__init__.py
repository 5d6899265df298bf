"""The launcher process: one per job, running torchelastic's `elastic_launch` on its main thread.

It is started by the supervisor as ``python -m elastic_nb.launcher`` (a package ``__main__``, so
spawn and forkserver children never re-import it), reads its job from stdin, reports what the
agent does over its stdout pipe, and writes everything torch logs into the run directory.
Nothing here is imported by the kernel or the supervisor.
"""
