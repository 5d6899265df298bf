"""The supervisor process (``python -m elastic_nb.supervisor``), one per kernel.

It never imports torch: it starts one launcher process per job, tails the ranks' log files,
watches their pids, decides how each job ended, and tears the job's process tree down.
"""
