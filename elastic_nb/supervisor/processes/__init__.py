"""The processes the supervisor owns: sites (a group's part on a machine, its ranks there; site,
local_site), the zygote and the launchers it forks (zygote_process, launcher_process), the pool
that keeps one warm (launcher_pool), and the end of a job's process tree (process_tree). The only
part of the supervisor that touches processes."""
