"""Small helpers shared by the processes."""
