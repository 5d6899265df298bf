"""What runs in the user's kernel: the magics, flags into one JobSpec, the cell's checks, the
client of the supervisor, the job and session handles, and the two renderers (the dashboard and
text). It never imports torch: the ranks do."""
