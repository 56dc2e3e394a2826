"""What the tests share, so that no test module imports from another: the scheduler driver and its
fake worker, one naive attention oracle, the HTTP helpers, servers in child processes, corpora
and workloads."""
